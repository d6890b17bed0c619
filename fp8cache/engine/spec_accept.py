"""Acceptance of proposed tokens from the target model's distributions at the K + 1 verified positions.

Row j of a sequence's rows predicts the token after draft j (row 0: after its last real token). Greedy:
drafts are accepted while each equals that row's argmax, and the first row that disagrees gives its argmax.
Sampling: the standard rejection rule with a deterministic draft (draft probability 1 for the proposed token):
accept d with probability p(d), else draw from p with d removed and renormalised. Either way one more token
follows the accepted drafts (the correction, or the bonus from the row after the last draft), so every
step emits at least one token, and the emitted tokens are distributed exactly as the target model's.
"""

from __future__ import annotations

import torch


def accept_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
    """The emitted tokens: the drafts that match argmax row by row, then the first disagreeing row's argmax (or
    the bonus row's). argmax has len(drafts) + 1 entries."""
    emitted = []
    for draft, best in zip(drafts, argmax):
        emitted.append(best)
        if draft != best:
            return emitted
    emitted.append(argmax[len(drafts)])
    return emitted


def accept_sampled(drafts: list[int], probs: torch.Tensor, generator: torch.Generator) -> list[int]:
    """probs: [len(drafts) + 1, vocab] float CPU probabilities after the sampling warpers, row by row."""
    emitted = []
    uniforms = torch.rand(len(drafts), dtype=torch.float64, generator=generator).tolist()
    for j, (draft, u) in enumerate(zip(drafts, uniforms)):
        if u < float(probs[j, draft]):
            emitted.append(draft)
            continue
        residual = probs[j].clone()
        residual[draft] = 0
        emitted.append(_draw(residual, generator))
        return emitted
    emitted.append(_draw(probs[len(drafts)], generator))
    return emitted


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(weights.double(), 1, generator=generator))
