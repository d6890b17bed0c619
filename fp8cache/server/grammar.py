"""Structured output grammars for the server, compiled in worker processes with a size, time and memory budget.

A grammar's compile cost has little to do with its length: the 24-byte regex ((a{1,50}){1,50}){1,50} takes
minutes, a 100 KB choice gigabytes. outlines-core compiles in Rust and cannot be interrupted from another
thread, so compiles run in a pebble process pool: a compile past its time limit, or one whose client went
away, has its worker process killed (and replaced), and an address-space limit in each worker turns a runaway
compile into a failed one instead of an OOM kill of the server. Compiled indexes come back pickled; the last
ones are kept within a byte budget, and a grammar that failed is refused at once when it comes again.

Fairness: a costly grammar must not hold up cheap ones. Each grammar's cost is estimated before it is compiled
(its regex's size with repeat counts multiplied out, grammar_cost): above MAX_COST it is refused at once (400),
above CHEAP_COST it is costly. Costly compiles run on all workers but one, so `json_object`, small schemas,
choices and short regexes always find a worker (they queue only behind each other); costly ones beyond
`max_costly_waiting` in line are refused with a 429 saying so. `json_object`, the one grammar every client
asks for alike (and, over a large vocabulary, not a quick one: ~30 s), is cheap by decree and, once compiled,
kept for good.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import pickle
import re
import resource
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
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
# Estimated automaton sizes (grammar_cost). Measured on the default model's tokenizer (49152 tokens), 2026-11-27:
# a 2-field schema ~30 (0.1 s), one string with minLength 100 ~320 (3.6 s), minLength 1000 ~3,000 (33 s),
# 30 strings of minLength 9999 ~900,000 (a single one of them took 222 s).
CHEAP_COST = 1_000
MAX_COST = 500_000
_CACHE_ENTRIES = 64
_FAILURES_KEPT = 256
# A grammar that failed is refused at once for this long: a client repeating a pathological one costs nothing,
# and one that only timed out on a busy machine gets another try later.
_FAILURE_TTL_S = 600.0


class GrammarError(ValueError):
    """A grammar the server will not use: too big, too slow or too large to compile, or invalid (status 400); or
    one that would wait behind too many costly compiles (429)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def grammar_cost(structure: StructuredOutputsParams) -> int:
    """A rough size of the automaton the grammar compiles to: its regex's atoms with every repeat count
    multiplied out (`a{1,50}` is 50, `(a{1,50}){1,50}` 2500; an open `{m,}` counts m + 1, `*` one). Compile time
    and memory grow with it. A regex Python's parser does not read (Rust-only syntax) counts as costly."""
    try:
        regex = structure.to_regex()
    except ValueError:
        return 0  # the compile says what is wrong with it
    try:
        from re import _constants as sre_constants
        from re import _parser as sre_parse
    except ImportError:  # Python 3.10
        import sre_constants
        import sre_parse
    try:
        parsed = sre_parse.parse(regex)
    except (re.error, RecursionError, OverflowError):
        return CHEAP_COST + 1
    return min(_expanded_size(parsed, sre_constants), MAX_COST * 1000)


def _expanded_size(items, c) -> int:
    total = 0
    repeats = {c.MAX_REPEAT, c.MIN_REPEAT} | ({c.POSSESSIVE_REPEAT} if hasattr(c, "POSSESSIVE_REPEAT") else set())
    for op, av in items:
        if op in repeats:
            low, high, sub = av
            total += max(high if high != c.MAXREPEAT else low + 1, 1) * _expanded_size(sub, c)
        elif op is c.SUBPATTERN:
            total += _expanded_size(av[-1], c)
        elif op is c.BRANCH:
            total += sum(_expanded_size(branch, c) for branch in av[1])
        elif hasattr(c, "ATOMIC_GROUP") and op is c.ATOMIC_GROUP:
            total += _expanded_size(av, c)
        elif op in (c.ASSERT, c.ASSERT_NOT):
            total += _expanded_size(av[1], c)
        else:
            total += 1
        if total > MAX_COST * 1000:  # no need to count further, nor to overflow
            return total
    return total


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


# runner(structure, timeout_s) -> (the compiled index, its size in bytes): where a compile runs (the worker
# processes; a stand-in in the tests). It raises FutureTimeout past timeout_s, MemoryError or OSError past the
# memory budget, ValueError for a grammar that cannot be compiled.
Runner = Callable[[StructuredOutputsParams, float], Awaitable[Any]]


class _Lanes:
    """Which compiles run: at most `workers` at once, costly ones on at most `costly_slots` of them; a cheap one
    goes first whenever a worker frees, so a cheap compile waits only behind cheap ones."""

    def __init__(self, workers: int, costly_slots: int) -> None:
        self.workers = workers
        self.costly_slots = costly_slots
        self.running = self.costly_running = 0
        self.waiting: dict[bool, deque[asyncio.Future]] = {False: deque(), True: deque()}

    def _free(self, costly: bool) -> bool:
        return self.running < self.workers and (not costly or self.costly_running < self.costly_slots)

    async def acquire(self, costly: bool) -> None:
        if not self.waiting[False] and not (costly and self.waiting[True]) and self._free(costly):
            self._take(costly)
            return
        turn = asyncio.get_running_loop().create_future()
        self.waiting[costly].append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release(costly)  # given a worker in the same turn it was cancelled: hand it on
            else:
                self.waiting[costly].remove(turn)
            raise

    def _take(self, costly: bool) -> None:
        self.running += 1
        self.costly_running += costly

    def release(self, costly: bool) -> None:
        self.running -= 1
        self.costly_running -= costly
        for kind in (False, True):
            queue = self.waiting[kind]
            while queue and self._free(kind) and (not kind or not self.waiting[False]):
                turn = queue.popleft()
                if not turn.done():
                    self._take(kind)
                    turn.set_result(None)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer off the request path. Use from one event loop."""

    def __init__(self, tokenizer: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES, workers: int = DEFAULT_WORKERS,
                 cache_bytes: int | None = None, observe: Callable[[str], None] | None = None,
                 runner: Runner | None = None, cost: Callable[[StructuredOutputsParams], int] | None = None,
                 max_costly_waiting: int | None = None) -> None:
        """observe(outcome): compiled, timeout, memory or cancelled once per compile; cached, refused or busy
        per request answered without one. runner, cost: a stand-in compile and cost estimate (tests; by default
        the worker processes and grammar_cost). max_costly_waiting: costly grammars that may wait for a worker
        (default twice the workers); one more is a 429."""
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.workers = workers
        self.cache_bytes = memory_bytes if cache_bytes is None else cache_bytes
        self._pool: Any = None
        self._cache: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # key -> (index, pickled size)
        self._kept: dict[str, Any] = {}  # json_object's index: never evicted
        self._failures: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (why it was refused, when)
        self._running: dict[str, asyncio.Task] = {}
        self._waiters: dict[str, int] = {}
        self._lanes = _Lanes(workers, max(1, workers - 1))
        self.max_costly_waiting = 2 * workers if max_costly_waiting is None else max_costly_waiting
        self._runner = runner or self._run_in_pool
        self._cost = cost
        self.counts = dict.fromkeys(("compiled", "cached", "refused", "busy", "timeout", "memory", "cancelled"), 0)
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
        if key in self._kept or key in self._cache:
            if key in self._cache:
                self._cache.move_to_end(key)
            self._observe("cached")
            return structure.with_compiled(self._kept[key] if key in self._kept else self._cache[key][0])
        task = self._running.get(key)
        if task is None:
            costly = await self._is_costly(key, structure)
            task = self._running.get(key)  # another request may have started it meanwhile
            if task is None:
                task = self._start(key, structure, costly)
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

    async def _is_costly(self, key: str, structure: StructuredOutputsParams) -> bool:
        """Whether a grammar goes to the costly lane; GrammarError if it is over MAX_COST (remembered) or the
        costly lane's line is full (not remembered: that is load, not the grammar)."""
        if structure.json_object:
            return False
        cost = self._cost(structure) if self._cost is not None else await asyncio.to_thread(grammar_cost, structure)
        if cost > MAX_COST:
            self._observe("refused")
            raise self._fail(key, f"the grammar is too costly to compile: its automaton would have about {cost:,} "
                             f"states (repeat counts multiplied out), more than the {MAX_COST:,} allowed; lower "
                             "minLength/maxLength, minItems/maxItems or repeat counts such as {1,50}, or use fewer "
                             "such fields")
        costly = cost > CHEAP_COST
        if costly and len(self._lanes.waiting[True]) >= self.max_costly_waiting:
            self._observe("busy")
            raise GrammarError(f"{len(self._lanes.waiting[True])} costly grammars are waiting to be compiled "
                               f"already (this one's automaton would have about {cost:,} states; up to "
                               f"{CHEAP_COST:,} is cheap and never waits behind them); retry later or use a "
                               "smaller grammar", status=429)
        return costly

    def _start(self, key: str, structure: StructuredOutputsParams, costly: bool) -> asyncio.Task:
        task = self._running[key] = asyncio.ensure_future(self._compile(key, structure, costly))
        task.add_done_callback(lambda done: (self._running.pop(key, None),
                                             done.cancelled() or done.exception()))  # retrieved: no log noise
        return task

    async def _compile(self, key: str, structure: StructuredOutputsParams, costly: bool) -> Any:
        try:
            await self._lanes.acquire(costly)
        except asyncio.CancelledError:
            self._observe("cancelled")
            raise
        try:
            index, size = await self._runner(structure, self.timeout_s)
        except asyncio.CancelledError:
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
        finally:
            self._lanes.release(costly)
        self._observe("compiled")
        if structure.json_object:
            self._kept[key] = index
        else:
            self._remember(key, index, size)
        return index

    async def _run_in_pool(self, structure: StructuredOutputsParams, timeout_s: float) -> Any:
        pool = await self._ensure_pool()
        future = pool.schedule(_compile_in_worker, (structure,), timeout=timeout_s)
        try:
            data = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise
        return await asyncio.to_thread(pickle.loads, data), len(data)

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
