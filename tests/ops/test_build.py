"""The JIT build of the op library: cache key, cache reuse across processes, locking, clear errors."""

from __future__ import annotations

import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fp8cache.ops import _build

REPO = Path(__file__).resolve().parents[2]


def key_for(root: Path, with_cuda: bool = False) -> str:
    return _build._build_key(root, ["-O3"], [], "native", "c++", with_cuda)


@pytest.fixture
def source_copy(tmp_path: Path) -> Path:
    root = tmp_path / "csrc"
    shutil.copytree(_build.source_dir(), root)
    return root


def test_sources_are_found_next_to_the_package():
    root = _build.source_dir()
    assert (root / "torch_bindings.cpp").is_file()
    assert root in (REPO / "csrc", REPO / "fp8cache" / "csrc")


def test_key_follows_every_compiled_source(source_copy: Path):
    before = key_for(source_copy)
    assert key_for(source_copy) == before
    header = source_copy / "common" / "fp8.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert key_for(source_copy) != before


def test_cuda_sources_only_count_when_compiled(source_copy: Path):
    (source_copy / "cuda").mkdir(exist_ok=True)
    before_cpu, before_cuda = key_for(source_copy), key_for(source_copy, with_cuda=True)
    (source_copy / "cuda" / "extra_kernel.cu").write_text("// new\n")
    assert key_for(source_copy) == before_cpu
    assert key_for(source_copy, with_cuda=True) != before_cuda


def test_key_follows_flags_and_isa(source_copy: Path):
    base = _build._build_key(source_copy, ["-O3"], [], "native", "c++", False)
    assert _build._build_key(source_copy, ["-O2"], [], "native", "c++", False) != base
    assert _build._build_key(source_copy, ["-O3"], [], "scalar", "c++", False) != base


def test_native_builds_are_keyed_by_the_cpu(source_copy: Path, monkeypatch):
    """-march=native output differs per CPU: another CPU must not reuse the cached library."""
    native = ["-O3", "-march=native"]
    base = _build._build_key(source_copy, native, [], "native", "c++", False)
    portable = _build._build_key(source_copy, ["-O3", "-DFP8KV_FORCE_SCALAR"], [], "scalar", "c++", False)
    monkeypatch.setattr(_build, "_cpu_identity", lambda: "model name : another CPU\nflags : sse2")
    assert _build._build_key(source_copy, native, [], "native", "c++", False) != base
    assert _build._build_key(source_copy, ["-O3", "-DFP8KV_FORCE_SCALAR"], [], "scalar", "c++", False) == portable


def test_cpu_identity_names_this_cpu():
    identity = _build._cpu_identity()
    if Path("/proc/cpuinfo").is_file() and platform.machine() in ("x86_64", "AMD64"):
        assert "flags" in identity and "model name" in identity
    assert identity == _build._cpu_identity()


def test_cache_dir_precedence(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _build.cache_dir() == tmp_path / "explicit" / "ops"
    monkeypatch.delenv("FP8KV_CACHE_DIR")
    assert _build.cache_dir() == tmp_path / "xdg" / "fp8kv" / "ops"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _build.cache_dir() == Path.home() / ".cache" / "fp8kv" / "ops"


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(_build.shutil, "which", lambda name: None)  # not even /usr/bin/g++
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler found: install g\+\+ .* or set CXX"):
        _build._compiler()


def test_unknown_isa_is_a_clear_error():
    with pytest.raises(ValueError, match="native, avx512, avx2, scalar"):
        _build.requested_isa("sse9")


def test_compile_holds_the_lock(monkeypatch, tmp_path: Path):
    """While one process compiles a key, another cannot take that key's lock."""
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_build, "_loaded", None)
    monkeypatch.setattr(_build, "_notify", lambda *args: None)
    seen = {}

    def fake_compile(name, root, build_dir, *args):
        with open(tmp_path / "ops" / f"{name}.lock", "w") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen["locked"] = False
            except BlockingIOError:
                seen["locked"] = True
        (Path(build_dir) / f"{name}.so").write_bytes(b"a library")

    monkeypatch.setattr(_build, "_compile", fake_compile)
    monkeypatch.setattr(_build, "check_errors_raise", lambda *args: None)  # nothing was compiled
    monkeypatch.setattr(_build.torch.ops, "load_library", lambda path: None)
    result = _build.load_library()
    assert seen == {"locked": True}
    assert result.compiled


def test_a_second_process_reuses_the_cached_library(request):
    from fp8cache.ops import load

    isa = request.config.getoption("--cpu-isa")  # a run against a lower path's build asks the child for it too
    load(cpu_isa=isa)  # compiled or reused by this process
    code = (f"from fp8cache.ops import _build; r = _build.load_library(cpu_isa={isa!r}); "
            "print(r.compiled, round(r.seconds, 3), r.path)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True, timeout=600).stdout.split()
    compiled, seconds, path = out[0], out[1], out[2]
    print(f"second process loaded {path} in {seconds}s")
    assert compiled == "False"
    assert path == _build.library_path()


def test_load_is_idempotent():
    from fp8cache.ops import load

    first = load()
    path = _build.library_path()
    assert load() is first
    assert _build.library_path() == path
    assert _build.build() == path


def test_error_probe_passes_on_the_built_library():
    from fp8cache.ops import load

    load()
    library = Path(_build.library_path())
    _build.check_errors_raise(library, "c++")
    assert library.is_file()


def test_library_that_crashes_on_an_error_is_removed_and_the_fix_named(monkeypatch, tmp_path: Path):
    """What a relocated g++ linking its own libstdc++ produced on a GPU machine: the child dies of SIGSEGV."""
    library = tmp_path / "fp8kv_ops_x.so"
    library.write_bytes(b"not really a library")
    monkeypatch.setattr(_build, "_ERROR_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(RuntimeError, match=r"built with /opt/gcc/bin/g\+\+ .*signal 11.*CXX=/usr/bin/g\+\+"):
        _build.check_errors_raise(library, "/opt/gcc/bin/g++")
    assert not library.exists()


def _write_fake_library(name: str, root: Path, build_dir: Path, *args) -> None:
    (Path(build_dir) / f"{name}.so").write_bytes(b"a library of " + name.encode())


def _fake_build(monkeypatch, tmp_path: Path, compilers: list[str], broken: set[str]) -> list[str]:
    """load_library with fake compiles: compilers in `broken` build a library that fails its self-check."""
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_build, "_loaded", None)
    messages: list[str] = []
    monkeypatch.setattr(_build, "_notify", lambda callback, message: messages.append(message))
    monkeypatch.setattr(_build, "_compilers", lambda: list(compilers))
    monkeypatch.setattr(_build, "_compile", _write_fake_library)

    def check(library, cxx):
        if cxx in broken:
            raise RuntimeError(f"the op library built with {cxx} does not survive an op's argument error")

    monkeypatch.setattr(_build, "check_errors_raise", check)
    monkeypatch.setattr(_build.torch.ops, "load_library", lambda path: None)
    return messages


def test_a_compiler_whose_library_fails_its_check_gives_way_to_the_next(monkeypatch, tmp_path: Path):
    """A CUDA image's relocated g++ (/opt/gcc) links another libstdc++: its library crashes on an op's error.
    The build goes on with the system compiler instead of asking the user for CXX=/usr/bin/g++."""
    messages = _fake_build(monkeypatch, tmp_path, ["/opt/gcc/bin/g++", "/usr/bin/g++"], {"/opt/gcc/bin/g++"})
    result = _build.load_library(device="cpu")
    assert result.compiled
    assert any("/opt/gcc/bin/g++" in m and "trying the next compiler" in m for m in messages)
    assert "/usr/bin/g++" in messages[-1]


def test_no_working_compiler_is_an_error_naming_each(monkeypatch, tmp_path: Path):
    _fake_build(monkeypatch, tmp_path, ["/a/g++", "/b/g++"], {"/a/g++", "/b/g++"})
    with pytest.raises(RuntimeError, match=r"(?s)no compiler here builds a working op library.*/a/g\+\+.*/b/g\+\+"):
        _build.load_library(device="cpu")


def test_a_killed_compile_leaves_no_lock_that_blocks_the_next(monkeypatch, tmp_path: Path):
    """torch's build leaves a `lock` file when its process is killed mid-compile; every later build of that
    key used to wait on it forever."""
    _fake_build(monkeypatch, tmp_path, ["c++"], set())
    key = _build._build_key(_build.source_dir(), ["-O3", "-std=c++17", "-fopenmp", "-Wall", "-Wno-unused-function",
                                                  *_build._isa_cflags("native")], [], "native", "c++", False)
    stale = tmp_path / "ops" / f"fp8kv_ops_{key}" / "lock"
    stale.parent.mkdir(parents=True)
    stale.write_text("")
    seen = {}
    monkeypatch.setattr(_build, "_compile", lambda name, root, build_dir, *args: (seen.setdefault(
        "lock", (Path(build_dir) / "lock").exists()), _write_fake_library(name, root, build_dir)))
    _build.load_library(device="cpu")
    assert seen == {"lock": False}


def test_cpu_device_builds_no_gpu_sources_and_a_gpu_without_nvcc_says_so(monkeypatch):
    assert not _build._wants_gpu("cpu") and not _build._wants_gpu(torch_device("meta"))
    monkeypatch.setattr(_build, "_gpu_compiler", lambda: None)
    with pytest.raises(RuntimeError, match=r"need nvcc .*or run with --device cpu"):
        _build._wants_gpu("cuda")
    assert not _build._wants_gpu(None)  # auto: no compiler, no GPU sources


def torch_device(name: str):
    import torch

    return torch.device(name)


def test_compilers_linking_this_process_libstdcxx_come_first(monkeypatch):
    """On a CUDA image whose g++ is a relocated one (/opt/gcc, its own libstdc++), the system compiler, which
    links the libstdc++ Python runs on, is tried first: no failed build before the working one."""
    monkeypatch.setenv("CXX", "/opt/gcc/bin/g++")
    monkeypatch.setattr(_build.shutil, "which", lambda name: {"/opt/gcc/bin/g++": "/opt/gcc/bin/g++",
                                                             "c++": "/usr/bin/c++"}.get(name))
    monkeypatch.setattr(_build, "_loaded_libstdcxx", lambda: "/usr/lib/libstdc++.so.6.0.30")
    links = {"/opt/gcc/bin/g++": "/opt/gcc/lib64/libstdc++.so.6.0.33", "/usr/bin/c++": "/usr/lib/libstdc++.so.6.0.30"}
    monkeypatch.setattr(_build, "_libstdcxx_of", links.get)
    assert _build._compilers() == ["/usr/bin/c++", "/opt/gcc/bin/g++"]
    monkeypatch.setattr(_build, "_loaded_libstdcxx", lambda: None)  # unknown: $CXX first, as asked
    assert _build._compilers() == ["/opt/gcc/bin/g++", "/usr/bin/c++"]


def _checked_by(monkeypatch) -> list[str]:
    """The compilers whose library each later load_library runs the self-check of, in order."""
    checked: list[str] = []
    check = _build.check_errors_raise
    monkeypatch.setattr(_build, "check_errors_raise", lambda library, cxx: (checked.append(cxx), check(library, cxx)))
    return checked


def test_the_compiler_that_worked_is_tried_first_at_the_next_start(monkeypatch, tmp_path: Path):
    """The GPU machine's every start relinked /opt/gcc's library, saw its self-check fail, then used /usr/bin/g++:
    8 s and an alarming line each time. The second start goes straight to the compiler that worked."""
    messages = _fake_build(monkeypatch, tmp_path, ["/opt/gcc/bin/g++", "/usr/bin/g++"], {"/opt/gcc/bin/g++"})
    checked = _checked_by(monkeypatch)
    _build.load_library(device="cpu")
    assert checked == ["/opt/gcc/bin/g++", "/usr/bin/g++"]
    assert any("trying the next compiler" in m for m in messages)

    checked.clear(), messages.clear()
    monkeypatch.setattr(_build, "_loaded", None)  # a new process, after the sources changed (new keys)
    _forget_installed(tmp_path)
    _build.load_library(device="cpu")
    assert checked == ["/usr/bin/g++"]
    assert not any("trying the next compiler" in m for m in messages) and "/usr/bin/g++" in messages[-1]


def test_a_changed_toolchain_is_probed_again(monkeypatch, tmp_path: Path):
    """The memory is keyed by the compilers' versions (and the libstdc++ they and Python use): a new /opt/gcc may
    work, so it is tried first again, in the order _compilers() gives."""
    _fake_build(monkeypatch, tmp_path, ["/opt/gcc/bin/g++", "/usr/bin/g++"], {"/opt/gcc/bin/g++"})
    checked = _checked_by(monkeypatch)
    _build.load_library(device="cpu")
    monkeypatch.setattr(_build, "_loaded", None)
    monkeypatch.setattr(_build, "_compiler_version", lambda cxx: "g++ (GCC) 14.2.0" if "opt" in cxx else "")
    monkeypatch.setattr(_build, "check_errors_raise", lambda library, cxx: checked.append(cxx))  # now it works
    checked.clear()
    result = _build.load_library(device="cpu")
    assert checked == ["/opt/gcc/bin/g++"] and result.compiled


def test_a_remembered_failure_goes_last_and_a_broken_memory_file_is_ignored(monkeypatch, tmp_path: Path):
    compilers = ["/a/g++", "/b/g++", "/c/g++"]
    _fake_build(monkeypatch, tmp_path, compilers, {"/a/g++"})
    checked = _checked_by(monkeypatch)
    _build.load_library(device="cpu")  # /a fails, /b works
    memory = json.loads((tmp_path / "ops" / _build.COMPILER_MEMORY).read_text())
    assert (memory["works"], memory["failed"]) == ("/b/g++", ["/a/g++"])
    # /b stops working (say its library is removed and its rebuild fails): /c is next, /a, known broken, last.
    monkeypatch.setattr(_build, "_loaded", None)
    _forget_installed(tmp_path)
    monkeypatch.setattr(_build, "check_errors_raise", lambda library, cxx: (checked.append(cxx), _fail_for(
        cxx, {"/a/g++", "/b/g++"})))
    checked.clear()
    _build.load_library(device="cpu")
    assert checked == ["/b/g++", "/c/g++"]
    memory = json.loads((tmp_path / "ops" / _build.COMPILER_MEMORY).read_text())
    assert (memory["works"], memory["failed"]) == ("/c/g++", ["/a/g++", "/b/g++"])

    (tmp_path / "ops" / _build.COMPILER_MEMORY).write_text("{not json")
    monkeypatch.setattr(_build, "_loaded", None)
    _forget_installed(tmp_path)
    checked.clear()
    _build.load_library(device="cpu")
    assert checked == ["/a/g++", "/b/g++", "/c/g++"]  # probed afresh, in the plain order


def _forget_installed(tmp_path: Path) -> None:
    """Remove the installed libraries (as a change of the sources would make them unused)."""
    for installed in (tmp_path / "ops").glob("fp8kv_ops_*"):
        if installed.is_dir():
            shutil.rmtree(installed)


def _fail_for(cxx: str, broken: set[str]) -> None:
    if cxx in broken:
        raise RuntimeError(f"the op library built with {cxx} does not survive an op's argument error")


# ---- crash safety (issue 39): whole installs, damaged ones moved aside --------------------------------------


def _installed_dirs(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "ops").glob("fp8kv_ops_*") if p.is_dir() and "." not in p.name]


def test_a_cut_short_library_is_moved_aside_with_one_line_and_rebuilt(monkeypatch, tmp_path: Path, caplog):
    """A library cut short (a full disk, a crash before the data reached the disk) used to be loaded as it was:
    SIGBUS, exit 135, no message, at every start."""
    _fake_build(monkeypatch, tmp_path, ["c++"], set())
    first = _build.load_library(device="cpu")
    installed = Path(first.path).parent
    whole = Path(first.path).read_bytes()
    assert _build.installed_problem(installed) is None
    os.truncate(first.path, len(whole) // 2)
    assert "were written" in _build.installed_problem(installed)

    monkeypatch.setattr(_build, "_loaded", None)  # the next start
    with caplog.at_level("WARNING", logger="fp8kv.ops"):
        again = _build.load_library(device="cpu")
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and str(installed) in said[0] and "moved it aside" in said[0]
    assert again.compiled and again.path == first.path and Path(again.path).read_bytes() == whole
    aside = installed.with_name(installed.name + ".damaged")
    assert (aside / Path(first.path).name).stat().st_size == len(whole) // 2
    assert _build.installed_problem(installed) is None


def test_a_changed_byte_is_damage_too_and_a_missing_manifest_is_checked_once(monkeypatch, tmp_path: Path):
    _fake_build(monkeypatch, tmp_path, ["c++"], set())
    first = _build.load_library(device="cpu")
    installed = Path(first.path).parent
    data = bytearray(Path(first.path).read_bytes())
    data[3] ^= 1
    Path(first.path).write_bytes(bytes(data))
    assert "SHA-256" in _build.installed_problem(installed)
    (installed / _build.MANIFEST).write_text("{")
    assert "unreadable" in _build.installed_problem(installed)


def test_a_library_installed_without_a_manifest_is_checked_in_a_child_once(monkeypatch, tmp_path: Path):
    """Libraries from an fp8kv before manifests: the ELF check and the self-check decide, once."""
    from fp8cache.ops import load

    load()
    real = Path(_build.library_path())
    _fake_build(monkeypatch, tmp_path, ["c++"], set())
    key = _build._build_key(_build.source_dir(), ["-O3", "-std=c++17", "-fopenmp", "-Wall", "-Wno-unused-function",
                                                  *_build._isa_cflags("native")], [], "native", "c++", False)
    legacy = tmp_path / "ops" / f"fp8kv_ops_{key}"
    legacy.mkdir(parents=True)
    shutil.copy(real, legacy / f"{legacy.name}.so")
    (legacy / "lock").write_text("")  # torch's baton, as a killed old build left it
    assert _build.installed_problem(legacy) == "unchecked"
    monkeypatch.setattr(_build, "_compile", lambda *args: pytest.fail("a whole library was compiled again"))
    result = _build.load_library(device="cpu")
    assert not result.compiled and _build.installed_problem(legacy) is None  # checked, manifest written

    monkeypatch.setattr(_build, "_loaded", None)
    (legacy / _build.MANIFEST).unlink()
    os.truncate(legacy / f"{legacy.name}.so", real.stat().st_size - 100)
    assert "ELF" in _build.installed_problem(legacy)


def test_elf_check_finds_every_cut_of_a_real_library(tmp_path: Path):
    """Where there is no manifest, a cut anywhere is still found: the headers describe every byte."""
    import random

    from fp8cache.ops import load

    load()
    data = Path(_build.library_path()).read_bytes()
    assert _build.elf_problem(Path(_build.library_path())) is None
    rng = random.Random(39)
    cuts = [0, 4, 63, 64, len(data) // 2, len(data) - 1, *(rng.randrange(len(data)) for _ in range(40))]
    for cut in cuts:
        path = tmp_path / "cut.so"
        path.write_bytes(data[:cut])
        assert _build.elf_problem(path) is not None, cut


def test_leftover_work_folders_are_removed_by_the_next_builder(monkeypatch, tmp_path: Path):
    _fake_build(monkeypatch, tmp_path, ["c++"], set())
    key = _build._build_key(_build.source_dir(), ["-O3", "-std=c++17", "-fopenmp", "-Wall", "-Wno-unused-function",
                                                  *_build._isa_cflags("native")], [], "native", "c++", False)
    stale = tmp_path / "ops" / f"fp8kv_ops_{key}.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "half.o").write_bytes(b"\0" * 10)
    _build.load_library(device="cpu")
    assert not stale.exists()
    assert [p.name for p in (tmp_path / "ops").iterdir() if ".tmp-" in p.name] == []


def test_a_failed_compile_shows_its_error_lines_above_a_tail_of_warnings():
    """g++ prints an error once and warnings by the page: the message must keep the error line even when the
    output's tail is all warnings (the error was cut off before)."""
    error = "csrc/cpu/decode_layer.cpp:104:27: error: too few arguments to function 'paged_attention_window'"
    output = "\n".join(["[1/3] c++ attention.cpp", error] + [f"attention.h:{i}: warning: may be used uninitialized"
                                                               for i in range(400)])
    message = _build._compiler_message(output)
    assert error in message and "warning" in message and len(message) <= 3100
    assert _build._compiler_message("ninja: build stopped") == "ninja: build stopped"
