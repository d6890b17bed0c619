"""Compile csrc/ into the op library for this machine, once, and cache it on disk.

The cache key is a hash of every source file's contents, the torch version, the compiler flags and the
CPU code path, so a second process (or a second run) loads the cached library in well under a second and
any change to the sources rebuilds. A file lock keeps two processes from compiling the same key at once.

Environment:
  FP8KV_CACHE_DIR   fp8kv's cache root; built libraries live in its ops/ folder
                    (default $XDG_CACHE_HOME/fp8kv/ops or ~/.cache/fp8kv/ops)
  CXX, CC           the C++ / C compiler (default: c++, g++ or clang++ on PATH; if the library one builds
                    fails its self-check, the next one is tried, e.g. the system g++ after a relocated one;
                    the one that worked is remembered in ops/compiler.json and tried first from then on)
  MAX_JOBS          parallel compile jobs (torch's ninja convention)

The CUDA (or ROCm) sources are compiled only for a GPU device: `load_library(device)` with a CPU device builds
the CPU ops alone, so a GPU host without nvcc still runs on its CPU.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("fp8kv.ops")

CPU_ISAS = ("native", "avx512", "avx2", "scalar")
_SOURCE_SUFFIXES = (".h", ".hpp", ".cuh", ".cpp", ".cc", ".cu")


@dataclass(frozen=True)
class BuildResult:
    path: str  # the loaded shared library
    compiled: bool  # False when a cached library was reused
    seconds: float
    isa: str
    with_cuda: bool


_loaded: BuildResult | None = None


def source_dir() -> Path:
    """csrc/ shipped inside the package (non-editable installs) or at the repository root."""
    package = Path(__file__).resolve().parents[1]
    candidates = (package / "csrc", package.parent / "csrc")
    for candidate in candidates:
        if (candidate / "torch_bindings.cpp").is_file():
            return candidate
    raise RuntimeError(
        "fp8kv C++ sources not found (looked for torch_bindings.cpp in "
        + ", ".join(str(c) for c in candidates) + "); reinstall the package with `pip install .`")


def cache_dir() -> Path:
    if os.environ.get("FP8KV_CACHE_DIR"):
        return Path(os.environ["FP8KV_CACHE_DIR"]).expanduser() / "ops"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fp8kv" / "ops"


def requested_isa(cpu_isa: str | None = None) -> str:
    """The CPU path to build: `native` (the best this CPU runs) unless a lower one is asked for by name,
    which the tests do to check the AVX2 and portable paths on an AVX-512 machine."""
    isa = (cpu_isa or "native").strip().lower() or "native"
    if isa not in CPU_ISAS:
        raise ValueError(f"CPU path {isa!r} is not one of: {', '.join(CPU_ISAS)}")
    return isa


_CPU_IDENTITY_KEYS = ("vendor_id", "cpu family", "model", "model name", "flags", "CPU implementer",
                      "CPU architecture", "CPU variant", "CPU part", "Features")


def _first_cpu_lines() -> dict[str, str]:
    """The first processor's `key : value` lines of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_feature_names() -> set[str]:
    """The CPU's feature names as /proc/cpuinfo spells them: x86 `flags` and Arm `Features` together."""
    fields = _first_cpu_lines()
    return set(fields.get("flags", "").split()) | set(fields.get("Features", "").split())


def _cpu_identity() -> str:
    """What -march=native / -mcpu=native compile for: the first CPU's model and feature lines. A cache
    directory that moves to another machine (a shared home, a copied image) must not hand it a library
    built with instructions it lacks."""
    fields = _first_cpu_lines()
    lines = [f"{key} : {fields[key]}" for key in _CPU_IDENTITY_KEYS if key in fields]
    return "\n".join(lines) or platform.processor()


def cpu_identity_hash() -> str:
    """A short stable name for this CPU model and its features (keys of measurements kept on disk)."""
    return hashlib.sha256(_cpu_identity().encode()).hexdigest()[:16]


def _isa_cflags(isa: str) -> list[str]:
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686")
    if isa == "scalar":
        return ["-DFP8KV_FORCE_SCALAR"]
    if not x86:
        if isa in ("avx512", "avx2"):
            raise RuntimeError(f"the {isa} CPU path needs an x86-64 CPU; this is {platform.machine()}")
        return ["-mcpu=native"]
    flags = cpu_feature_names()
    if isa == "avx512" and not {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi"} <= flags:
        raise RuntimeError("the avx512 CPU path needs AVX-512 F/BW/VL/DQ/VBMI, which this CPU lacks; "
                           "use native or avx2")
    if isa == "avx2":
        if flags and "avx2" not in flags:
            raise RuntimeError("the avx2 CPU path needs AVX2, which this CPU lacks; use native or scalar")
        return ["-march=native", "-mno-avx512f"]
    return ["-march=native"]


def _compilers() -> list[str]:
    """C++ compilers to try, in order, each once: $CXX, then c++, g++, the system g++, clang++ on PATH; those
    that link the libstdc++ this process runs on first (a library linked to another one crashes here)."""
    found: list[str] = []
    for candidate in (os.environ.get("CXX"), "c++", "g++", "/usr/bin/g++", "clang++"):
        path = shutil.which(candidate) if candidate else None
        if path and os.path.realpath(path) not in {os.path.realpath(f) for f in found}:
            found.append(path)
    if not found:
        raise RuntimeError("no C++ compiler found: install g++ (apt-get install g++) or set CXX")
    loaded = _loaded_libstdcxx()
    if loaded is None:
        return found
    return sorted(found, key=lambda cxx: _libstdcxx_of(cxx) not in (None, loaded))  # stable: ties keep order


def _loaded_libstdcxx() -> str | None:
    """The libstdc++ mapped into this process (torch brought it), None where that cannot be read."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libstdc++.so" in path:
                    return os.path.realpath(path)
    except OSError:
        pass
    return None


def _libstdcxx_of(cxx: str) -> str | None:
    """The libstdc++ a compiler links against (its -print-file-name), None if it does not say."""
    try:
        out = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True, timeout=30,
                             check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return os.path.realpath(out) if os.path.isabs(out) and os.path.exists(out) else None


def _compiler() -> str:
    return _compilers()[0]


# Which compiler built a working library, remembered in the ops cache: without it every start on a machine
# whose first compiler builds a broken library (a CUDA image's relocated /opt/gcc g++) relinked that library,
# ran its self-check, saw it fail and went on to the next compiler: 8 s and an alarming line at every start.
COMPILER_MEMORY = "compiler.json"


def _toolchain_key(compilers: list[str]) -> str:
    """What decides which compiler builds a working library: the candidates in order, each one's version and
    libstdc++, the libstdc++ this process runs on and torch's version. Any change is a new toolchain, probed
    afresh."""
    h = hashlib.sha256()
    for part in (torch.__version__, str(_loaded_libstdcxx())):
        h.update(part.encode() + b"\0")
    for cxx in compilers:
        for part in (cxx, os.path.realpath(cxx), _compiler_version(cxx), str(_libstdcxx_of(cxx))):
            h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _read_compiler_memory() -> dict:
    try:
        with open(cache_dir() / COMPILER_MEMORY, encoding="utf-8") as f:
            memory = json.load(f)
    except (OSError, ValueError):
        return {}
    return memory if isinstance(memory, dict) else {}


def _ordered_compilers() -> tuple[list[str], str]:
    """(_compilers() with the one remembered to work first and those remembered to fail last, the toolchain
    key); the plain order when nothing is remembered for this toolchain."""
    compilers = _compilers()
    key = _toolchain_key(compilers)
    memory = _read_compiler_memory()
    if memory.get("toolchain") != key:
        return compilers, key
    works, failed = memory.get("works"), set(memory.get("failed") or [])
    first = [works] if works in compilers else []
    rest = [c for c in compilers if c not in first]
    return first + [c for c in rest if c not in failed] + [c for c in rest if c in failed], key


def _remember_compiler(key: str, works: str, failed: list[str]) -> None:
    """Add what this start learnt to what is remembered for this toolchain, written only when that changes
    (a failure to write costs nothing but the next start's probe)."""
    old = _read_compiler_memory()
    known = set(old.get("failed") or []) if old.get("toolchain") == key else set()
    memory = {"toolchain": key, "works": works, "failed": sorted((known | set(failed)) - {works})}
    if old == memory:
        return
    path = cache_dir() / COMPILER_MEMORY
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memory, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        logger.debug("could not remember the compiler in %s: %s", path, exc)


def _c_compiler_for(cxx: str) -> str | None:
    """The C compiler beside a C++ one (g++ -> gcc, clang++ -> clang, c++ -> cc): nvcc's host compiler."""
    directory, name = os.path.split(cxx)
    for suffix, c_name in (("g++", "gcc"), ("clang++", "clang"), ("c++", "cc")):
        if name.endswith(suffix):
            sibling = os.path.join(directory, name[: -len(suffix)] + c_name)
            return sibling if os.access(sibling, os.X_OK) else None
    return None


def _gpu_compiler() -> str | None:
    """nvcc (CUDA) or hipcc (ROCm) for this torch, None if there is none."""
    from torch.utils import cpp_extension

    if getattr(torch.version, "hip", None):
        home, tool = getattr(cpp_extension, "ROCM_HOME", None), "hipcc"
    else:
        home, tool = getattr(cpp_extension, "CUDA_HOME", None), "nvcc"
    if home and os.access(os.path.join(home, "bin", tool), os.X_OK):
        return os.path.join(home, "bin", tool)
    return shutil.which(tool)


def _wants_gpu(device: torch.device | str | None) -> bool:
    """Whether the library must hold the GPU ops: for a GPU device; for none (auto), when torch sees a GPU and
    its compiler is here."""
    if device is not None and str(device) != "auto":
        device = torch.device(device)
        if device.type in ("cpu", "meta"):
            return False
        if _gpu_compiler() is None:
            raise RuntimeError(f"the GPU ops for {device} need "
                               f"{'hipcc (ROCm)' if getattr(torch.version, 'hip', None) else 'nvcc (the CUDA toolkit)'}"
                               ", which is not installed here; install it, or run with --device cpu")
        return True
    return torch.cuda.is_available() and _gpu_compiler() is not None


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], check=False, capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _check_ninja() -> None:
    if shutil.which("ninja") is None:
        raise RuntimeError("ninja not found: the op library is compiled with ninja; run `pip install ninja`")


def _cuda_sources(root: Path, with_gpu: bool) -> list[Path]:
    """CUDA (or, on a ROCm torch, hipified) sources, when the library is built for a GPU."""
    if not with_gpu:
        return []
    return sorted((root / "cuda").glob("*.cu")) if (root / "cuda").is_dir() else []


def _all_source_files(root: Path, with_cuda: bool) -> list[Path]:
    """Every file the build may read; cuda/ only counts when it is compiled."""
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and p.suffix in _SOURCE_SUFFIXES
                  and (with_cuda or p.relative_to(root).parts[0] != "cuda"))


def _extra_cuda_cflags(root: Path) -> list[str]:
    # csrc/cuda/nvcc_flags.txt (one flag a line) lets the CUDA sources carry their own flags.
    flags = ["-O3"]
    flag_file = root / "cuda" / "nvcc_flags.txt"
    if flag_file.is_file():
        flags += [ln.strip() for ln in flag_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return flags


def _build_key(root: Path, cflags: list[str], cuda_cflags: list[str], isa: str, cxx: str,
               with_cuda: bool) -> str:
    h = hashlib.sha256()
    for part in (torch.__version__, str(torch.version.cuda), str(getattr(torch.version, "hip", None)),
                 platform.python_version(), platform.machine(), isa, " ".join(cflags), cxx,
                 _compiler_version(cxx), str(with_cuda), " ".join(cuda_cflags if with_cuda else []),
                 _cpu_identity() if any("native" in flag for flag in cflags) else ""):
        h.update(part.encode())
        h.update(b"\0")
    for path in _all_source_files(root, with_cuda):
        h.update(str(path.relative_to(root)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _notify(callback: Callable[[str], None] | None, message: str) -> None:
    logger.info(message)
    if callback is not None:
        callback(message)


def build(verbose: bool = False, progress_callback: Callable[[str], None] | None = None,
          device: torch.device | str | None = None, cpu_isa: str | None = None) -> str:
    """Compile (unless cached) and load the op library into this process; returns its path."""
    return load_library(verbose=verbose, progress_callback=progress_callback, device=device, cpu_isa=cpu_isa).path


def load_library(verbose: bool = False, progress_callback: Callable[[str], None] | None = None,
                 device: torch.device | str | None = None, cpu_isa: str | None = None) -> BuildResult:
    """Idempotent per process: later calls return the library the first call loaded (one op library per
    process: a CPU-only one cannot grow GPU ops later, which is an error naming the fix). cpu_isa: a CPU path
    other than the native one (avx512, avx2, scalar), for tests of the lower paths."""
    global _loaded
    if _loaded is not None:
        if cpu_isa is not None and requested_isa(cpu_isa) != _loaded.isa:
            raise RuntimeError(f"this process loaded the {_loaded.isa} CPU path of the fp8kv op library; "
                               f"start a new process for the {cpu_isa} one")
        # Asked for no device in particular (the ops' wrappers, tests): whatever this process loaded.
        if not _loaded.with_cuda and device is not None and str(device) != "auto" and _wants_gpu(device):
            raise RuntimeError(f"this process loaded the fp8kv op library without its GPU sources "
                               f"({_loaded.path}), so it cannot run on {device}; start a new process for the GPU")
        return _loaded
    start = time.perf_counter()
    root = source_dir()
    isa = requested_isa(cpu_isa)
    cflags = ["-O3", "-std=c++17", "-fopenmp", "-Wall", "-Wno-unused-function", *_isa_cflags(isa)]
    cuda = _cuda_sources(root, _wants_gpu(device))
    cuda_cflags = _extra_cuda_cflags(root) if cuda else []
    failures: list[str] = []
    failed: list[str] = []
    compilers, toolchain = _ordered_compilers()
    for cxx in compilers:
        library, compiled, error = _library_for(root, cflags, cuda, cuda_cflags, isa, cxx, verbose, progress_callback)
        if error is None:
            break
        failures.append(error)
        failed.append(cxx)
        _notify(progress_callback, f"{error}; trying the next compiler")
    else:
        raise RuntimeError(failures[-1] if len(failures) == 1 else
                           "no compiler here builds a working op library:\n" + "\n".join(failures))
    _remember_compiler(toolchain, cxx, failed)
    torch.ops.load_library(str(library))
    _loaded = BuildResult(str(library), compiled, time.perf_counter() - start, isa, bool(cuda))
    verb = "compiled" if compiled else "reused cached"
    _notify(progress_callback, f"{verb} fp8kv op library ({_compiled_isa(isa)} CPU path"
            f"{', CUDA' if cuda else ''}, {cxx}) in {_loaded.seconds:.1f}s: {library}")
    return _loaded


def _library_for(root: Path, cflags: list[str], cuda: list[Path], cuda_cflags: list[str], isa: str, cxx: str,
                 verbose: bool, progress_callback) -> tuple[Path, bool, str | None]:
    """(path, compiled now, why it failed or None): the cached library of this compiler, else one compiled
    and checked in child processes, so a broken one never enters this process."""
    key = _build_key(root, cflags, cuda_cflags, isa, cxx, bool(cuda))
    name = f"fp8kv_ops_{key}"
    build_dir = cache_dir() / name
    library = build_dir / f"{name}.so"
    if library.is_file():
        return library, False, None
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f"{name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process compiles this very key: wait for it, and say so
            _notify(progress_callback, f"waiting for another process that compiles the fp8kv op library ({name})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if library.is_file():
            return library, False, None
        # A compile killed mid-way leaves torch's own lock file, on which every later build would wait forever;
        # holding our lock, nobody else is building here.
        (build_dir / "lock").unlink(missing_ok=True)
        _compile(name, root, build_dir, cflags, cuda, cuda_cflags, cxx, verbose, progress_callback)
        try:
            check_errors_raise(library, cxx)
        except RuntimeError as exc:
            return library, True, str(exc)
    return library, True, None


# An op that fails with a message holding numbers: the C++ exception and its string formatting must reach
# Python as a RuntimeError.
_ERROR_PROBE = """
import sys, torch
torch.ops.load_library(sys.argv[1])
try:
    torch.ops.fp8kv.hadamard_transform(torch.zeros(1, 100))
except RuntimeError as exc:
    sys.exit(0 if "100" in str(exc) else 3)
sys.exit(4)
"""


def check_errors_raise(library: Path, cxx: str) -> None:
    """Run one failing op in a child process; if that crashes, remove the library and say which compiler
    built it. Seen on a GPU machine whose CXX was a relocated g++ (/opt/gcc, its own libstdc++ beside it):
    every argument error of every op killed the process (a segfault formatting the message) instead of
    raising; the system g++ of the same version built a library that raised."""
    try:
        result = subprocess.run([sys.executable, "-c", _ERROR_PROBE, str(library)], capture_output=True,
                                text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        return  # a slow machine is not a broken build
    if result.returncode == 0:
        return
    library.unlink(missing_ok=True)
    how = f"signal {-result.returncode}" if result.returncode < 0 else f"exit status {result.returncode}"
    raise RuntimeError(
        f"the op library built with {cxx} does not survive an op's argument error ({how}; "
        f"{result.stderr.strip()[-300:] or 'no output'}). Seen when the compiler links a libstdc++ other "
        "than the one Python loads. Point CXX and CC at the system compiler (e.g. CXX=/usr/bin/g++ "
        "CC=/usr/bin/gcc) and run `fp8kv build` again.")


def _compiled_isa(requested: str) -> str:
    try:
        return torch.ops.fp8kv.cpu_isa()
    except (AttributeError, RuntimeError):
        return requested


def _compile(name: str, root: Path, build_dir: Path, cflags: list[str], cuda: list[Path],
             cuda_cflags: list[str], cxx: str, verbose: bool,
             progress_callback: Callable[[str], None] | None) -> None:
    """Compile in a child process (which loads the library to finish; this process loads it only once it
    passed its check). Ctrl-C stops the child and the compilers it started."""
    _check_ninja()
    sources = [root / "torch_bindings.cpp", *sorted((root / "cpu").glob("*.cpp")), *cuda]
    _notify(progress_callback, f"compiling the fp8kv op library ({len(sources)} sources, once per "
            f"source version; about a minute{' (several with the GPU sources)' if cuda else ''}) with {cxx} "
            f"into {build_dir}")
    spec = {"name": name, "sources": [str(s) for s in sources], "cflags": cflags + (["-DFP8KV_WITH_CUDA"] if cuda else []),
            "cuda_cflags": cuda_cflags, "root": str(root), "build_dir": str(build_dir), "verbose": verbose}
    env = dict(os.environ, CXX=cxx)
    cc = _c_compiler_for(cxx)
    if cc is not None:
        env["CC"] = cc  # nvcc's host compiler, so that both halves link one libstdc++
    child = subprocess.Popen([sys.executable, "-m", "fp8cache.ops._build", json.dumps(spec)], env=env,
                             stdout=None if verbose else subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        output, _ = child.communicate()
    except BaseException:  # Ctrl-C or a kill of this process: take the compilers down too
        _kill_group(child)
        raise
    if child.returncode != 0:
        tail = (output or "").strip()[-3000:]
        raise RuntimeError(f"compiling the fp8kv op library with {cxx} failed (exit {child.returncode})"
                           + (f":\n{tail}" if tail else "; run `fp8kv build --verbose` for the compiler output"))


def _kill_group(child: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _compile_in_this_process(spec: dict) -> None:
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=spec["name"], sources=spec["sources"], extra_cflags=spec["cflags"],
        extra_cuda_cflags=spec["cuda_cflags"], extra_ldflags=["-fopenmp"], extra_include_paths=[spec["root"]],
        build_directory=spec["build_dir"], is_python_module=False, verbose=spec["verbose"])


def library_path() -> str | None:
    """Path of the library loaded in this process, None before the first load."""
    return _loaded.path if _loaded is not None else None


def last_build() -> BuildResult | None:
    return _loaded


if __name__ == "__main__":  # the compile child of _compile
    _compile_in_this_process(json.loads(sys.argv[1]))
