"""Tolerances the model-level tests share."""

from __future__ import annotations

import torch


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, atol: float | None = None) -> None:
    """float32 agreement: by default 1e-4 plus 1e-5 of the largest |logit| (different matmul splits)."""
    if atol is None:
        atol = 1e-4 + 1e-5 * expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"max abs difference {diff:.3g} > {atol:.3g}"


def attention_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| over the positions where want is not NaN, relative to the largest |want|
    (at least 1e-3): attention outputs are compared on the scale of the output."""
    ok = ~torch.isnan(want)
    scale = want[ok].float().abs().max().clamp(min=1e-3)
    return float((got[ok].float() - want[ok].float()).abs().max() / scale)
