"""Tolerances the model-level tests share."""

from __future__ import annotations

import torch


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, atol: float | None = None) -> None:
    """float32 agreement: by default 1e-4 plus 1e-5 of the largest |logit| (different matmul splits)."""
    if atol is None:
        atol = 1e-4 + 1e-5 * expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"max abs difference {diff:.3g} > {atol:.3g}"
