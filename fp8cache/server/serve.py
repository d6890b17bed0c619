"""Run the HTTP server: load the engine, serve with uvicorn, stop gracefully, tell systemd.

Exit codes: 0 after a signal-driven stop (in-flight requests finished or cut at the graceful timeout) or
SIGTERM while loading, 130 for SIGINT (Ctrl-C) while loading, 1 when the engine loop crashed (so
Restart=on-failure restarts us), 3 when the port cannot be bound (checked before the model loads).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from fp8cache.config import EngineConfig
from fp8cache.engine.generation_defaults import (
    DEFAULT_MAX_TOKENS,
    check_generation_flags,
    describe_cap,
    load_generation_defaults,
)
from fp8cache.platform.log import JsonFormatter, OncePerInterval, configure_logging, log_function  # noqa: F401 - the log's set-up lives there
from fp8cache.server import grammar as G
from fp8cache.server.connections import DEFAULT_READ_TIMEOUT_S, connection_limits, protocol_class
from fp8cache.systemd.listener import ListenError, bind_listeners
from fp8cache.systemd.notify import Notifier, watchdog_interval

logger = logging.getLogger("fp8kv")

EXIT_OK, EXIT_ENGINE_CRASH, EXIT_PORT_IN_USE = 0, 1, 3


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    graceful_timeout: float = 30.0
    log_format: str = "text"  # text | json
    max_request_bytes: int = 4 * 2**20
    max_concurrent_requests: int = 256
    access_log: bool = True
    max_connections: int | None = None  # None: from the open-file limit (connections.connection_limits)
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    structured_output_timeout: float = G.DEFAULT_TIMEOUT_S
    structured_output_memory: int | str = G.DEFAULT_MEMORY_BYTES  # bytes, or a size such as "2GiB"
    stall_timeout: float = 60.0
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # 0: a request without max_tokens may fill the context


# After the graceful timeout the server ends the streams still running (each gets its final event), then
# gives them this long to go out before uvicorn cancels what is left.
FINAL_EVENTS_S = 2.0


# The engine's log: its "warning: ..." lines are WARNING lines, the rest INFO.
engine_log = log_function("fp8kv")


class _Server(uvicorn.Server):
    """uvicorn with our own signal handling: stop gracefully and exit 0 (uvicorn re-raises the signal,
    which would make the exit status 'killed by SIGTERM'), and tell systemd about each phase."""

    def __init__(self, config: uvicorn.Config, notifier: Notifier, on_started, graceful_timeout: float,
                 on_deadline) -> None:
        super().__init__(config)
        self.notifier = notifier
        self.on_started = on_started
        self.graceful_timeout = graceful_timeout
        self.on_deadline = on_deadline

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            logger.warning("second %s: stopping now without waiting for requests", signal.Signals(sig).name)
            self.force_exit = True
            return
        self.should_exit = True
        self.notifier.stopping(f"stopping on {signal.Signals(sig).name}")
        logger.info("%s received: no new connections; in-flight requests get up to %ss to finish",
                    signal.Signals(sig).name, self.graceful_timeout)

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started(self)

    async def shutdown(self, sockets: list | None = None) -> None:
        # uvicorn cancels what runs past its timeout, which cuts a stream mid-event; ending the requests
        # ourselves at the graceful timeout lets each stream send its final event first.
        deadline = asyncio.get_running_loop().call_later(self.graceful_timeout, self.on_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def serve(config: EngineConfig, options: ServeOptions) -> int:
    """Load the engine, serve until a signal or an engine crash; the process exit code."""
    from fp8cache.engine.llm_engine import LLMEngine
    from fp8cache.engine.sampling_params import SamplingParams
    from fp8cache.engine.warmup import warm_up
    from fp8cache.server.app import create_app
    from fp8cache.server.async_engine import AsyncEngine
    from fp8cache.server.metrics import ServerMetrics
    from fp8cache.server.middleware import LOOPBACK_HOSTS
    from fp8cache.server.state import AppState, ModelInfo, ServerSettings

    if not isinstance(options.structured_output_memory, int):
        from fp8cache.kvcache.sizing import parse_memory_size

        options = dataclasses.replace(options, structured_output_memory=parse_memory_size(
            options.structured_output_memory, "--structured-output-memory"))
    check_generation_flags(config.generation_config, config.override_generation_config)  # before loading too
    try:
        sockets = bind_listeners(options.host, options.port)  # before loading: a port in use fails at once
    except ListenError as exc:
        logger.error("%s", exc)
        return EXIT_PORT_IN_USE
    notifier = Notifier()
    notifier.status("loading the model")
    with _exit_on_signal(notifier):
        engine = LLMEngine(config, log=engine_log)
        notifier.status("warming up")
        # Before /health answers and systemd hears READY: a model that cannot run fails here (EngineStartError,
        # exit 2 with one line), not on the first request.
        warm_up(engine, engine_log)
    info = ModelInfo.from_runner(engine.runner)
    model_path = str(getattr(engine.runner, "model_path", None) or config.model or "")
    name = options.served_model_name or default_served_name(config.model, model_path)
    generation = load_generation_defaults(config.generation_config, model_path, config.override_generation_config)
    logger.info("request defaults: %s; new tokens of a request without max_tokens: %s", generation.describe(),
                describe_cap(options.default_max_tokens, generation.max_new_tokens))
    metrics = ServerMetrics(name, info.kv_cache_dtype, {"scales_source": info.scales_source,
                                                         "capacity_tokens": str(info.capacity_tokens),
                                                         "block_size": str(info.block_size)})
    metrics.watch_saturation(getattr(engine.runner, "saturation_counts", list))
    outcome = {"code": EXIT_OK}
    server: _Server | None = None

    def on_engine_dead(exc: BaseException | None) -> None:
        logger.error("the engine loop died (%r); exiting with status %d", exc, EXIT_ENGINE_CRASH)
        outcome["code"] = EXIT_ENGINE_CRASH
        notifier.stopping("engine crashed")
        if server is not None:
            server.should_exit = True

    async_engine = AsyncEngine(engine, metrics, on_dead=on_engine_dead, log=engine_log)
    settings = ServerSettings(served_model_name=name, model_path=model_path, api_key=options.api_key,
                              max_request_bytes=options.max_request_bytes,
                              max_concurrent_requests=options.max_concurrent_requests,
                              allowed_hosts=LOOPBACK_HOSTS if is_loopback(options.host) else None,
                              structured_output_timeout=options.structured_output_timeout,
                              structured_output_memory=options.structured_output_memory,
                              stall_timeout=options.stall_timeout, default_max_tokens=options.default_max_tokens,
                              generation=generation)
    app = create_app(AppState(settings, info, async_engine, metrics, SamplingParams))
    limits, warning = connection_limits(options.max_connections)
    if warning:
        logger.warning(warning)
    uv_config = uvicorn.Config(app, host=options.host, port=options.port, log_config=None, lifespan="on",
                               timeout_graceful_shutdown=options.graceful_timeout + FINAL_EVENTS_S, ws="none",
                               http=protocol_class(limits, options.read_timeout), backlog=limits.backlog,
                               access_log=options.access_log, server_header=False)

    def on_deadline() -> None:
        cut = async_engine.abort_all("graceful shutdown timeout")
        if cut:
            logger.warning("graceful timeout (%gs) reached: ended %d requests still running",
                           options.graceful_timeout, cut)

    def on_started(srv: _Server) -> None:
        port = srv.servers[0].sockets[0].getsockname()[1]
        host = f"[{options.host}]" if ":" in options.host else options.host
        url = f"http://{host}:{port}"
        _print_summary(name, model_path, info, url, options)
        notifier.ready(f"serving {name} at {url}")
        interval = watchdog_interval()
        if interval:
            srv.watchdog_task = asyncio.ensure_future(_watchdog(notifier, async_engine, interval))

    server = _Server(uv_config, notifier, on_started, options.graceful_timeout, on_deadline)
    try:
        server.run(sockets=sockets)
    finally:
        notifier.stopping()
        async_engine.stop(timeout=5.0)
    logger.info("fp8kv stopped (exit status %d)", outcome["code"])
    return outcome["code"]


async def _watchdog(notifier: Notifier, engine: Any, interval: float) -> None:
    # Vouch only for a loop thread that is not stuck in one step for the whole watchdog period: a hung
    # step() stops the pings and systemd restarts us.
    while True:
        if engine.is_responsive(max_step_seconds=2 * interval):
            notifier.watchdog()
        await asyncio.sleep(interval)


@contextlib.contextmanager
def _exit_on_signal(notifier: Notifier) -> Iterator[None]:
    """While the model loads there is no server to drain: a stop signal just ends the process cleanly."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(sig: int, frame: Any) -> None:
        notifier.stopping()
        logger.info("%s received while loading; exiting", signal.Signals(sig).name)
        # SIGTERM is how systemd stops a service (a clean stop); Ctrl-C interrupted the start, and the shell
        # convention for that is 128 + SIGINT.
        raise SystemExit(EXIT_OK if sig == signal.SIGTERM else 128 + sig)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_served_name(model: str | None, model_path: str) -> str:
    """The model name the API serves: a hub id as given (its folder is a snapshot named by a commit hash), else
    the model folder's name."""
    if model and not os.path.exists(os.path.expanduser(model)) and os.path.abspath(model) != model_path:
        return model
    return _default_name(model_path)


def _default_name(model_path: str) -> str:
    return model_path.rstrip("/").rsplit("/", 1)[-1] or "default"


def _print_summary(name: str, model_path: str, info: Any, url: str, options: ServeOptions) -> None:
    fields = {"model": name, "model_path": model_path, "kv_cache_dtype": info.kv_cache_dtype,
              "scales_source": info.scales_source, "kv_recent_window": info.kv_recent_window,
              "kv_recent_window_sinks": getattr(info, "kv_recent_window_sinks", 0),
              "capacity_tokens": info.capacity_tokens,
              "max_model_len": info.max_model_len, "url": url, "api_key_required": bool(options.api_key)}
    if options.log_format == "json":
        logger.info("serving", extra={"fields": fields})
        return
    lines = [f"fp8kv serving {name} at {url}",
             f"  model:          {model_path}",
             (f"  kv cache:       {info.kv_cache_dtype}, scales: {info.scales_source}, "
             f"recent window: {_window_words(info)}"),
             f"  capacity:       {info.capacity_tokens} tokens ({info.num_blocks} blocks of {info.block_size})",
             f"  max model len:  {info.max_model_len}",
             f"  OpenAI API:     {url}/v1 (completions, chat/completions, models)",
             f"  TGI API:        {url}/generate, /generate_stream, /info",
             f"  health/metrics: {url}/health, {url}/metrics",
             f"  API key:        {'required (Authorization: Bearer)' if options.api_key else 'not required'}"]
    for line in lines:
        logger.info(line)


def _window_words(info: Any) -> str:
    """"32 tokens + 1 sink in bfloat16": the recent window and the attention sinks kept beside it."""
    sinks = getattr(info, "kv_recent_window_sinks", 0)
    plural = "s" if sinks != 1 else ""
    return (f"{info.kv_recent_window} tokens" + (f" + {sinks} sink{plural}" if sinks else "")
            + f" in {info.window_dtype}")
