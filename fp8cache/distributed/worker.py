"""The step channel between rank 0 and the other ranks.

Rank 0 broadcasts each step's batch before computing it; every other rank receives it and runs the same step
on its own slice of the model, so the all_reduces inside the forward pass meet. A None message ends the loop.
A rank may hold several runners on one copy of the weights (the bench's cache dtypes side by side): every
rank builds them in the same order, and each step names its runner by that index.

What a step is and what runs it is the model side's (fp8cache/model/tp_ranks.py builds the runners and runs
a worker rank's loop): a batch is an opaque picklable object here, and a runner one callable. After a step
rank 0 may send a follow-up for the same runner, another opaque object that runner's callable gets in the
same way: what rank 0 changed in its own cache after the step, which every rank must change alike (the
recent window's repair after a speculative verify step).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from fp8cache.distributed import parallel_state

Execute = Callable[[object, bool], object]  # a runner's execute(batch, all_logits)
_STOP = None
_STOP_WAIT_S = 60.0  # how long the stop message waits for a step in flight
_GOODBYE_WAIT_S = 30.0  # how long the ranks wait for each other after the stop message
_step_lock = threading.Lock()  # one collective sequence at a time: a step, or the stop message
_stopped = False
_driver_registered = False


@dataclass
class StepTicket:
    """Rank 0's record of one step it hands to a runner: which of this rank's runners it is for, and whether it
    reached the workers (a failure after the broadcast leaves them mid-step)."""

    runner_index: int = 0
    sent: bool = False


_ticket = StepTicket()  # the step now being run on rank 0 (selected_runner replaces it for its block)
_last_runner_index = 0  # the runner of the step rank 0 sent last: a follow-up is for it


def _broadcast(message: object) -> object:
    state = parallel_state.get()
    box = [message]
    dist.broadcast_object_list(box, src=0, group=state.control_group)
    return box[0]


@contextmanager
def selected_runner(ticket: StepTicket) -> Iterator[StepTicket]:
    """Rank 0: the step inside this block is for runner ticket.runner_index (0, the only one, unless several
    are built); ticket.sent says afterwards whether it was broadcast."""
    global _ticket
    previous, _ticket = _ticket, ticket
    try:
        yield ticket
    finally:
        _ticket = previous


@contextmanager
def driver_step(batch: object, all_logits: bool) -> Iterator[None]:
    """Rank 0: send the step to the workers, then compute it (inside the block) while no stop can cut in."""
    global _last_runner_index
    state = parallel_state.get()
    if not (state.is_parallel and state.is_driver):
        yield
        return
    with _step_lock:
        if _stopped:
            raise RuntimeError("the tensor-parallel workers were stopped; this engine can run no more steps")
        _ticket.sent = True
        _last_runner_index = _ticket.runner_index
        _broadcast((_ticket.runner_index, batch, all_logits))
        yield


def send_follow_up(message: object) -> None:
    """Rank 0: send the workers a message for the runner of the step just sent (each gets it as that runner's
    next "batch"); nothing without tensor parallelism."""
    state = parallel_state.get()
    if not (state.is_parallel and state.is_driver):
        return
    with _step_lock:
        if _stopped:
            raise RuntimeError("the tensor-parallel workers were stopped; this engine can run no more steps")
        _broadcast((_last_runner_index, message, False))


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
    global _stopped, _ticket, _last_runner_index
    with _step_lock:
        _stopped, _ticket, _last_runner_index = False, StepTicket(), 0


def serve_steps(execute: Execute | Sequence[Execute]) -> int:
    """Ranks > 0: run every step (and follow-up) rank 0 sends, each on the runner it names, until the stop
        message; the number of messages run. execute: one runner's execute, or every runner's in the order rank 0
    built them."""
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

