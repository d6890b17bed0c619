"""Dynamic KV scales (issue 54, docs/design.md "Dynamic KV scales"): one scale per token and KV head, computed when
the token is written to the cache and stored beside its FP8 codes, so no calibration is ever needed.

A scale is amax(|x|) / fmt.max rounded UP to a bfloat16: the largest element of the head vector never clips and
is stored within 2^-7 of the format's largest value, which keeps it (often an outlier channel, which dominates
q.k) nearly exact. A bfloat16 is the upper half of a float32, so kernels read a scale with one shift. Scales are
kept normal and finite, [2^-126, the largest bfloat16]: an all-zero head vector gets 2^-126, an infinite one the
largest (its values saturate, as with a static scale). NaN elements are left out of the maximum and stay NaN.
A power-of-two scale (an 8-bit exponent, 1 byte) was measured first and gave 5-15% more KL.

Layout: per layer, for K and for V, a bfloat16 tensor [num_blocks, num_kv_heads, block_size], indexed by the same
slot as the codes (slot = block * block_size + offset), so block tables, prefix caching and the recent window's
handover need nothing new. 2 bytes per head per token each for K and V: 2 / head_size of the FP8 cache, 3.1%
at head size 64.
"""

from __future__ import annotations

import torch

STATIC = "static"
DYNAMIC = "dynamic"
KV_SCALES = (STATIC, DYNAMIC)

SCALE_DTYPE = torch.bfloat16
MIN_SCALE_BITS, MAX_SCALE_BITS = 0x0080, 0x7F7F  # 2^-126 and the largest finite bfloat16


def check_kv_scales(kv_scales: str) -> str:
    """kv_scales as given, or a ValueError naming the choices."""
    if kv_scales not in KV_SCALES:
        raise ValueError(f"kv_scales={kv_scales!r} is not one of {', '.join(KV_SCALES)}: 'static' uses per-tensor or "
                         "per-head scales (file, checkpoint, --calculate-kv-scales or 1.0), 'dynamic' computes a "
                         "scale per token and KV head as the cache is written")
    return kv_scales


def scales_of(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """bfloat16 scales: float32 amax / fmt_max rounded up to a bfloat16 (amax >= 0, NaN-free), clamped to
    [2^-126, the largest bfloat16]. Bit for bit what the compiled cache write stores (csrc/common/dynamic_scale.h)."""
    exact = amax.to(torch.float32) / torch.tensor(fmt_max, dtype=torch.float32)
    bits = (exact.view(torch.int32).to(torch.int64) + 0xFFFF) >> 16  # a bit below bfloat16's mantissa carries
    return bits.clamp(MIN_SCALE_BITS, MAX_SCALE_BITS).to(torch.int16).view(SCALE_DTYPE)


def token_head_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dim, NaN left out: [tokens, heads, d] -> float32 [tokens, heads]."""
    a = x.to(torch.float32).abs()
    return torch.where(torch.isnan(a), 0.0, a).amax(-1)


def allocate_scale_caches(num_blocks: int, block_size: int, num_kv_heads: int,
                          device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale_cache, v_scale_cache) of one layer, bfloat16 [num_blocks, num_kv_heads, block_size], zero."""
    shape = (num_blocks, num_kv_heads, block_size)
    return (torch.zeros(shape, dtype=SCALE_DTYPE, device=device),
            torch.zeros(shape, dtype=SCALE_DTYPE, device=device))


def bytes_per_token(num_layers: int, num_kv_heads: int) -> int:
    """Bytes the scales add per cached token: a bfloat16 per KV head for K and one for V, every layer."""
    return 2 * num_layers * num_kv_heads * 2
