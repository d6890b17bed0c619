"""One log format (issue 39 item 8): every line a command writes to stderr, fp8kv's, uvicorn's, transformers'
and Python warnings', is `HH:MM:SS LEVEL logger: message` (or one JSON object with --log-format json); no
source locations, no progress-bar frames when stderr is not a terminal, no line wrapped at 80 columns; and the
errors a client or user reads say JSON's words, not Python's type names."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from server_process import ServerProcess

from fp8cache.platform.log import ROUTED_LOGGERS

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) +[\w.-]+: ")
SOURCE_LOCATION = re.compile(r"\w\.py:\d+")


def assert_one_text_format(output: str) -> list[str]:
    """The non-empty lines of output, each checked: the text format, no carriage return, no file.py:123."""
    assert "\r" not in output, "a progress bar's frames in a log that is not a terminal"
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines
    for line in lines:
        assert LINE.match(line), f"not in the log format: {line!r}\n{output}"
        assert not SOURCE_LOCATION.search(line), f"a source location: {line!r}"
    return lines


# ---- configure_logging, in this process --------------------------------------------------------------------


@pytest.fixture
def fresh_logging(monkeypatch):
    """configure_logging changes the process's logging: put everything it touches back afterwards."""
    from transformers.utils import logging as hf_logging

    root = logging.getLogger()
    named = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).propagate,
                    logging.getLogger(name).level) for name in ROUTED_LOGGERS}
    saved = root.handlers[:], root.level, warnings.showwarning, hf_logging.is_progress_bar_enabled()
    hf_handler = hf_logging._default_handler
    hf_root = hf_logging._get_library_root_logger()
    hf_state = hf_root.handlers[:], hf_root.propagate
    for var in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(var, raising=False)  # restored by monkeypatch, whatever configure_logging sets
    disabled = {name: logging.getLogger(name).disabled for name in named}
    hf_logging.enable_progress_bar()  # as a fresh process has them, whatever an earlier test in this one did
    yield
    for name, off in disabled.items():
        logging.getLogger(name).disabled = off
    logging.captureWarnings(False)
    root.handlers[:], root.level, warnings.showwarning = saved[0], saved[1], saved[2]
    for name, (handlers, propagate, level) in named.items():
        logging.getLogger(name).handlers[:], logging.getLogger(name).propagate = handlers, propagate
        logging.getLogger(name).setLevel(level)
    hf_root.handlers[:], hf_root.propagate = hf_state
    assert hf_logging._default_handler is hf_handler
    if saved[3]:
        hf_logging.enable_progress_bar()
    import huggingface_hub.utils

    huggingface_hub.utils.enable_progress_bars()


def test_every_source_writes_the_text_format(fresh_logging):
    from transformers.utils import logging as hf_logging

    from fp8cache.platform.log import configure_logging

    stream = io.StringIO()
    configure_logging("text", stream=stream)
    logging.getLogger("fp8kv").info("device: cpu")
    logging.getLogger("fp8kv.ops").warning("a message\nof two lines")
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 123)
    hf_logging.get_logger("transformers.modeling_utils").warning("a warning of transformers")
    warnings.warn("a warning of Python", FutureWarning, stacklevel=1)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("fp8kv").exception("it failed")
    lines = assert_one_text_format(stream.getvalue())
    said = {line.split(": ", 1)[0][9:].split()[-1]: line for line in lines}
    assert said["transformers.modeling_utils"].endswith(": a warning of transformers")
    assert " WARNING py.warnings: FutureWarning: a warning of Python" in stream.getvalue()
    assert said["uvicorn.error"].endswith(": Started server process [123]")
    # A message of several lines and a traceback: each line has the head, the rest indented.
    assert re.search(r"WARNING fp8kv.ops: a message\n\S+ WARNING fp8kv.ops:   of two lines\n", stream.getvalue())
    assert re.search(r"ERROR   fp8kv:   ValueError: boom$", stream.getvalue(), re.MULTILINE)


def test_a_level_an_earlier_uvicorn_left_hides_no_line(fresh_logging):
    """The fast lane in one process (issue 55): a test that ran uvicorn in-process with log_level="critical" left
    uvicorn.error at CRITICAL, and the server's "Started server process" line of a later log went missing."""
    import uvicorn

    from fp8cache.platform.log import configure_logging

    uvicorn.Config(lambda scope, receive, send: None, log_level="critical")  # sets uvicorn.error's level
    assert logging.getLogger("uvicorn.error").level == logging.CRITICAL
    stream = io.StringIO()
    configure_logging("text", stream=stream, libraries=False)
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 123)
    logging.getLogger("uvicorn.access").info("a request")
    assert_one_text_format(stream.getvalue())
    assert " INFO    uvicorn.error: Started server process [123]" in stream.getvalue()
    assert " INFO    uvicorn.access: a request" in stream.getvalue()


def test_json_format_is_one_object_a_line(fresh_logging):
    from transformers.utils import logging as hf_logging

    from fp8cache.platform.log import configure_logging

    stream = io.StringIO()
    configure_logging("json", stream=stream, rank=1)
    logging.getLogger("fp8kv").info("a message\nof two lines")
    hf_logging.get_logger("transformers.modeling_utils").warning("a warning of transformers")
    warnings.warn("a warning of Python", UserWarning, stacklevel=1)
    entries = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(e["logger"], e["level"], e["rank"]) for e in entries] == [
        ("fp8kv", "info", 1), ("transformers.modeling_utils", "warning", 1), ("py.warnings", "warning", 1)]
    assert entries[0]["message"] == "a message\nof two lines"
    assert entries[2]["message"] == "UserWarning: a warning of Python"  # no file, line or source line


def test_progress_bars_only_on_a_terminal(fresh_logging):
    from transformers.utils import logging as hf_logging

    from fp8cache.platform.log import configure_logging

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    configure_logging("text", stream=Terminal())
    assert hf_logging.is_progress_bar_enabled() and "TQDM_DISABLE" not in os.environ
    configure_logging("text", stream=io.StringIO())
    assert not hf_logging.is_progress_bar_enabled()
    assert os.environ["TQDM_DISABLE"] == "1" and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


def test_a_rank_labels_its_lines_and_the_supervisor_keeps_them():
    """`fp8kv run --num-shard N`: the ranks' log lines pass through the supervisor as they are, its own lines
    and anything else a rank wrote come out in the same format."""
    from fp8cache.platform.log import log_formatter
    from launcher.supervisor import Supervisor

    record = logging.LogRecord("fp8kv", logging.INFO, __file__, 1, "device: cpu", None, None)
    ranked = log_formatter("text", rank=1).format(record)
    assert re.fullmatch(r"\d\d:\d\d:\d\d INFO    fp8kv: \[rank 1\] device: cpu", ranked)
    lines: list[str] = []
    group = Supervisor([], 2, stop_timeout=1, write=lines.append)
    group.say("rank 1 started (pid 12)")
    group._relay(f"[rank 1] {ranked}")
    group._relay("[rank 1] Traceback (most recent call last):")
    assert lines[1] == ranked + "\n"
    assert lines[0].endswith(" INFO    fp8kv: rank 1 started (pid 12)\n")
    assert lines[2].endswith(" WARNING fp8kv: [rank 1] Traceback (most recent call last):\n")
    assert_one_text_format("".join(lines))
    jsonl: list[str] = []
    Supervisor([], 2, stop_timeout=1, write=jsonl.append, log_format="json").say("stopped (cleanly)")
    assert json.loads(jsonl[0])["message"] == "stopped (cleanly)"


def test_an_engine_warning_is_a_warning_line(fresh_logging, tiny_llama_path):
    """`fp8kv run`'s engine log (issue 53): what the engine warns about, here an FP8 cache without scales, is a
    WARNING line of the log, not `INFO fp8kv: warning: ...`."""
    from fp8cache.config import EngineConfig
    from fp8cache.engine.llm_engine import LLMEngine
    from fp8cache.platform.log import configure_logging
    from fp8cache.server.serve import engine_log

    stream = io.StringIO()
    configure_logging("text", stream=stream, libraries=False)
    LLMEngine(EngineConfig(model=tiny_llama_path, dtype="float32", kv_cache_dtype="fp8", kv_cache_memory="1MiB",
                           device="cpu"), log=engine_log)
    lines = assert_one_text_format(stream.getvalue())
    warnings_logged = [line.split(": ", 1)[1] for line in lines if " WARNING fp8kv: " in line]
    assert any(w.startswith("kv-cache-dtype fp8_e4m3 runs with KV scales of 1.0") for w in warnings_logged), lines
    assert not [line for line in lines if "warning:" in line.lower()], lines
    assert any(" INFO    fp8kv: KV scales: default 1.0" in line for line in lines)  # the rest stays INFO


def test_log_function_levels_by_the_warning_prefix(caplog):
    from fp8cache.platform.log import log_function

    log = log_function("fp8kv.test")
    with caplog.at_level(logging.INFO, logger="fp8kv.test"):
        log("warning: the cache is small\n")
        log("note: a warning: inside is not one")
        log("device: cpu")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "the cache is small"), ("INFO", "note: a warning: inside is not one"), ("INFO", "device: cpu")]


def test_one_seat_is_not_seats():
    from fp8cache.kvcache.sizing import CachePlan, describe

    plan = CachePlan(num_blocks=64, block_size=16, bytes_per_token=512, budget_bytes=2**20, budget_source="x",
                     window_size=32, window_seats=1, window_blocks_per_seat=2, window_bytes=4096)
    text = "\n".join(describe(plan, "fp8_e4m3", 256, max_num_seqs=4))
    assert " 1 seat (" in text and "seats for 1 sequence," in text and "1 seats" not in text


# ---- errors in JSON's words -------------------------------------------------------------------------------

PYTHON_NAMES = re.compile(r"\b(NoneType|dict|list|int|str|float|bool|tuple)\b|instance of|literal\[|"
                          r"\b[A-Z][a-z]+[A-Z]\w+\b")  # a class name: ResponseFormat, NamedToolChoice


@pytest.mark.parametrize(("kind", "body"), [
    ("completion", {"model": "m", "prompt": "a", "response_format": [1]}),
    ("completion", {"model": "m", "prompt": "a", "stream_options": 3}),
    ("completion", {"model": "m", "prompt": "a", "logit_bias": [1]}),
    ("completion", {"model": "m", "prompt": "a", "max_tokens": "x"}),
    ("completion", {"model": "m", "prompt": None}),
    ("completion", {"model": ["m"], "prompt": "a"}),
    ("completion", {"model": "m", "prompt": "a", "stop": 5}),
    ("completion", {"model": "m", "prompt": "a", "echo": 1}),
    ("chat", {"model": "m", "messages": None}),
    ("chat", {"model": "m", "messages": [1]}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": 5}]}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "a"}], "tool_choice": 5}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "a"}], "tools": [5]}),
    ("tgi", {"inputs": "a", "parameters": []}),
    ("tgi", {"inputs": "a", "parameters": {"grammar": 5}}),
    ("tgi", {"inputs": None}),
])
def test_request_errors_say_json_not_python(kind, body):
    from fp8cache.server.parsing import validated
    from fp8cache.server.protocol.chat import ChatCompletionRequest
    from fp8cache.server.protocol.completions import CompletionRequest
    from fp8cache.server.protocol.request_error import RequestError
    from fp8cache.server.protocol.tgi import GenerateRequest

    model = {"completion": CompletionRequest, "chat": ChatCompletionRequest, "tgi": GenerateRequest}[kind]
    with pytest.raises(RequestError) as refused:
        validated(model, body)
    message, param = refused.value.message, refused.value.param
    assert not PYTHON_NAMES.search(message), message
    assert param and not PYTHON_NAMES.search(param) and param.split(".")[0] in body, param


def test_union_errors_are_one_sentence():
    from fp8cache.server.parsing import validated
    from fp8cache.server.protocol.chat import ChatCompletionRequest
    from fp8cache.server.protocol.request_error import RequestError

    with pytest.raises(RequestError) as refused:
        validated(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "a"}],
                                          "tool_choice": 5})
    assert refused.value.message == "tool_choice: must be 'none', 'auto' or 'required', or an object, not a number"
    assert refused.value.param == "tool_choice"


@pytest.mark.parametrize(("raw", "kind"), [(b"null", "null"), (b"[1]", "an array"), (b"7", "a number"),
                                           (b'"x"', "a string"), (b"true", "true (a boolean)")])
def test_a_body_that_is_not_an_object_is_named_in_json(raw, kind):
    import asyncio

    from starlette.requests import Request

    from fp8cache.server.parsing import read_json
    from fp8cache.server.protocol.request_error import RequestError

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)
    with pytest.raises(RequestError) as refused:
        asyncio.run(read_json(request, 1 << 20))
    assert refused.value.message == f"request body must be a JSON object ({{...}}), not {kind}"


def test_a_scales_file_of_the_wrong_shape_is_named_in_json(tmp_path):
    from fp8cache.kvcache.scale_files import load_scales_file
    from fp8cache.kvcache.scales import ScalesFileError

    path = tmp_path / "scales.json"
    for doc, said in (([1, 2], "the top level must be a JSON object, not an array"),
                      ({"kv_cache": [1]}, "must be an object, not an array")):
        path.write_text(json.dumps(doc))
        with pytest.raises(ScalesFileError) as refused:
            load_scales_file(str(path), None, None, "fp8_e4m3")
        assert said in str(refused.value) and not PYTHON_NAMES.search(str(refused.value)), refused.value


# ---- the commands, with stderr a pipe or a file ---------------------------------------------------------


def _fp8kv(*args: str, python_prelude: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FP8KV_", "TQDM_", "HF_HUB_DISABLE"))}
    boot = python_prelude + "\nfrom launcher.cli import main\nmain()"
    done = subprocess.run([sys.executable, "-c", boot, *args], capture_output=True, cwd=REPO, env=env,
                          timeout=600, check=False)
    # Decoded here, not with text=True, whose universal newlines would turn a progress bar's \r into \n.
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


# transformers and Python warnings, once the command has set up its log: they must come out in its format.
LIBRARY_LINES = """
import fp8cache.platform.log as _log
_configure = _log.configure_logging
def _configure_then_warn(*args, **kwargs):
    _configure(*args, **kwargs)
    import warnings
    from transformers.utils import logging as hf_logging
    hf_logging.get_logger("transformers.modeling_utils").warning("a warning of transformers")
    warnings.warn("a warning of Python", FutureWarning)
_log.configure_logging = _configure_then_warn
"""


def test_generate_writes_one_format_to_a_pipe(tiny_llama_path):
    done = _fp8kv("generate", tiny_llama_path, "the city", "--max-tokens", "3", "--ignore-eos", "--no-chat",
                  "--kv-cache-memory", "16MiB", python_prelude=LIBRARY_LINES)
    assert done.returncode == 0, done.stderr
    lines = assert_one_text_format(done.stderr)
    assert "Loading weights" not in done.stderr
    assert any(" WARNING transformers.modeling_utils: a warning of transformers" in line for line in lines)
    assert any(" WARNING py.warnings: FutureWarning: a warning of Python" in line for line in lines)
    # Long lines are not wrapped: the op library's path (longer than 80 columns) is whole on its line.
    library = re.search(r"op library: (/\S+\.so)", done.stderr)
    assert library and os.path.isfile(library.group(1)), done.stderr
    assert lines[-1].endswith("finish reason: length") and done.stdout.count("\n") == 1


@pytest.fixture(scope="module")
def long_named_model(tiny_llama_path, tmp_path_factory) -> str:
    """The tiny model in a folder whose path is longer than 80 columns."""
    path = tmp_path_factory.mktemp("log-format") / ("a-model-folder-with-a-long-name-" * 3) / "tiny"
    shutil.copytree(tiny_llama_path, path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_run_writes_one_format_to_a_file(long_named_model, tmp_path, log_format):
    server = ServerProcess([long_named_model, "--kv-cache-memory", "16MiB", "--log-format", log_format],
                           str(tmp_path / "server.log"))
    try:
        with server.client() as c:
            assert c.post("/v1/completions", json={"prompt": "the city", "max_tokens": 2}).status_code == 200
    finally:
        assert server.stop() == 0
    output = server.output()
    assert "Loading weights" not in output and "\r" not in output
    if log_format == "json":
        entries = [json.loads(line) for line in output.splitlines() if line.strip()]
        loggers = {e["logger"] for e in entries}
        serving = [e for e in entries if e["message"] == "serving"]
        assert serving and serving[0]["model_path"] == long_named_model
    else:
        lines = assert_one_text_format(output)
        loggers = {LINE.match(line).group(0).split()[-1].rstrip(":") for line in lines}
        assert any(line.endswith(f"  model:          {long_named_model}") for line in lines), output
    assert {"fp8kv", "uvicorn.error", "uvicorn.access"} <= loggers, loggers


@pytest.mark.parametrize(("command", "log_format"), [("generate", "text"), ("run", "json")])
def test_a_commands_error_is_a_line_of_its_log(tmp_path, command, log_format):
    missing = str(tmp_path / ("a-missing-model-folder-with-a-long-name-" * 3) / "model")
    args = ["generate", missing, "the city"] if command == "generate" else \
        ["run", missing, "--port", "0", "--log-format", "json"]
    done = _fp8kv(*args)
    assert done.returncode == 2, done.stderr
    if log_format == "json":
        entries = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
        errors = [e["message"] for e in entries if e["level"] == "error"]
    else:
        errors = [line.split(": ", 1)[1] for line in assert_one_text_format(done.stderr) if " ERROR " in line]
    assert len(errors) == 1 and f"model path '{missing}' does not exist" in errors[0], done.stderr


def test_systemd_unit_warns_in_the_log_format(tmp_path):
    """A unit that cannot start (its model under /tmp, which PrivateTmp= hides) is a WARNING line of the log,
    the unit itself alone on stdout."""
    model = Path("/tmp") / tmp_path.name
    done = _fp8kv("systemd-unit", str(model), "--device", "cpu", "--api-key", "k")
    assert done.returncode == 0, done.stderr
    lines = assert_one_text_format(done.stderr)
    assert [line.split(" ", 2)[1] for line in lines] == ["INFO", "WARNING"], lines
    assert "FP8KV_API_KEY" in lines[0] and "PrivateTmp=yes" in lines[1]
    assert "\n[Unit]\n" in done.stdout and "will not start" not in done.stdout  # the log is not in the unit


def test_no_command_wraps_its_stderr():
    """rich wraps a Console's lines at the terminal's width, 80 columns when stderr is a pipe: a path, or the
    "CPU path scalar" a test looked for, came out split over two lines. Every command's stderr console
    soft-wraps (a line is as long as it is)."""
    import importlib
    import pkgutil

    from rich.console import Console

    import launcher

    consoles = []
    for info in pkgutil.iter_modules(launcher.__path__):
        module = importlib.import_module(f"launcher.{info.name}")
        consoles += [(info.name, c) for c in vars(module).values() if isinstance(c, Console) and c.stderr]
    assert len(consoles) >= 6
    assert [name for name, c in consoles if not c.soft_wrap] == []
    from launcher.options import console

    long = "x" * 50 + " " + "/a/path/" * 20
    with console.capture() as captured:
        console.print(f"[bold red]error:[/] {long}", highlight=False)
    assert captured.get() == f"error: {long}\n"
