"""Python face of the compiled ops (torch.ops.fp8kv.*), plus `reference`, a pure-torch twin of each.

The C++ library is compiled for this machine on first use and cached on disk (see `_build`).
"""

from __future__ import annotations

import torch

from fp8cache.ops import reference
from fp8cache.ops.reference import allocate_kv_cache

__all__ = ["allocate_kv_cache", "paged_attention", "reference", "reshape_and_cache", "load"]


def load() -> object:
    """Compile (once per source hash) and load the op library; returns torch.ops.fp8kv."""
    from fp8cache.ops import _build

    _build.load_library()
    return torch.ops.fp8kv


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
                      k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    load().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                             k_scale, v_scale)


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, num_kv_heads: int, scale: float,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    max_seq_len: int, alibi_slopes: torch.Tensor | None, kv_cache_dtype: str,
                    k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    load().paged_attention(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                           seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype,
                           k_scale, v_scale)
