"""Copying recent-token window ring slots aside and back: the cache side of rolling back rejected drafts.

A verify step writes each draft at its ring slot, over K/V that later steps still read if the draft is
rejected; the engine (engine/window_rollback.py) saves those slots before the step and puts the rejected ones
back after acceptance. With tensor parallelism every rank's ring holds its own heads, so every rank saves the
same slots before the step (the worker ranks find them in the batch, draft_slots) and rank 0 sends the
others a WindowRestore naming the slots and which drafts it kept (model/tp_ranks.py applies it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8cache.model.batch import StepBatch

Saved = list[tuple[torch.Tensor, torch.Tensor]]
WindowCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class WindowRestore:
    """Rank 0 to the other ranks after a verify step's acceptance: the ring slots its drafts overwrote, in
    draft_slots' order, and per slot whether its draft was accepted (False: put the saved K/V back)."""

    slots: list[int]
    keep: list[bool]


def draft_slots(batch: StepBatch) -> list[int]:
    """The ring slots of the batch's drafts (each chunk's last num_draft_tokens fed tokens), in stream order."""
    slots, end = [], 0
    for chunk in batch.seqs:
        end += chunk.query_len
        slots += batch.window_slot_mapping[end - chunk.num_draft_tokens:end]
    return slots


def save_slots(window_caches: WindowCaches, slots: list[int], block_size: int) -> Saved:
    """Copies of K and V at ring slots (block * block_size + offset) of every layer."""
    index = _index(slots, block_size, window_caches[0][0].device)
    return [(k[index[0], :, :, index[1], :].clone(), v[index[0], :, :, index[1]].clone()) for k, v in window_caches]


def restore_slots(window_caches: WindowCaches, slots: list[int], saved: Saved, keep: list[bool],
                  block_size: int) -> None:
    """Put saved K/V back at the slots whose keep flag is False (the rejected drafts' positions)."""
    picked = [i for i, kept in enumerate(keep) if not kept]
    if not picked:
        return
    device = window_caches[0][0].device
    index = _index([slots[i] for i in picked], block_size, device)
    rows = _on_device(picked, device)
    for (k, v), (k_saved, v_saved) in zip(window_caches, saved):
        k[index[0], :, :, index[1], :] = k_saved.index_select(0, rows)
        v[index[0], :, :, index[1]] = v_saved.index_select(0, rows)


def _index(slots: list[int], block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    t = _on_device(slots, device)
    return t // block_size, t % block_size


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A long tensor on `device`, copied from pinned memory without waiting: a verify step saves and restores
    slots around its forward pass, and torch.tensor(..., device=cuda) would wait for the whole stream."""
    host = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return host if device.type == "cpu" else host.to(device, non_blocking=True)
