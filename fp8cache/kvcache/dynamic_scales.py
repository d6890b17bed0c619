"""Dynamic KV scales (issue 54, docs/design.md "Dynamic KV scales"): one scale per token and KV head, computed
when the token is written to the cache and stored beside its FP8 codes, so no calibration is ever needed.

A scale is a power of two, stored as its 8-bit exponent (E8M0, as in the OCP MX formats): code c means
2^(c - 127). The writer picks the smallest power of two s with amax(|x|) <= fmt.max * s, so the largest
element of the head vector never clips, and a power of two changes no code's relative precision. Codes are
kept in [1, 254] (normal float32 powers of two: a kernel builds the float from the code's bits); an all-zero or
tiny vector gets code 1, an infinite one 254 (its values saturate as with a static scale). NaN elements are
left out of the maximum and stay NaN.

Layout: per layer, for K and for V, a uint8 tensor [num_blocks, num_kv_heads, block_size], indexed by the
same slot as the codes (slot = block * block_size + offset), so block tables, prefix caching and the recent
window's handover need nothing new. 1 byte per head per token each for K and V: 2 / (2 * head_size) of the
FP8 cache, 1.6% at head size 64.
"""

from __future__ import annotations

import torch

STATIC = "static"
DYNAMIC = "dynamic"
KV_SCALES = (STATIC, DYNAMIC)

SCALE_DTYPE = torch.uint8  # E8M0 exponent codes
EXPONENT_BIAS = 127
MIN_CODE, MAX_CODE = 1, 254


def check_kv_scales(kv_scales: str) -> str:
    """kv_scales as given, or a ValueError naming the choices."""
    if kv_scales not in KV_SCALES:
        raise ValueError(f"kv_scales={kv_scales!r} is not one of {', '.join(KV_SCALES)}: 'static' uses per-tensor or "
                         "per-head scales (file, checkpoint, --calculate-kv-scales or 1.0), 'dynamic' computes a "
                         "scale per token and KV head as the cache is written")
    return kv_scales


def scale_codes(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """uint8 E8M0 codes of the smallest powers of two s with amax <= fmt_max * s (amax >= 0, NaN-free),
    clamped to [MIN_CODE, MAX_CODE]. Exact: the comparisons run in float64, where both sides are exact."""
    a = amax.to(torch.float64)
    e = torch.ceil(torch.log2(a / fmt_max)).clamp(-EXPONENT_BIAS, EXPONENT_BIAS + 1)
    e = torch.where(a <= fmt_max * torch.exp2(e - 1), e - 1, e)  # log2 rounded up one too far
    e = torch.where(a > fmt_max * torch.exp2(e), e + 1, e)  # or not far enough
    return (e + EXPONENT_BIAS).clamp(MIN_CODE, MAX_CODE).to(SCALE_DTYPE)


def code_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 2^(code - 127) of uint8 E8M0 codes."""
    return torch.exp2(codes.to(torch.float32) - EXPONENT_BIAS)


def token_head_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dim, NaN left out: [tokens, heads, d] -> float32 [tokens, heads]."""
    a = x.to(torch.float32).abs()
    return torch.where(torch.isnan(a), 0.0, a).amax(-1)


def allocate_scale_caches(num_blocks: int, block_size: int, num_kv_heads: int,
                          device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale_cache, v_scale_cache) of one layer, uint8 [num_blocks, num_kv_heads, block_size]."""
    shape = (num_blocks, num_kv_heads, block_size)
    return (torch.zeros(shape, dtype=SCALE_DTYPE, device=device),
            torch.zeros(shape, dtype=SCALE_DTYPE, device=device))


def bytes_per_token(num_layers: int, num_kv_heads: int) -> int:
    """Bytes the scales add per cached token: one code per KV head for K and one for V, every layer."""
    return 2 * num_layers * num_kv_heads
