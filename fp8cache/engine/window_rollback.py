"""Rolling back the recent-token window ring after rejected speculative tokens.

A verify step writes every fed position p to its sequence's ring slot p % window, over the K/V of position
p - window, which later steps still read until position p is really computed. So before such a step the
slots its draft positions will overwrite are copied aside, and after acceptance the slots of rejected drafts
get their old K/V back. Drafts are capped below the window size, so no two fed positions share a slot.
"""

from __future__ import annotations

import torch

Saved = list[tuple[torch.Tensor, torch.Tensor]]


def save_slots(window_caches: list[tuple[torch.Tensor, torch.Tensor]], slots: list[int], block_size: int) -> Saved:
    """Copies of K and V at ring slots (block * block_size + offset) of every layer."""
    index = _index(slots, block_size, window_caches[0][0].device)
    return [(k[index[0], :, :, index[1], :].clone(), v[index[0], :, :, index[1]].clone()) for k, v in window_caches]


def restore_slots(window_caches: list[tuple[torch.Tensor, torch.Tensor]], slots: list[int], saved: Saved,
                  keep: list[bool], block_size: int) -> None:
    """Put saved K/V back at the slots whose keep flag is False (the rejected drafts' positions)."""
    picked = [i for i, kept in enumerate(keep) if not kept]
    if not picked:
        return
    device = window_caches[0][0].device
    index = _index([slots[i] for i in picked], block_size, device)
    rows = torch.tensor(picked, dtype=torch.long, device=device)
    for (k, v), (k_saved, v_saved) in zip(window_caches, saved):
        k[index[0], :, :, index[1], :] = k_saved.index_select(0, rows)
        v[index[0], :, :, index[1]] = v_saved.index_select(0, rows)


def _index(slots: list[int], block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(slots, dtype=torch.long, device=device)
    return t // block_size, t % block_size
