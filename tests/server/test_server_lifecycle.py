"""Lifecycle of a real server: systemd notifications, client disconnects, SIGTERM, an engine crash."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from server_process import ServerProcess, engine_stats, wait_idle

WAIT_S = 120.0  # upper bound for things that happen "soon"; never asserted as a duration


class NotifyListener:
    """A fake systemd: a Unix datagram socket that records what the service sends to NOTIFY_SOCKET."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except OSError:
                continue

    def lines(self) -> list[str]:
        return [line for m in list(self.messages) for line in m.splitlines()]

    def wait_for(self, line: str, count: int = 1) -> int:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and self.lines().count(line) < count:
            time.sleep(0.05)
        return self.lines().count(line)

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close()


@pytest.fixture(scope="module")
def notify(tmp_path_factory):
    listener = NotifyListener(str(tmp_path_factory.mktemp("notify") / "notify.sock"))
    yield listener
    listener.close()


def _notifying_server(model_path: str, folder, notify: NotifyListener) -> ServerProcess:
    env = {"NOTIFY_SOCKET": notify.sock.getsockname(), "WATCHDOG_USEC": "1000000"}
    return ServerProcess([model_path, "--kv-cache-dtype", "fp8_e5m2", "--calculate-kv-scales",
                          "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--graceful-timeout", "120",
                          "--log-format", "json"], str(folder / "server.log"), env=env)


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory, notify):
    proc = _notifying_server(default_model_path, tmp_path_factory.mktemp("server"), notify)
    yield proc
    proc.stop()


@pytest.fixture
def server_to_stop(default_model_path, tmp_path):
    """A server of the test's own, with its own fake systemd, for a test that stops it: the module's server
    stays up for the other tests whatever order they run in."""
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    proc = _notifying_server(default_model_path, tmp_path, listener)
    yield proc, listener
    proc.stop()
    listener.close()


def _stream_body(max_tokens: int) -> dict:
    return {"prompt": "Tell me a long story about the sea.", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.slow
def test_ready_once_serving_and_watchdog_pings(server, notify):
    assert notify.wait_for("READY=1") == 1
    assert notify.wait_for("WATCHDOG=1", count=2) >= 2
    assert "STOPPING=1" not in notify.lines()
    with server.client() as c:
        assert c.get("/health").status_code == 200


@pytest.mark.slow
def test_json_log_lines(server):
    lines = [line for line in server.output().splitlines() if line.startswith("{")]
    entries = [json.loads(line) for line in lines]
    serving = [e for e in entries if e["message"] == "serving"]
    assert len(serving) == 1
    assert serving[0]["kv_cache_dtype"] == "fp8_e5m2" and serving[0]["url"] == server.url
    assert serving[0]["capacity_tokens"] > 0 and serving[0]["scales_source"]
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)


@pytest.mark.slow
def test_stream_disconnect_aborts_and_frees_blocks(server):
    before = engine_stats(server)["num_generated_tokens"]
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as c, \
            c.stream("POST", "/v1/completions", json=_stream_body(200)) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: {")
            if seen == 2:
                break  # leaving the block drops the connection mid-stream
    stats = wait_idle(server)
    assert stats["blocks_used"] == 0 and stats["num_running"] == 0, stats
    assert stats["num_generated_tokens"] - before < 200  # the rest was never generated


@pytest.mark.slow
def test_non_streaming_disconnect_aborts(server):
    before = engine_stats(server)["num_generated_tokens"]
    body = {"prompt": "Write a very long essay.", "max_tokens": 200, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(WAIT_S, read=1.0)) as c, \
            pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=body)
    stats = wait_idle(server)
    assert stats["blocks_used"] == 0 and stats["num_running"] == 0, stats
    assert stats["num_generated_tokens"] - before < 200


@pytest.mark.slow
def test_sigterm_finishes_inflight_request_then_exits_zero(server_to_stop):
    server, notify = server_to_stop
    max_tokens = 48
    result: dict = {"events": [], "done": False}
    first_token = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as c, \
                c.stream("POST", "/v1/completions", json=_stream_body(max_tokens)) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    result["done"] = True
                elif line.startswith("data: "):
                    result["events"].append(json.loads(line[6:]))
                    first_token.set()

    thread = threading.Thread(target=client)
    thread.start()
    assert first_token.wait(WAIT_S)
    server.proc.terminate()  # SIGTERM
    assert notify.wait_for("STOPPING=1") >= 1
    refused = _wait_refused(server.url)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert refused, "the server kept accepting connections after SIGTERM"
    assert result["status"] == 200 and result["done"]
    assert result["events"][-1]["usage"]["completion_tokens"] == max_tokens
    finishes = [ch["finish_reason"] for e in result["events"] for ch in e["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    assert server.proc.wait(WAIT_S) == 0, server.output()[-3000:]


def _wait_refused(url: str) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            with httpx.Client(base_url=url, timeout=5) as c:
                c.get("/health")
        except httpx.TransportError:
            return True
        time.sleep(0.05)
    return False


CRASH_PRELUDE = """
import fp8cache.engine.llm_engine as _engine

_real_step = _engine.LLMEngine.step

def _crashing_step(self):
    # The warm-up's request runs as before (a model that fails it never serves); a client's request crashes.
    queued = [*self.scheduler.waiting, *self.scheduler.running]
    if any(not seq.request_id.startswith("fp8kv-warm-up") for seq in queued):
        raise RuntimeError("simulated engine crash")
    return _real_step(self)

_engine.LLMEngine.step = _crashing_step
"""


@pytest.mark.slow
def test_engine_crash_exits_nonzero(tiny_llama_path, tmp_path):
    listener = NotifyListener(b"\0fp8kv-test-" + str(time.monotonic_ns()).encode())  # abstract name
    try:
        proc = ServerProcess([tiny_llama_path, "--kv-cache-dtype", "fp8", "--kv-cache-memory", "4MiB"],
                             str(tmp_path / "crash.log"), python_prelude=CRASH_PRELUDE,
                             env={"NOTIFY_SOCKET": "@" + listener.sock.getsockname()[1:].decode()})
        assert listener.wait_for("READY=1") == 1
        with proc.client() as c:
            response = c.post("/v1/completions", json={"prompt": "the city", "max_tokens": 4})
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        assert "crash" in message and "simulated" not in message  # what raised stays in the log
        code = proc.proc.wait(WAIT_S)
        proc.stop()
        assert code == 1, proc.output()[-3000:]
        assert listener.wait_for("STOPPING=1") >= 1
    finally:
        listener.close()


class _BlockingEngine:
    """An engine whose step() waits for `release`: a hung step, or a slow one that ends when released."""

    def __init__(self) -> None:
        self.in_step = threading.Event()
        self.release = threading.Event()

    def has_unfinished_requests(self) -> bool:
        return not self.release.is_set()

    def step(self) -> list:
        self.in_step.set()
        self.release.wait(WAIT_S)
        return []


class _JoinSpy:
    """The loop thread, with the timeouts its joins were given."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread, self.joins = thread, []

    def join(self, timeout: float | None = None) -> None:
        self.joins.append(timeout)
        self.thread.join(timeout)

    def is_alive(self) -> bool:
        return self.thread.is_alive()


def _loop_in_a_step():
    import asyncio

    from fp8cache.server.async_engine import AsyncEngine

    engine = _BlockingEngine()
    loop = asyncio.new_event_loop()
    async_engine = AsyncEngine(engine, log=lambda message: None)
    async_engine.start(loop)
    assert engine.in_step.wait(WAIT_S)
    spy = async_engine._thread = _JoinSpy(async_engine._thread)
    return engine, async_engine, spy, loop


def test_a_stop_does_not_wait_for_a_loop_stalled_past_the_stall_timeout():
    """A SIGTERM'd server whose engine hangs in a step exits after its graceful timeout: the app's shutdown does
    not wait for a loop /health already calls stalled, and serve()'s last stop does not wait again (both waited,
    10 s and 5 s, before)."""
    engine, async_engine, spy, loop = _loop_in_a_step()
    try:
        async_engine.stop(timeout=30.0, stall_timeout=0.0)  # stalled: its step began > 0 s ago
        async_engine.stop(timeout=5.0)
        assert spy.joins == [0.0] and spy.is_alive()
    finally:
        engine.release.set()
        spy.thread.join(WAIT_S)
        loop.close()


def test_a_stop_waits_for_a_step_that_is_not_stalled():
    engine, async_engine, spy, loop = _loop_in_a_step()
    try:
        threading.Timer(0.05, engine.release.set).start()  # the step ends during the wait
        async_engine.stop(timeout=WAIT_S, stall_timeout=WAIT_S)
        assert spy.joins == [WAIT_S] and not spy.is_alive()
        async_engine.stop(timeout=5.0)  # a later stop finds the thread gone
        assert spy.joins == [WAIT_S, 5.0]
    finally:
        engine.release.set()
        loop.close()
