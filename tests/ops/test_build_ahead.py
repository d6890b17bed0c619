"""A first start's op build (issue 53 item 6): started ahead, while the model is fetched and loaded, and taken by
the engine's load; its log line says how long the last build here took, never a guess; compilers run one per
usable core. The compiles here are stand-ins (a file written), the clock the test's."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fp8cache.ops import _build

REPO = Path(__file__).resolve().parents[2]

# The compile child's stand-in: writes the library file, or fails as a compiler does when FAIL is in the flags.
STANDIN_CHILD = """
import json, pathlib, sys
spec = json.loads(sys.argv[1])
if "-DFAIL" in spec["cflags"]:
    print("attention.cpp:1: error: a compiler's complaint")
    sys.exit(1)
pathlib.Path(spec["build_dir"], spec["name"] + ".so").write_bytes(b"a library")
"""


@pytest.fixture
def fake_build(monkeypatch, tmp_path: Path):
    """load_library and build_ahead with a stand-in compile child (the rest of the build is real) whose thread
    is recorded; a clock that advances 30 s a reading; the messages said."""
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_build, "_loaded", None)
    monkeypatch.setattr(_build, "_ahead", None)
    monkeypatch.setattr(_build, "_compilers", lambda: ["c++"])
    monkeypatch.setattr(_build, "COMPILE_CHILD", [sys.executable, "-c", STANDIN_CHILD])
    monkeypatch.setattr(_build, "check_errors_raise", lambda library, cxx: None)  # not a real library
    monkeypatch.setattr(_build.torch.ops, "load_library", lambda path: None)
    ticks = itertools.count(step=30.0)
    monkeypatch.setattr(_build, "_clock", lambda: next(ticks))
    state = {"compiles": [], "messages": []}
    monkeypatch.setattr(_build, "_notify", lambda callback, message: state["messages"].append(message))
    real_compile = _build._compile

    def compile_(name, root, build_dir, cflags, *args):
        state["compiles"].append((threading.current_thread().name, tuple(cflags)))
        real_compile(name, root, build_dir, cflags, *args)

    monkeypatch.setattr(_build, "_compile", compile_)
    return state


def test_a_build_started_ahead_is_taken_by_the_load(fake_build):
    _build.build_ahead("cpu")
    result = _build.load_library(device="cpu")
    assert [thread for thread, _ in fake_build["compiles"]] == ["fp8kv-ops-build"]  # once, in the background
    assert result.compiled and Path(result.path).is_file() and result.seconds == 30.0
    assert _build._ahead is None
    _build.build_ahead("cpu")  # the library is loaded: nothing more to build
    assert _build._ahead is None and len(fake_build["compiles"]) == 1


def test_a_failed_build_ahead_fails_the_load_with_its_error(fake_build, monkeypatch):
    monkeypatch.setattr(_build, "_isa_cflags", lambda isa: ["-DFAIL"])
    _build.build_ahead("cpu")
    with pytest.raises(RuntimeError, match=r"(?s)with c\+\+ failed \(exit 1\).*attention.cpp:1: error"):
        _build.load_library(device="cpu")
    assert len(fake_build["compiles"]) == 1  # not compiled a second time in the foreground


def test_a_build_ahead_for_another_library_is_not_taken(fake_build):
    _build.build_ahead("cpu")
    result = _build.load_library(device="cpu", cpu_isa="scalar")
    flags = [cflags for _, cflags in fake_build["compiles"]]
    assert len(flags) == 2 and "-DFP8KV_FORCE_SCALAR" in flags[1] and "-DFP8KV_FORCE_SCALAR" not in flags[0]
    assert result.isa == "scalar"


def test_the_compile_line_says_the_last_build_time_here_or_nothing(fake_build, tmp_path):
    _build.load_library(device="cpu")
    first = next(m for m in fake_build["messages"] if m.startswith("compiling"))
    assert "took" not in first and "minute" not in first  # no measurement yet: no guess either
    assert "2 compile units" in first and "at a time" in first
    # The next fp8kv version's sources: a new library, compiled while the last build's time is known.
    for installed in (tmp_path / "ops").glob("fp8kv_ops_*"):
        if installed.is_dir():
            for f in installed.iterdir():
                f.unlink()
            installed.rmdir()
    _build._loaded = None
    _build.load_library(device="cpu")
    second = [m for m in fake_build["messages"] if m.startswith("compiling")][-1]
    assert second.endswith(f"; the last one here took 30 s [{second.rsplit('[', 1)[1]}")


def test_compilers_run_one_per_usable_core_unless_max_jobs_says(monkeypatch):
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.setattr(_build.cpu_info, "usable_cores", lambda: 2)
    assert _build.compile_jobs(5) == 2 and _build.compile_jobs(1) == 1
    monkeypatch.setattr(_build.cpu_info, "usable_cores", lambda: 64)
    assert _build.compile_jobs(5) == 5
    monkeypatch.setenv("MAX_JOBS", "3")
    assert _build.compile_jobs(5) == 3


# `fp8kv run` and `generate` with the model's load replaced by a line: what they did before it, recorded.
RECORD_ORDER = """
import sys
import fp8cache.engine.llm as llm
import fp8cache.ops._build as build
import fp8cache.server.serve as serve
build.build_ahead = lambda device: print("AHEAD", device, flush=True)
def load(*args, **kwargs):
    print("LOAD", flush=True)
    sys.exit(0)
serve.serve = load
llm.LLM.from_config = classmethod(load)
from launcher.cli import main
main()
"""


@pytest.mark.parametrize("command", ["run", "generate"])
def test_run_and_generate_start_the_build_before_loading_the_model(command, tiny_llama_path):
    args = [command, tiny_llama_path, *(["hello"] if command == "generate" else ["--port", "0"]), "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8KV_")}
    done = subprocess.run([sys.executable, "-c", RECORD_ORDER, *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["AHEAD cpu", "LOAD"]
