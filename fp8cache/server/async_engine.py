"""The bridge between asyncio request handlers and the synchronous LLMEngine.

One dedicated thread calls LLMEngine.step() while there is work and sleeps on an Event otherwise. Each
request owns an asyncio.Queue; the thread hands every RequestOutput to its request's queue through
loop.call_soon_threadsafe. A handler that goes away (client disconnect, shutdown timeout) closes its
RequestStream in `finally`, which aborts the request and so frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from fp8cache.server.metrics import ServerMetrics


class EngineDeadError(RuntimeError):
    """The engine loop stopped (crash or shutdown); no request can progress any more."""


class RequestAborted(RuntimeError):
    """The server cut the request short (its graceful shutdown timeout passed)."""


class AsyncEngine:
    def __init__(self, engine: Any, metrics: ServerMetrics | None = None,
                 on_dead: Callable[[BaseException | None], None] | None = None,
                 log: Callable[[str], None] = print) -> None:
        self.engine = engine
        self.metrics = metrics
        self.on_dead = on_dead  # called in the event loop when the loop thread ends with an error
        self.log = log
        self.error: BaseException | None = None
        self._step_started: float | None = None  # when the running step() began; None between steps
        self._progress = time.monotonic()  # when the loop last finished a step or found nothing to do
        self._queues: dict[str, asyncio.Queue] = {}
        self._num_seqs: dict[str, int] = {}  # sequences per active request (its n)
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gave_up = False  # a stop found the loop still in its step after its wait
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="fp8kv-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0, stall_timeout: float | None = None) -> None:
        """Ask the loop to end after its step and wait up to `timeout` for it. A loop stalled past
        `stall_timeout` (what /health reports) is not waited for, nor is one a stop already waited for in vain:
        its thread is a daemon, and a hung step would only hold a SIGTERM'd server up for nothing."""
        self._stop.set()
        self._wakeup.set()
        if self._thread is None or self._gave_up:
            return
        if stall_timeout is not None and self.stalled_seconds() > stall_timeout:
            timeout = 0.0
        self._thread.join(timeout)
        self._gave_up = self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def is_responsive(self, max_step_seconds: float) -> bool:
        """Alive, and not stuck in one step() for longer than `max_step_seconds`: what the systemd watchdog
        vouches for."""
        started = self._step_started
        return self.alive and (started is None or time.monotonic() - started < max_step_seconds)

    def stalled_seconds(self) -> float:
        """How long requests have waited without the loop finishing a step (0 while it keeps up): a hung
        step, or a loop thread that never gets to run one."""
        if not self._queues and self._step_started is None:
            return 0.0
        return time.monotonic() - self._progress

    # -- the loop thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.engine.has_unfinished_requests():
                    self._progress = time.monotonic()
                    if not self._wakeup.wait(timeout=0.5):
                        continue
                    self._wakeup.clear()
                # With nothing running a step still drains queued aborts, which frees their blocks.
                self._step_started = time.monotonic()
                outputs = self.engine.step()
                self._step_started = None
                self._progress = time.monotonic()
                if self.metrics is not None and outputs:
                    self.metrics.batch_size.observe(len(outputs))
                for output in outputs:
                    self._deliver(output.request_id, output)
        except BaseException as exc:  # noqa: BLE001 - any escape from step() means the engine is gone
            self.error = exc
            self.log("engine loop crashed:\n" + "".join(traceback.format_exception(exc)))
            for request_id in list(self._queues):
                self._deliver(request_id, EngineDeadError(f"engine crashed: {exc!r}"))
            if self._loop is not None and self.on_dead is not None:
                self._loop.call_soon_threadsafe(self.on_dead, exc)

    def _deliver(self, request_id: str, item: Any) -> None:
        queue = self._queues.get(request_id)
        if queue is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop closed under us during shutdown
                pass

    # -- requests (event loop side) ----------------------------------------------------------------

    def submit(self, request_id: str, prompt: str | list[int], params: Any,
               arrival: float | None = None) -> RequestStream:
        """Add a request now (so refusals surface before any response is sent) and return its stream.

        Raises ValueError when the engine refuses the request, EngineDeadError when the loop is gone.
        The caller must close() the stream in a `finally`: closing an unfinished stream aborts the request.
        """
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._num_seqs[request_id] = int(getattr(params, "n", 1))
        try:
            self.engine.add_request(request_id, prompt, params)
        except BaseException:
            self._queues.pop(request_id, None)
            self._num_seqs.pop(request_id, None)
            raise
        self._wakeup.set()
        return RequestStream(self, request_id, queue, time.monotonic() if arrival is None else arrival)

    def abort_all(self, reason: str) -> int:
        """End every active request now: each stream gets RequestAborted(reason) and the engine drops the
        requests. Call in the event loop. The number of requests ended."""
        ids = list(self._queues)
        for request_id in ids:
            self._queues[request_id].put_nowait(RequestAborted(reason))
        if ids:
            try:
                self.engine.abort_request(ids)
            except Exception as exc:  # noqa: BLE001 - the streams end anyway
                self.log(f"abort at shutdown failed: {exc!r}")
            self._wakeup.set()
        return len(ids)

    def _release(self, request_id: str, abort: bool) -> None:
        self._queues.pop(request_id, None)
        self._num_seqs.pop(request_id, None)
        if not abort:
            return
        if self.metrics is not None:
            self.metrics.aborted.inc()
        try:
            self.engine.abort_request(request_id)
        except Exception as exc:  # noqa: BLE001 - a failed abort must not mask the reason we abort
            self.log(f"abort of {request_id} failed: {exc!r}")
        self._wakeup.set()

    # -- observation -------------------------------------------------------------------------------

    @property
    def num_active_requests(self) -> int:
        return len(self._queues)

    @property
    def num_active_sequences(self) -> int:
        return sum(self._num_seqs.values())

    def stats(self) -> dict[str, float]:
        """A snapshot of the engine's counters under stable names (for /metrics and /info)."""
        raw = getattr(self.engine, "stats", None)
        raw = raw() if callable(raw) else raw
        raw = raw if isinstance(raw, dict) else (vars(raw) if raw is not None else {})
        out = {k: v for k, v in raw.items() if isinstance(v, (int, float))}
        queries = out.get("prefix_cache_queries", 0)
        out.setdefault("prefix_cache_hit_rate", out.get("prefix_cache_hits", 0) / queries if queries else 0.0)
        out["engine_alive"] = 1 if self.alive else 0
        out["active_requests"] = self.num_active_requests
        out["active_sequences"] = self.num_active_sequences
        return out


class RequestStream:
    """Async iterator over one request's cumulative RequestOutputs, ending after the finished one."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue, arrival: float) -> None:
        self.engine = engine
        self.request_id = request_id
        self.arrival = arrival
        self.finished = False
        self._queue = queue
        self._closed = False
        self._last_time: float | None = None
        self._last_count = 0

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Any:
        if self.finished or self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        self._observe_tokens(item)
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        """Stop listening; aborts the request in the engine if it has not finished. Idempotent."""
        if not self._closed:
            self._closed = True
            self.engine._release(self.request_id, abort=not self.finished and self.engine.alive)

    def _observe_tokens(self, output: Any) -> None:
        metrics = self.engine.metrics
        count = sum(len(c.token_ids) for c in output.outputs)
        new = count - self._last_count
        if new <= 0:
            return
        now = time.monotonic()
        if metrics is not None:
            if self._last_time is None:
                metrics.ttft.observe(now - self.arrival)
            else:
                for _ in range(new):
                    metrics.itl.observe((now - self._last_time) / new)
            metrics.generation_tokens.inc(new)
        self._last_time, self._last_count = now, count
