"""The paged cache layouts (vLLM's, so tools and tests written for its kernels carry over) and their
allocation:

    key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x],  x = 16 // element_size
    value_cache [num_blocks, num_kv_heads, head_size, block_size]

FP8 caches hold uint8 codes; an `auto` cache holds the model dtype.
"""

from __future__ import annotations

import torch

from fp8cache.kvcache import formats


def cache_x(cache_dtype: torch.dtype) -> int:
    """Elements per 16-byte chunk of the key cache's innermost dimension."""
    return 16 // torch.empty((), dtype=cache_dtype).element_size()


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                      kv_cache_dtype: str, model_dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache), zero. On the CPU the pages are not touched until a block is written: a large
    budget costs neither start-up time nor resident memory before it is used."""
    backend = formats.backend_of(device)
    storage = formats.cache_storage_dtype(kv_cache_dtype, model_dtype, backend)
    x = cache_x(storage)
    if head_size % x:
        raise ValueError(f"head_size {head_size} must be a multiple of {x} for this cache dtype")
    key_shape = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    value_shape = (num_blocks, num_kv_heads, head_size, block_size)
    if torch.device(device).type == "cpu":  # blocks are read scattered: huge pages spare the TLB
        # Imported here: fp8cache.ops imports this module, so a top-level import would be a cycle.
        from fp8cache.platform import huge_pages

        return huge_pages.zeros(key_shape, storage), huge_pages.zeros(value_shape, storage)
    return (torch.zeros(key_shape, dtype=storage, device=device),
            torch.zeros(value_shape, dtype=storage, device=device))


def gather_window_at(window_key_cache: torch.Tensor, window_value_cache: torch.Tensor,
                     index: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of an auto-layout cache (the recent-token window ring) at slots (blocks, offsets), float32
    [n, kv_heads, head_size]."""
    num_kv_heads, head_size = window_key_cache.shape[1], window_value_cache.shape[2]
    blocks, offsets = index
    k = window_key_cache[blocks, :, :, offsets, :].reshape(-1, num_kv_heads, head_size)
    v = window_value_cache[blocks, :, :, offsets]
    return k.to(torch.float32), v.to(torch.float32)
