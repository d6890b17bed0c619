"""Compile csrc/ into the op library for this machine, once, and cache it on disk.

The cache key is a hash of every source file's contents, the torch version, the compiler flags and the
CPU code path, so a second process (or a second run) loads the cached library in well under a second and
any change to the sources rebuilds. A file lock keeps two processes from compiling the same key at once.

Crash safety: a library is compiled into a work folder of its own, checked in a child process (an op's
argument error must raise), given a manifest (its size and SHA-256), flushed to disk and only then renamed
into place, so a killed build, a full disk or a crash never leaves a library that a later start would load.
Each start checks the installed library against its manifest before loading it (a cut-short library mapped
into a process dies of SIGBUS, with no message): a damaged one is moved aside with one log line and rebuilt.
The compile child holds the build lock with its parent and dies with it (PR_SET_PDEATHSIG, taking its
compilers along), so a start after a kill -9 never builds beside an orphaned compile.

Environment:
  FP8KV_CACHE_DIR   fp8kv's cache root; built libraries live in its ops/ folder
                    (default $XDG_CACHE_HOME/fp8kv/ops or ~/.cache/fp8kv/ops)
  CXX, CC           the C++ / C compiler (default: c++, g++ or clang++ on PATH; if the library one builds
                    fails its self-check, the next one is tried, e.g. the system g++ after a relocated one;
                    the one that worked is remembered in ops/compiler.json and tried first from then on)
  MAX_JOBS          compilers run at once (torch's ninja convention; default: one per usable core)

`fp8kv run` and `generate` start the build (build_ahead) before they fetch, convert and load the model, so that
a first start compiles meanwhile; the compile says how long the last one on this machine took, never a guess.

The CUDA (or ROCm) sources are compiled only for a GPU device: `load_library(device)` with a CPU device builds
the CPU ops alone, so a GPU host without nvcc still runs on its CPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fp8cache.platform import cpu_info, paths
from fp8cache.platform.device import gpu_available
from fp8cache.platform.fsync import fsync_path

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
_clock = time.perf_counter  # a build's seconds (the tests' clock in tests/ops/test_build.py)


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
    return Path(paths.ops_dir())


def requested_isa(cpu_isa: str | None = None) -> str:
    """The CPU path to build: `native` (the best this CPU runs) unless a lower one is asked for by name,
    which the tests do to check the AVX2 and portable paths on an AVX-512 machine."""
    isa = (cpu_isa or "native").strip().lower() or "native"
    if isa not in CPU_ISAS:
        raise ValueError(f"CPU path {isa!r} is not one of: {', '.join(CPU_ISAS)}")
    return isa


def _cpu_identity() -> str:
    """What -march=native / -mcpu=native compile for: the first CPU's model and feature lines. A cache
    directory that moves to another machine (a shared home, a copied image) must not hand it a library
    built with instructions it lacks."""
    fields = cpu_info.first_cpu_lines()
    lines = [f"{key} : {fields[key]}" for key in cpu_info.IDENTITY_KEYS if key in fields]
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
    flags = cpu_info.cpu_feature_names()
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


def _read_cache_record(name: str) -> dict:
    """The JSON object the ops cache keeps in `name`; {} when it is missing, unreadable or not an object."""
    try:
        with open(cache_dir() / name, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_cache_record(name: str, record: dict) -> None:
    """Replace `name` in the ops cache with `record` at once (a reader sees the old file or the new one); a
    failure to write costs only what the record would have saved."""
    path = cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        logger.debug("could not write %s: %s", path, exc)


def _ordered_compilers() -> tuple[list[str], str]:
    """(_compilers() with the one remembered to work first and those remembered to fail last, the toolchain
    key); the plain order when nothing is remembered for this toolchain."""
    compilers = _compilers()
    key = _toolchain_key(compilers)
    memory = _read_cache_record(COMPILER_MEMORY)
    if memory.get("toolchain") != key:
        return compilers, key
    works, failed = memory.get("works"), set(memory.get("failed") or [])
    first = [works] if works in compilers else []
    rest = [c for c in compilers if c not in first]
    return first + [c for c in rest if c not in failed] + [c for c in rest if c in failed], key


def _remember_compiler(key: str, works: str, failed: list[str]) -> None:
    """Add what this start learnt to what is remembered for this toolchain, written only when that changes
    (a failure to write costs nothing but the next start's probe)."""
    old = _read_cache_record(COMPILER_MEMORY)
    known = set(old.get("failed") or []) if old.get("toolchain") == key else set()
    memory = {"toolchain": key, "works": works, "failed": sorted((known | set(failed)) - {works})}
    if old != memory:
        _write_cache_record(COMPILER_MEMORY, memory)


# How long the last compile of each kind took here, so that the next one (a new fp8kv version's sources) can say
# how long it will take from a measurement rather than a guess.
BUILD_TIMES = "build_times.json"


def _build_kind(cflags: list[str] | tuple[str, ...], with_cuda: bool) -> str:
    """What a compile's time depends on besides the sources: the flags, GPU sources or not, this CPU, its cores."""
    return (f"{' '.join(cflags)}{' +gpu' if with_cuda else ''} cpu={cpu_identity_hash()} "
            f"cores={cpu_info.usable_cores()}")


def _last_build_seconds(kind: str) -> float | None:
    seconds = _read_cache_record(BUILD_TIMES).get(kind)
    return float(seconds) if isinstance(seconds, (int, float)) and seconds > 0 else None


def _remember_build_seconds(kind: str, seconds: float) -> None:
    _write_cache_record(BUILD_TIMES, {**_read_cache_record(BUILD_TIMES), kind: round(seconds, 1)})


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
    return gpu_available() and _gpu_compiler() is not None


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
    return sources_key(root, with_cuda, torch.__version__, str(torch.version.cuda),
                       str(getattr(torch.version, "hip", None)), platform.python_version(), platform.machine(), isa,
                       " ".join(cflags), cxx, _compiler_version(cxx), str(with_cuda),
                       " ".join(cuda_cflags if with_cuda else []),
                       _cpu_identity() if any("native" in flag for flag in cflags) else "")


def sources_key(root: Path, with_cuda: bool, *settings: str) -> str:
    """A short key of `settings` and of every source file under root (names and contents): the folder name of
    a build from these sources (the op library's; the tests' host emulation of the GPU kernels)."""
    h = hashlib.sha256()
    for part in settings:
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
    other than the native one (avx512, avx2, scalar), for tests of the lower paths. A build_ahead() of the same
    library is waited for and taken, not started again."""
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
    plan = _plan(device, cpu_isa)
    made = _take_ahead(plan) or _make(plan, verbose, progress_callback)
    torch.ops.load_library(str(made.library))
    _loaded = BuildResult(str(made.library), made.compiled, made.seconds, plan.isa, bool(plan.cuda))
    verb = "compiled" if made.compiled else "reused cached"
    _notify(progress_callback, f"{verb} fp8kv op library ({_compiled_isa(plan.isa)} CPU path"
            f"{', CUDA' if plan.cuda else ''}, {made.cxx}) in {made.seconds:.1f}s: {made.library}")
    return _loaded


@dataclass(frozen=True)
class _Plan:
    """What to build: the sources' folder, the CPU path and its flags, the GPU sources (none for a CPU)."""
    root: Path
    isa: str
    cflags: tuple[str, ...]
    cuda: tuple[Path, ...]
    cuda_cflags: tuple[str, ...]


@dataclass(frozen=True)
class _Made:
    library: Path  # installed and checked, not loaded yet
    compiled: bool
    seconds: float
    cxx: str


def _plan(device: torch.device | str | None, cpu_isa: str | None) -> _Plan:
    root = source_dir()
    isa = requested_isa(cpu_isa)
    cflags = ("-O3", "-std=c++17", "-fopenmp", "-Wall", "-Wno-unused-function", *_isa_cflags(isa))
    cuda = tuple(_cuda_sources(root, _wants_gpu(device)))
    return _Plan(root, isa, cflags, cuda, tuple(_extra_cuda_cflags(root)) if cuda else ())


def _make(plan: _Plan, verbose: bool, progress_callback: Callable[[str], None] | None) -> _Made:
    """The installed library of `plan`: the cached one if it is whole, else compiled and checked, with the first
    compiler whose library passes its check."""
    start = _clock()
    failures: list[str] = []
    failed: list[str] = []
    compilers, toolchain = _ordered_compilers()
    for cxx in compilers:
        library, compiled, error = _library_for(plan.root, list(plan.cflags), list(plan.cuda),
                                                list(plan.cuda_cflags), plan.isa, cxx, verbose, progress_callback)
        if error is None:
            break
        failures.append(error)
        failed.append(cxx)
        _notify(progress_callback, f"{error}; trying the next compiler")
    else:
        raise RuntimeError(failures[-1] if len(failures) == 1 else
                           "no compiler here builds a working op library:\n" + "\n".join(failures))
    _remember_compiler(toolchain, cxx, failed)
    seconds = _clock() - start
    if compiled:
        _remember_build_seconds(_build_kind(plan.cflags, bool(plan.cuda)), seconds)
    return _Made(library, compiled, seconds, cxx)


# -- building ahead: the compile runs while a first start fetches, converts and loads its model -------------------

class _Ahead:
    """_make(plan) in a thread (which mostly waits for the compile child); take() waits for its result."""

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan
        self.made: _Made | None = None
        self.error: BaseException | None = None
        # A daemon: a start that fails meanwhile exits without waiting, and the compile child dies with it.
        self.thread = threading.Thread(target=self._run, name="fp8kv-ops-build", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.made = _make(self.plan, verbose=False, progress_callback=None)
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that loads the library
            self.error = exc

    def take(self) -> _Made:
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.made is not None
        return self.made


_ahead: _Ahead | None = None


def build_ahead(device: torch.device | str | None = None) -> None:
    """Start making the op library for `device` (as load_library(device) would: compiled unless cached, checked,
    installed) in the background, so that a first start downloads, converts and loads its model meanwhile
    instead of before. The next load_library takes the result (or its error). Once per process."""
    global _ahead
    if _loaded is None and _ahead is None:
        _ahead = _Ahead(_plan(device, None))


def _take_ahead(plan: _Plan) -> _Made | None:
    """The library build_ahead made for `plan`, None if none was started or it was for another plan."""
    global _ahead
    ahead, _ahead = _ahead, None
    if ahead is None:
        return None
    try:
        made = ahead.take()
    except Exception:
        if ahead.plan == plan:
            raise
        return None
    return made if ahead.plan == plan else None


# Files and folders of the ops cache besides the installed libraries (ops/fp8kv_ops_<key>/).
MANIFEST = "manifest.json"  # beside each installed library: its size and SHA-256, written once it passed its check
_WORK_MARK = ".tmp-"  # fp8kv_ops_<key>.tmp-XXXX: a build in progress (or one whose builder died)
_DAMAGED_MARK = ".damaged"  # fp8kv_ops_<key>.damaged: the last damaged library of that key, moved aside
_MISSING, _UNCHECKED = "missing", "unchecked"


def _library_for(root: Path, cflags: list[str], cuda: list[Path], cuda_cflags: list[str], isa: str, cxx: str,
                 verbose: bool, progress_callback) -> tuple[Path, bool, str | None]:
    """(path, compiled now, why it failed or None): the installed library of this compiler if it is whole,
    else one compiled and checked in child processes, so a broken one never enters this process."""
    key = _build_key(root, cflags, cuda_cflags, isa, cxx, bool(cuda))
    name = f"fp8kv_ops_{key}"
    ops_dir = cache_dir()
    installed = ops_dir / name
    library = installed / f"{name}.so"
    if installed_problem(installed) is None:
        return library, False, None
    ops_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(ops_dir / f"{name}.lock", name, progress_callback) as lock_fd:
        problem = installed_problem(installed)
        if problem is None:  # another process installed it while we waited for the lock
            return library, False, None
        _remove_work_dirs(ops_dir, name)  # we hold the lock: whoever made them is gone
        if problem == _UNCHECKED:  # installed by an older fp8kv, without a manifest: check it once
            crash = _probe_crash(library)
            if crash is None:
                _write_manifest(installed, library.name)
                return library, False, None
            problem = f"loading it and running an op {crash}"
        if problem != _MISSING:
            _move_aside(installed, problem, progress_callback)
        work = Path(tempfile.mkdtemp(prefix=name + _WORK_MARK, dir=ops_dir))
        try:
            _share_like_the_umask(work)
            _compile(name, root, work, cflags, cuda, cuda_cflags, cxx, verbose, progress_callback, lock_fd)
            try:
                check_errors_raise(work / library.name, cxx)
            except RuntimeError as exc:
                return library, True, str(exc)
            _install(work, installed, library.name)
        finally:
            shutil.rmtree(work, ignore_errors=True)  # gone already once installed
    return library, True, None


def installed_problem(installed: Path) -> str | None:
    """What is wrong with the library installed in the folder `installed`, None if it is whole: "missing" (no
    folder), "unchecked" (a library without a manifest, from an fp8kv before manifests), or the damage."""
    if not installed.is_dir():
        return _MISSING
    library = installed / f"{installed.name}.so"
    manifest_path = installed / MANIFEST
    if not library.is_file():
        return "its library file is missing"
    if not manifest_path.is_file():
        return elf_problem(library) or _UNCHECKED
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        size, digest = int(manifest["bytes"]), str(manifest["sha256"])
    except (OSError, ValueError, TypeError, KeyError):
        return f"its manifest {manifest_path} is unreadable"
    actual = library.stat().st_size
    if actual != size:
        return f"{library.name} has {actual} bytes where {size} were written"
    if _sha256(library) != digest:
        return f"the SHA-256 of {library.name} is not the one written with it"
    return None


def elf_problem(path: Path) -> str | None:
    """Why the shared library at `path` is not a whole ELF file, None if every byte its headers describe (program
    segments, sections, both header tables) is there. The dynamic loader maps what the headers say; a page past
    the end of a cut-short file is a SIGBUS when first touched, maybe long after the load."""
    import struct

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        return f"it cannot be read ({exc.strerror})"
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        return f"{path.name} is not an ELF shared library ({len(data)} bytes)"
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    header = struct.unpack_from(order + ("QQ" if wide else "II"), data, 32 if wide else 28)
    counts = struct.unpack_from(order + "6H", data, 52 if wide else 40)  # ehsize, phentsize, phnum, shentsize, ...
    phoff, shoff = header
    phentsize, phnum, shentsize, shnum = counts[1], counts[2], counts[3], counts[4]
    needed = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    if needed > len(data):
        return f"{path.name} has {len(data)} bytes, fewer than its ELF header tables need ({needed})"
    for i in range(phnum):  # p_offset, p_filesz
        at = phoff + i * phentsize
        offset, size = (struct.unpack_from(order + "QQQQ", data, at + 8)[::3] if wide else
                        struct.unpack_from(order + "IIIII", data, at + 4)[::4])
        needed = max(needed, offset + size)
    for i in range(shnum):  # sh_type, sh_offset, sh_size (SHT_NOBITS, 8, has no bytes in the file)
        at = shoff + i * shentsize
        kind = struct.unpack_from(order + "I", data, at + 4)[0]
        offset, size = (struct.unpack_from(order + "QQ", data, at + 24) if wide else
                        struct.unpack_from(order + "II", data, at + 16))
        if kind != 8:
            needed = max(needed, offset + size)
    if needed > len(data):
        return f"{path.name} has {len(data)} bytes, fewer than the {needed} its ELF headers describe"
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _build_lock(path: Path, name: str, progress_callback) -> Iterator[int]:
    """Hold the build lock of one key; yields its file descriptor, which the compile child inherits, so that an
    orphaned compile still holds the lock and a later start waits for it instead of building beside it."""
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process compiles this very key: wait for it, and say so
            _notify(progress_callback, f"waiting for another process that compiles the fp8kv op library ({name})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield lock.fileno()


def _remove_work_dirs(ops_dir: Path, name: str) -> None:
    """Work folders of `name` left by a killed build; only with its lock held."""
    for work in ops_dir.glob(name + _WORK_MARK + "*"):
        shutil.rmtree(work, ignore_errors=True)


def _move_aside(installed: Path, problem: str, progress_callback) -> None:
    """One log line, and the damaged library out of the way (the last one of a key kept for a look)."""
    aside = installed.with_name(installed.name + _DAMAGED_MARK)
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(installed, aside)
    message = (f"the cached fp8kv op library {installed} is damaged ({problem}): moved it aside to {aside} "
               "and building it again")
    logger.warning(message)
    if progress_callback is not None:
        progress_callback(message)


def _share_like_the_umask(folder: Path) -> None:
    # mkdtemp makes 0700 folders; an installed library folder is shared like any other the umask allows.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)


def _write_manifest(folder: Path, library_name: str) -> None:
    """The manifest of folder/library_name as it is on disk now, flushed, replacing any older one whole."""
    library = folder / library_name
    fsync_path(library)
    manifest = {"library": library_name, "bytes": library.stat().st_size, "sha256": _sha256(library),
                "checked": "an op's argument error raised in a child process"}
    scratch = folder / f"{MANIFEST}.{os.getpid()}"
    with open(scratch, "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(scratch, folder / MANIFEST)
    fsync_path(folder)


def _install(work: Path, installed: Path, library_name: str) -> None:
    """Put a checked build in place: manifest, everything flushed, then one rename (whole or not at all)."""
    _write_manifest(work, library_name)
    os.rename(work, installed)
    fsync_path(installed.parent)


# An op that fails with a message holding numbers: the C++ exception and its string formatting must reach
# Python as a RuntimeError. The child dies with its parent (PR_SET_PDEATHSIG) where Linux offers it.
_ERROR_PROBE = """
import ctypes, signal, sys
try:
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
except (AttributeError, OSError):
    pass
import torch
torch.ops.load_library(sys.argv[1])
try:
    torch.ops.fp8kv.hadamard_transform(torch.zeros(1, 100))
except RuntimeError as exc:
    sys.exit(0 if "100" in str(exc) else 3)
sys.exit(4)
"""


def _probe_crash(library: Path) -> str | None:
    """How loading `library` and failing one op in a child process went wrong ("died of signal 7 (SIGBUS)",
    "exited with status 3: ..."), None if the error was raised as it should be."""
    try:
        result = subprocess.run([sys.executable, "-c", _ERROR_PROBE, str(library)], capture_output=True,
                                text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        return None  # a slow machine is not a broken build
    if result.returncode == 0:
        return None
    if result.returncode < 0:
        try:
            signame = signal.Signals(-result.returncode).name
        except ValueError:
            signame = "an unknown signal"
        how = f"signal {-result.returncode} ({signame})"
    else:
        how = f"exit status {result.returncode}"
    return f"{how}; {result.stderr.strip()[-300:] or 'no output'}"


def check_errors_raise(library: Path, cxx: str) -> None:
    """Run one failing op in a child process; if that crashes, remove the library and say which compiler
    built it. Seen on a GPU machine whose CXX was a relocated g++ (/opt/gcc, its own libstdc++ beside it):
    every argument error of every op killed the process (a segfault formatting the message) instead of
    raising; the system g++ of the same version built a library that raised."""
    crash = _probe_crash(library)
    if crash is None:
        return
    library.unlink(missing_ok=True)
    raise RuntimeError(
        f"the op library built with {cxx} does not survive an op's argument error ({crash}). Seen when the "
        "compiler links a libstdc++ other than the one Python loads. Point CXX and CC at the system compiler "
        "(e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc) and run `fp8kv build` again.")


def _compiled_isa(requested: str) -> str:
    try:
        return torch.ops.fp8kv.cpu_isa()
    except (AttributeError, RuntimeError):
        return requested


# The compile child's command line, before its JSON spec (_compile_child.py: a script, so that it ties itself
# to this process before importing torch); the crash tests put a stand-in compiler here.
COMPILE_CHILD = [sys.executable, str(Path(__file__).with_name("_compile_child.py"))]


def _compile(name: str, root: Path, build_dir: Path, cflags: list[str], cuda: list[Path],
             cuda_cflags: list[str], cxx: str, verbose: bool,
             progress_callback: Callable[[str], None] | None, lock_fd: int | None = None) -> None:
    """Compile in a child process (which loads the library to finish; this process loads it only once it
    passed its check). The child shares the build lock (lock_fd) and dies with this process; Ctrl-C stops it
    and the compilers it started."""
    _check_ninja()
    cpu_sources = [root / "torch_bindings.cpp", *sorted((root / "cpu").glob("*.cpp"))]
    units = [*_cpu_units(cpu_sources, build_dir), *cuda]
    jobs = compile_jobs(len(units))
    _notify(progress_callback, f"compiling the fp8kv op library for this machine, once per fp8kv version: "
            f"{len(units)} compile units{' (CPU and GPU)' if cuda else ''}, {jobs} at a time, with {cxx}"
            f"{_time_note(_build_kind(cflags, bool(cuda)))} [{build_dir}]")
    spec = {"name": name, "sources": [str(s) for s in units], "cflags": cflags + (["-DFP8KV_WITH_CUDA"] if cuda else []),
            "cuda_cflags": cuda_cflags, "root": str(root), "build_dir": str(build_dir), "verbose": verbose,
            "parent": os.getpid()}
    env = dict(os.environ, CXX=cxx, MAX_JOBS=str(jobs))
    cc = _c_compiler_for(cxx)
    if cc is not None:
        env["CC"] = cc  # nvcc's host compiler, so that both halves link one libstdc++
    child = subprocess.Popen([*COMPILE_CHILD, json.dumps(spec)], env=env,
                             stdout=None if verbose else subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, pass_fds=() if lock_fd is None else (lock_fd,))
    try:
        output, _ = child.communicate()
    except BaseException:  # Ctrl-C or a kill of this process: take the compilers down too
        _kill_group(child)
        raise
    if child.returncode != 0:
        tail = _compiler_message(output or "")
        raise RuntimeError(f"compiling the fp8kv op library with {cxx} failed (exit {child.returncode})"
                           + (f":\n{tail}" if tail else "; run `fp8kv build --verbose` for the compiler output"))


def _compiler_message(output: str, limit: int = 3000) -> str:
    """The compiler output worth showing: its error lines first (a warning-heavy tail can bury them), then the
    tail of the output, within limit characters."""
    errors = [line for line in output.splitlines() if ": error:" in line or line.startswith("error:")]
    head = "\n".join(errors)[:limit // 2]
    tail = output.strip()[-(limit - len(head)):]
    return f"{head}\n...\n{tail}" if head else tail


# The CPU sources compiled as translation units of their own; every other one is #included by one shared unit.
# Each unit pays for torch's headers and the inline code it uses from them, 6-9 s of its time: the eight small
# sources took 66 CPU-s apart and take 37 s as one unit (62 and 19 s for the portable path). attention.cpp, the
# largest (40 s, the AVX-512 kernels' instantiations), stays apart, so ninja keeps two compilers busy.
OWN_UNITS = ("attention.cpp",)
SHARED_UNIT = "fp8kv_cpu_sources.cpp"


def _cpu_units(sources: list[Path], build_dir: Path) -> list[Path]:
    """The translation units for the CPU sources: each of OWN_UNITS, and one written into build_dir that
    includes all the others (by absolute path, so the compiler's messages name the real files)."""
    own = [s for s in sources if s.name in OWN_UNITS]
    shared = [s for s in sources if s.name not in OWN_UNITS]
    if len(shared) < 2:
        return sources
    unit = build_dir / SHARED_UNIT
    unit.write_text("// Written by fp8cache/ops/_build.py: the CPU sources that share one translation unit.\n"
                    + "".join(f'#include "{s.resolve()}"\n' for s in shared))
    return [*own, unit]


def compile_jobs(units: int) -> int:
    """Compilers run at once: $MAX_JOBS (torch's ninja convention) if set, else one per usable core, no more than
    there are units (ninja's own default, cores + 2, would crowd a small machine once GPU units join)."""
    if os.environ.get("MAX_JOBS", "").isdigit() and int(os.environ["MAX_JOBS"]) > 0:
        return int(os.environ["MAX_JOBS"])
    return max(1, min(units, cpu_info.usable_cores()))


def _time_note(kind: str) -> str:
    """What this machine's last compile of this kind took ("" before the first: no guess is said)."""
    seconds = _last_build_seconds(kind)
    return "" if seconds is None else f"; the last one here took {seconds:.0f} s"


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def library_path() -> str | None:
    """Path of the library loaded in this process, None before the first load."""
    return _loaded.path if _loaded is not None else None


def last_build() -> BuildResult | None:
    return _loaded

