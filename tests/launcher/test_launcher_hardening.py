"""What a new user hits at the command line (issue 24, items 4, 5 and 21): one clear line and the right exit
status for a device torch cannot use, a port in use, heads a shard count does not divide and Ctrl-C while
loading; and `generate --help` saying that it applies the chat template."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_generate_help_says_it_applies_the_chat_template():
    done = CliRunner().invoke(main, ["generate", "--help"])
    assert done.exit_code == 0, done.output
    text = " ".join(done.output.split())
    assert "chat template" in text and "LLM.generate()" in text and "--no-chat" in text


# -- Ctrl-C while loading ------------------------------------------------------------------------------

# The child's first line: Ctrl-C raises KeyboardInterrupt, as in a terminal. A test run started in the background
# by a non-interactive shell ignores SIGINT, its children inherit that, and Python then installs no handler.
CTRL_C_RAISES = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


COMPILERS = {"ninja", "c++", "g++", "gcc", "cc", "cc1plus", "clang", "clang++", "nvcc", "cicc", "hipcc"}


def _process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command name)."""
    table = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        table[int(name)] = (int(ppid), state, comm)
    return table


def _descendants(root: int) -> dict[int, str]:
    table = _process_table()
    found, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, state, comm) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = comm
                todo.append(pid)
    return found


def _alive(pid: int) -> bool:
    state = _process_table().get(pid)
    return state is not None and state[1] != "Z"  # a zombie has exited


@pytest.mark.slow
@pytest.mark.parametrize("command", ["generate", "run"])
def test_ctrl_c_while_compiling_exits_130_and_ends_the_compiler(tmp_path, tiny_llama_path, command):
    # A first start compiles the op library (an empty cache folder here); Ctrl-C comes while the compilers run.
    args = ["generate", tiny_llama_path, "the city", "--max-tokens", "2"] if command == "generate" else \
        ["run", tiny_llama_path, "--port", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8KV_")}
    env.update(FP8KV_CACHE_DIR=str(tmp_path / "cache"), MAX_JOBS="1", PYTHONUNBUFFERED="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))  # ninja of this venv
    log = tmp_path / "out.log"
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_RAISES + "from launcher.cli import main; main()", *args],
                            cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    compiling: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 300
        while not any(comm in COMPILERS for comm in compiling.values()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
            compiling = _descendants(proc.pid)
        os.kill(proc.pid, signal.SIGINT)  # as `kill -INT` or a supervisor sends it: to this process only
        code = proc.wait(60)
        time.sleep(0.5)
        left = {pid: comm for pid, comm in compiling.items() if _alive(pid)}
        output = log.read_text()
        # 130: the shell's status for Ctrl-C; none of the build's processes may run on as an orphan
        assert {"status": code, "left running": left} == {"status": 130, "left running": {}}, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in compiling:
            if _alive(pid) and _process_table()[pid][2] == compiling[pid]:
                os.kill(pid, signal.SIGKILL)


def test_ctrl_c_before_the_ranks_are_up_exits_130(monkeypatch):
    # `fp8kv run --num-shard N`: the supervisor stops the loading ranks and reports the interrupted start.
    import threading

    from launcher import supervisor

    loading = [sys.executable, "-c", "import time; time.sleep(120)"]  # a rank that never reports READY
    monkeypatch.setattr(supervisor, "rank_command", lambda argv: loading)
    lines: list[str] = []
    group = supervisor.Supervisor([], 2, stop_timeout=10, write=lines.append)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    assert group.run() == 130, "".join(lines)
    assert all(rank.proc.returncode is not None for rank in group.ranks)


# -- checked before the model loads or any rank starts ---------------------------------------------------

def _fp8kv(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8KV_")}
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=timeout, check=False)


@pytest.mark.parametrize("shards", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_port_in_use_is_found_before_the_model_loads(tiny_llama_path, shards):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _fp8kv("run", tiny_llama_path, "--port", str(port), "--num-shard", shards)
    output = done.stdout + done.stderr
    assert done.returncode == 3, output  # serve.py's status for an address it cannot listen on
    assert f"127.0.0.1:{port}" in output and "--port" in output
    assert "Loading weights" not in output and "KV cache" not in output and "rank 0 started" not in output


@pytest.mark.slow
def test_num_shard_that_does_not_divide_the_heads_is_one_line(make_tiny_model):
    model = make_tiny_model(hidden_size=192, num_attention_heads=3, num_key_value_heads=3)
    for args in (["run", model, "--port", "0"], ["generate", model, "the city", "--max-tokens", "2"]):
        done = _fp8kv(*args, "--num-shard", "2")
        output = done.stdout + done.stderr
        assert done.returncode == 2, output
        assert "does not divide" in output and "--num-shard" in output
        assert "Traceback" not in output and "[rank 1]" not in output and "Loading weights" not in output


# `fp8kv` as the console script runs it, saying at exit which of the libraries that take seconds to import it had
# imported.
HEAVY_IMPORTS_AT_EXIT = """
import atexit, sys
heavy = ("torch", "transformers", "fastapi")
atexit.register(lambda: sys.stderr.write("imported: " + ",".join(m for m in heavy if m in sys.modules) + "\\n"))
from launcher.cli import main
main()
"""


@pytest.mark.parametrize("mistake", ["missing model", "missing model (generate)", "port in use",
                                     "num-shard", "num-shard (generate)"])
def test_mistakes_the_files_show_fail_before_torch_loads(mistake, tiny_llama_path, make_tiny_model, tmp_path):
    """A mistyped model folder, a port in use and a --num-shard the model's config.json does not allow need
    neither torch nor transformers to be found: the command ends before importing them (five seconds of
    every start here), and says so in one line."""
    missing = str(tmp_path / "no-such-model")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args, code, says = {
            "missing model": (["run", missing], 2, "does not exist"),
            "missing model (generate)": (["generate", missing, "the city"], 2, "does not exist"),
            "port in use": (["run", tiny_llama_path, "--port", str(taken.getsockname()[1])], 3, "--port"),
            "num-shard": (["run", make_tiny_model(hidden_size=192, num_attention_heads=3, num_key_value_heads=3),
                           "--num-shard", "2"], 2, "does not divide"),
            "num-shard (generate)": (["generate", make_tiny_model(hidden_size=192, num_attention_heads=3,
                                                                  num_key_value_heads=3), "the city",
                                      "--num-shard", "2"], 2, "does not divide"),
        }[mistake]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FP8KV_")}
        done = subprocess.run([sys.executable, "-c", HEAVY_IMPORTS_AT_EXIT, *args], capture_output=True, text=True,
                              cwd=REPO, env=env, timeout=120, check=False)
    assert done.returncode == code, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert lines[-1] == "imported: ", lines
    assert len(lines) == 2 and " ERROR   fp8kv: " in lines[0] and says in lines[0], lines


SLOW_LOAD = """
import pathlib, time, fp8cache.model.loader as loader
def load_model(*args, **kwargs):
    pathlib.Path({marker!r}).write_text("loading")
    time.sleep(300)
loader.load_model = load_model
from launcher.cli import main
main()
"""


def test_ctrl_c_while_calibrate_loads_exits_130(tmp_path, tiny_llama_path):
    marker = tmp_path / "loading"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8KV_")}
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_RAISES + SLOW_LOAD.format(marker=str(marker)), "calibrate",
                             tiny_llama_path, "-o", str(tmp_path / "scales.json")], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
        assert proc.returncode == 130, output[-3000:]
        assert "Traceback" not in output
    finally:
        if proc.poll() is None:
            proc.kill()


# -- a device torch cannot give --------------------------------------------------------------------------

NO_SUCH_GPU = "cuda:99"  # absent on every machine: a CPU-only torch sees no GPU, a GPU host has fewer


@pytest.mark.parametrize("command", ["run", "run --num-shard 2", "generate", "calibrate"])
def test_a_device_torch_cannot_use_is_one_line(tiny_llama_path, tmp_path, command):
    args = {"run": ["run", tiny_llama_path, "--port", "0"],
            "run --num-shard 2": ["run", tiny_llama_path, "--port", "0", "--num-shard", "2"],
            "generate": ["generate", tiny_llama_path, "the city", "--max-tokens", "2"],
            "calibrate": ["calibrate", tiny_llama_path, "-o", str(tmp_path / "scales.json")]}[command]
    done = _fp8kv(*args, "--device", NO_SUCH_GPU)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert f"--device {NO_SUCH_GPU!r}" in output and "cpu" in output  # the problem, and a device that works
    assert "Traceback" not in output and "[rank" not in output and "Loading weights" not in output, output
