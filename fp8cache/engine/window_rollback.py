"""Rolling back the recent-token window ring after rejected speculative tokens.

A verify step writes every fed position p to its sequence's ring seat (S + p % window; an attention sink's own
seat p when p < S, model/batch.py window_slot), over the K/V of position p - window, which later steps still read
until position p is really computed. So before such a step the slots its draft positions will overwrite are
copied aside, and after acceptance the slots of rejected drafts get their old K/V back (a sink seat holds nothing
read before its position is computed, so restoring it is harmless). Drafts are capped below the window size, so
no two fed positions share a slot.

With tensor parallelism each rank's ring holds its own heads: the worker ranks save the same slots before
the step themselves, and the restore is sent to them right after rank 0 applies it (model/window_slots.py).
"""

from __future__ import annotations

from fp8cache.distributed import worker as step_channel
from fp8cache.model import window_slots
from fp8cache.model.window_slots import Saved, WindowCaches, save_slots

__all__ = ["Saved", "restore_slots", "save_slots"]


def restore_slots(window_caches: WindowCaches, slots: list[int], saved: Saved, keep: list[bool],
                  block_size: int) -> None:
    """Put saved K/V back at the slots whose keep flag is False (the rejected drafts' positions), on this rank
    and, with tensor parallelism, on every other rank (which saved the same slots before the step)."""
    if all(keep):
        return
    window_slots.restore_slots(window_caches, slots, saved, keep, block_size)
    step_channel.send_follow_up(window_slots.WindowRestore(list(slots), list(keep)))
