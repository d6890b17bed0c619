"""The step channel between rank 0 and the other ranks, and the loop those ranks run.

Rank 0 broadcasts each StepBatch before computing it; every other rank receives it and runs the same step on
its own slice of the model, so the all_reduces inside the forward pass meet. A None message ends the loop.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist

from fp8cache.config import EngineConfig
from fp8cache.distributed import parallel_state
from fp8cache.model.batch import StepBatch

_STOP = None
_STOP_WAIT_S = 60.0  # how long the stop message waits for a step in flight
_step_lock = threading.Lock()  # one collective sequence at a time: a step, or the stop message
_stopped = False


def _broadcast(message: object) -> object:
    state = parallel_state.get()
    box = [message]
    dist.broadcast_object_list(box, src=0, group=state.control_group)
    return box[0]


@contextmanager
def driver_step(batch: StepBatch, all_logits: bool) -> Iterator[None]:
    """Rank 0: send the step to the workers, then compute it (inside the block) while no stop can cut in."""
    state = parallel_state.get()
    if not (state.is_parallel and state.is_driver):
        yield
        return
    with _step_lock:
        if _stopped:
            raise RuntimeError("the tensor-parallel workers were stopped; this engine can run no more steps")
        _broadcast((batch, all_logits))
        yield


def stop_workers() -> None:
    """Rank 0: tell every worker to leave its loop (idempotent; registered at exit)."""
    global _stopped
    state = parallel_state.get()
    if not (state.is_parallel and state.is_driver) or _stopped:
        return
    if not _step_lock.acquire(timeout=_STOP_WAIT_S):
        return  # a step is stuck: the workers will see rank 0's connection close instead
    try:
        # A worker already gone must not turn rank 0's clean exit into a traceback.
        with contextlib.suppress(Exception):
            if not _stopped:
                _stopped = True
                _broadcast(_STOP)
    finally:
        _step_lock.release()


def register_driver() -> None:
    """Rank 0 stops its workers when it exits, whichever way it ends (server, LLM, generate)."""
    atexit.register(stop_workers)


def serve_steps(execute: Callable[[StepBatch, bool], object]) -> int:
    """Ranks > 0: run every step rank 0 sends until the stop message; the number of steps run."""
    steps = 0
    while True:
        message = _broadcast(None)
        if message is _STOP:
            return steps
        batch, all_logits = message
        execute(batch, all_logits)
        steps += 1


def run_worker(config: EngineConfig, log: Callable[[str], None] = print) -> int:
    """A rank > 0 of `fp8kv run --num-shard N`: load this rank's slice, report ready, serve steps; exit code."""
    from fp8cache.model.runner import ModelRunner
    from fp8cache.server.notify import Notifier

    runner = ModelRunner(config, log=log)
    state = parallel_state.get()
    if state.is_driver:
        raise RuntimeError("run_worker is for ranks > 0; rank 0 runs the engine")
    # A stop signal now waits for rank 0's stop message: rank 0 drains its requests first, and those need
    # this rank's share of every step. (The launcher sends SIGKILL if that takes too long.)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: log(f"{signal.Signals(s).name} received: stopping when rank 0 does"))
    Notifier().ready(f"tensor-parallel rank {state.rank} of {state.world_size} ready")
    log(f"rank {state.rank} of {state.world_size} ready")
    steps = serve_steps(runner.execute)
    log(f"rank {state.rank}: stopped by rank 0 after {steps} steps")
    parallel_state.destroy()
    return 0
