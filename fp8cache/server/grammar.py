"""Structured output grammars for the server, compiled in worker processes with a size, time and memory budget.

A grammar's compile cost has little to do with its length: the 24-byte regex ((a{1,50}){1,50}){1,50} takes
minutes, a 100 KB choice gigabytes. outlines-core compiles in Rust and cannot be interrupted from another
thread, so compiles run in a pebble process pool: a compile past its time limit, or one whose client went
away, has its worker process killed (and replaced), and an address-space limit in each worker turns a runaway
compile into a failed one instead of an OOM kill of the server. Compiled indexes come back pickled; the last
ones are kept within a byte budget, and a grammar that failed is refused at once when it comes again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import pickle
import resource
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from fp8cache.engine.structured_output import StructuredOutputsParams, compile_index, vocabulary_map

logger = logging.getLogger("fp8kv.grammar")

MAX_REGEX_CHARS = 4096
MAX_CHOICE_CHARS = 16384  # all choices together
MAX_SCHEMA_CHARS = 65536  # a JSON schema, as compact JSON
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MEMORY_BYTES = 2 * 2**30  # per worker, on top of what it uses once started
DEFAULT_WORKERS = 2
_CACHE_ENTRIES = 64
_FAILURES_KEPT = 256
# A grammar that failed is refused at once for this long: a client repeating a pathological one costs nothing,
# and one that only timed out on a busy machine gets another try later.
_FAILURE_TTL_S = 600.0


class GrammarError(ValueError):
    """A grammar the server will not use: too big, too slow or too large to compile, or invalid."""


def size_problem(structure: StructuredOutputsParams) -> str | None:
    """Why structure is too big to be compiled at all, or None. Checked before any work is spent on it."""
    if structure.regex is not None and len(structure.regex) > MAX_REGEX_CHARS:
        return (f"the regex has {len(structure.regex)} characters; at most {MAX_REGEX_CHARS} are allowed (its "
                "compile time and memory grow with it)")
    if structure.choice is not None:
        total = sum(len(c) for c in structure.choice)
        if total > MAX_CHOICE_CHARS:
            return (f"the choices have {total} characters in all; at most {MAX_CHOICE_CHARS} are allowed (their "
                    "compile time and memory grow with them)")
    if structure.json is not None:
        size = len(structure.json) if isinstance(structure.json, str) else len(_compact(structure.json))
        if size > MAX_SCHEMA_CHARS:
            return (f"the JSON schema has {size} characters as compact JSON; at most {MAX_SCHEMA_CHARS} are "
                    "allowed (its compile time and memory grow with it)")
    return None


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def cache_key(structure: StructuredOutputsParams) -> str:
    kind = next(k for k in ("json", "regex", "choice") if getattr(structure, k) is not None) \
        if not structure.json_object else "json_object"
    value = getattr(structure, kind) if kind != "json_object" else None
    return kind + ":" + (value if isinstance(value, str) else _compact(value))


def _format_bytes(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer off the request path. Use from one event loop."""

    def __init__(self, tokenizer: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES, workers: int = DEFAULT_WORKERS,
                 cache_bytes: int | None = None, observe: Callable[[str], None] | None = None) -> None:
        """observe(outcome): compiled, timeout, memory or cancelled once per compile; cached or refused per
        request answered without one."""
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.workers = workers
        self.cache_bytes = memory_bytes if cache_bytes is None else cache_bytes
        self._pool: Any = None
        self._cache: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # key -> (index, pickled size)
        self._failures: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (why it was refused, when)
        self._running: dict[str, asyncio.Task] = {}
        self._waiters: dict[str, int] = {}
        self.counts = dict.fromkeys(("compiled", "cached", "refused", "timeout", "memory", "cancelled"), 0)
        self._observer = observe

    def _observe(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self._observer is not None:
            self._observer(outcome)

    async def compile(self, structure: StructuredOutputsParams) -> StructuredOutputsParams:
        """structure with its compiled index; GrammarError when it is refused. Cancelling the call abandons
        the compile (its worker is killed) unless another request waits for the same grammar."""
        problem = size_problem(structure)
        if problem is not None:
            self._observe("refused")
            raise GrammarError(problem)
        key = cache_key(structure)
        failure = self._failures.get(key)
        if failure is not None and time.monotonic() - failure[1] < _FAILURE_TTL_S:
            self._observe("refused")
            raise GrammarError(failure[0])
        if key in self._cache:
            self._cache.move_to_end(key)
            self._observe("cached")
            return structure.with_compiled(self._cache[key][0])
        task = self._running.get(key)
        if task is None:
            task = self._running[key] = asyncio.ensure_future(self._compile(key, structure))
            task.add_done_callback(lambda _: self._running.pop(key, None))
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            index = await asyncio.shield(task)
        except asyncio.CancelledError:
            if self._waiters[key] == 1 and not task.done():
                task.cancel()  # nobody else wants it: stop the worker
            raise
        finally:
            self._waiters[key] -= 1
            if not self._waiters[key]:
                del self._waiters[key]
        return structure.with_compiled(index)

    async def _compile(self, key: str, structure: StructuredOutputsParams) -> Any:
        pool = await self._ensure_pool()
        future = pool.schedule(_compile_in_worker, (structure,), timeout=self.timeout_s)
        try:
            data = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            self._observe("cancelled")
            logger.info("a structured output compile was abandoned: its client went away")
            raise
        except FutureTimeout:
            self._observe("timeout")
            raise self._fail(key, f"the grammar took longer than {self.timeout_s:g} s to compile and was stopped; "
                             "simplify it (fewer or shorter choices, smaller repeat counts such as {1,50}, a "
                             "smaller schema) or raise fp8kv run --structured-output-timeout") from None
        except (MemoryError, OSError):  # pebble's ProcessExpired is an OSError: the worker died (address space)
            self._observe("memory")
            raise self._fail(key, f"compiling the grammar needed more than its memory budget of "
                             f"{_format_bytes(self.memory_bytes)} and was stopped; simplify it or raise fp8kv run "
                             "--structured-output-memory") from None
        except ValueError as exc:
            self._observe("refused")
            raise self._fail(key, str(exc)) from None
        index = await asyncio.to_thread(pickle.loads, data)
        self._observe("compiled")
        self._remember(key, index, len(data))
        return index

    def _fail(self, key: str, message: str) -> GrammarError:
        self._failures.pop(key, None)
        self._failures[key] = (message, time.monotonic())
        while len(self._failures) > _FAILURES_KEPT:
            self._failures.popitem(last=False)
        return GrammarError(message)

    def _remember(self, key: str, index: Any, size: int) -> None:
        if size > self.cache_bytes:
            return
        self._cache[key] = (index, size)
        while len(self._cache) > _CACHE_ENTRIES or sum(s for _, s in self._cache.values()) > self.cache_bytes:
            self._cache.popitem(last=False)

    async def _ensure_pool(self) -> Any:
        if self._pool is None:
            from pebble import ProcessPool

            # The vocabulary map walks the whole tokenizer: a fraction of a second, once, off the event loop.
            eos, by_bytes = await asyncio.to_thread(vocabulary_map, self.tokenizer)
            if self._pool is None:
                # spawn, not fork: a forked child of this process would inherit its threads' locks and its
                # address space, which the memory limit would then count.
                self._pool = ProcessPool(self.workers, initializer=_start_worker,
                                         initargs=(eos, by_bytes, self.memory_bytes),
                                         context=multiprocessing.get_context("spawn"))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            try:
                # A worker started to replace a killed one must finish starting, or it dies on the pool's
                # vanished pipes with a traceback in the log.
                self._pool.join(timeout=10)
            except TimeoutError:
                pass
            self._pool = None


# -- the worker processes -----------------------------------------------------------------------------

_vocabulary: Any = None


def _start_worker(eos: int, by_bytes: dict[bytes, list[int]], memory_bytes: int) -> None:
    global _vocabulary
    from outlines_core import Vocabulary

    _vocabulary = Vocabulary(eos, by_bytes)
    # Counted from what the worker already maps (the interpreter, and whatever its parent's main module
    # imports), so the budget is what one compile may add.
    limit = _address_space() + memory_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def _address_space() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _compile_in_worker(structure: StructuredOutputsParams) -> bytes:
    try:
        return pickle.dumps(compile_index(structure.to_regex(), _vocabulary))
    except MemoryError:
        raise
    except ValueError:
        raise
    except BaseException as exc:  # noqa: BLE001 - a Rust panic is a BaseException; it is this grammar's fault
        raise ValueError(f"the structured output pattern cannot be compiled: {exc}") from None
