"""A step queued on the device whose sampled tokens have not reached the host yet (the overlapped loop).

The tokens stay where they were sampled: the next step reads them there as its input ids. Right behind the
sampling a copy to pinned host memory is queued, and an event marks where that copy lands in the stream.
TokenReadback.wait() is the only way to the values: it waits for that event, which comes before anything
queued later (the next step's forward pass), so reading step N's tokens never waits for step N+1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8cache.engine.scheduler import SchedulerOutput
from fp8cache.engine.sequence import Sequence


class TokenReadback:
    """A device tensor of sampled tokens on its way to the host."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens  # on the device, where the next step reads them
        device = tokens.device
        if device.type == "cpu":  # nothing to copy, nothing to wait for
            self._host, self._landed = tokens, None
            return
        self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=device.type == "cuda")
        self._host.copy_(tokens, non_blocking=True)
        self._landed = landed_event(device)

    def wait(self) -> list[int]:
        """The tokens, once their copy has landed (waits for that copy only, not for later work)."""
        if self._landed is not None:
            self._landed.synchronize()
        return self._host.tolist()


class _StandIn:
    """The event of a device without streams (the tests' stand-in device): copies there complete at once."""

    def synchronize(self) -> None:
        pass


def landed_event(device: torch.device):
    """An event recorded now on `device`'s current stream (CUDA), else a stand-in that is always reached."""
    if device.type != "cuda":
        return _StandIn()
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@dataclass
class InFlightStep:
    number: int  # the engine's step count when it was launched
    plan: SchedulerOutput
    sampled: list[Sequence]  # row i of the step's tokens belongs to sampled[i]
    readback: TokenReadback | None  # None: the step sampled nothing (a prefill chunk short of its prompt's end)
    logits: torch.Tensor | None  # the sampled rows' logits, kept for logprobs (only such steps keep them)
    overlaps: bool  # may stay in flight while the next step is scheduled and launched
    # A verify step (speculative decoding, synchronous): per sampled sequence its emitted tokens and their
    # logprob entries (None each without logprobs), instead of one token a row in readback.
    emitted: list[list[int]] | None = None
    emitted_logprobs: list[list[dict | None]] | None = None
