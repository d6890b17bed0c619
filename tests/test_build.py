"""The JIT build of the op library: cache key, cache reuse across processes, locking, clear errors."""

from __future__ import annotations

import fcntl
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fp8cache.ops import _build

REPO = Path(__file__).resolve().parents[1]


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
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler found: install g\+\+ .* or set CXX"):
        _build._compiler()


def test_unknown_isa_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("FP8KV_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="native, avx512, avx2, scalar"):
        _build.requested_isa()


def test_compile_holds_the_lock(monkeypatch, tmp_path: Path):
    """While one process compiles a key, another cannot take that key's lock."""
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_build, "_loaded", None)
    monkeypatch.setattr(_build, "_notify", lambda *args: None)
    seen = {}

    def fake_compile(name, *args):
        with open(tmp_path / "ops" / f"{name}.lock", "w") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen["locked"] = False
            except BlockingIOError:
                seen["locked"] = True

    monkeypatch.setattr(_build, "_compile", fake_compile)
    monkeypatch.setattr(_build, "check_errors_raise", lambda *args: None)  # nothing was compiled
    result = _build.load_library()
    assert seen == {"locked": True}
    assert result.compiled


def test_a_second_process_reuses_the_cached_library():
    from fp8cache.ops import load

    load()  # compiled or reused by this process
    code = ("from fp8cache.ops import _build; r = _build.load_library(); "
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
