"""The step channel between rank 0 and the other ranks.

Rank 0 broadcasts each step's batch before computing it; every other rank receives it and runs the same step
on its own slice of the model, so the all_reduces inside the forward pass meet. A None message ends the loop.
A rank may hold several runners on one copy of the weights (the bench's cache dtypes side by side): every
rank builds them in the same order, and each step names its runner by that index.

What a step is and what runs it is the model side's (fp8cache/model/tp_ranks.py builds the runners and runs
a worker rank's loop): a batch is an opaque picklable object here, and a runner one callable.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch.distributed as dist

from fp8cache.distributed import parallel_state

Execute = Callable[[object, bool], object]  # a runner's execute(batch, all_logits)
_STOP = None
_STOP_WAIT_S = 60.0  # how long the stop message waits for a step in flight
_GOODBYE_WAIT_S = 30.0  # how long the ranks wait for each other after the stop message
_step_lock = threading.Lock()  # one collective sequence at a time: a step, or the stop message
_stopped = False
_driver_registered = False
_runner_index = 0  # which of this rank's runners the next step is for (rank 0 sets it, see selected_runner)
steps_sent = 0  # steps rank 0 has broadcast: a failure after the broadcast leaves the workers mid-step


def _broadcast(message: object) -> object:
    state = parallel_state.get()
    box = [message]
    dist.broadcast_object_list(box, src=0, group=state.control_group)
    return box[0]


@contextmanager
def selected_runner(index: int) -> Iterator[None]:
    """Rank 0: steps inside this block are for runner `index` (0, the only one, unless several are built)."""
    global _runner_index
    previous, _runner_index = _runner_index, index
    try:
        yield
    finally:
        _runner_index = previous


@contextmanager
def driver_step(batch: object, all_logits: bool) -> Iterator[None]:
    """Rank 0: send the step to the workers, then compute it (inside the block) while no stop can cut in."""
    global steps_sent
    state = parallel_state.get()
    if not (state.is_parallel and state.is_driver):
        yield
        return
    with _step_lock:
        if _stopped:
            raise RuntimeError("the tensor-parallel workers were stopped; this engine can run no more steps")
        steps_sent += 1
        _broadcast((_runner_index, batch, all_logits))
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
                goodbye()
    finally:
        _step_lock.release()


def goodbye() -> None:
    """Every rank, after the stop message: meet once more, so that no rank leaves the group (and closes its
    connections) while another is still receiving that message. Rank 0 then may end its process at once."""
    dist.monitored_barrier(group=parallel_state.get().control_group,
                           timeout=datetime.timedelta(seconds=_GOODBYE_WAIT_S))


def register_driver() -> None:
    """Rank 0 stops its workers when it exits, whichever way it ends (server, LLM, generate)."""
    global _driver_registered
    if not _driver_registered:
        _driver_registered = True
        atexit.register(stop_workers)


def reset() -> None:
    """After the process group is destroyed: a later group starts with workers not yet stopped."""
    global _stopped, _runner_index
    with _step_lock:
        _stopped, _runner_index = False, 0


def serve_steps(execute: Execute | Sequence[Execute]) -> int:
    """Ranks > 0: run every step rank 0 sends, each on the runner it names, until the stop message; the number
    of steps run. execute: one runner's execute, or every runner's in the order rank 0 built them."""
    executes = list(execute) if isinstance(execute, Sequence) else [execute]
    steps = 0
    while True:
        message = _broadcast(None)
        if message is _STOP:
            goodbye()
            return steps
        index, batch, all_logits = message
        executes[index](batch, all_logits)
        steps += 1

