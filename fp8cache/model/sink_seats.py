"""The attention sinks' seats of a sequence that took a prefix-cache hit.

With kv_recent_window_sinks S > 0 the window ring of every sequence holds its first S positions in the window's
dtype, and attention reads them from there (docs/design.md section 10). A sequence computes them itself, and the
step that does writes them to their seats (its window_slot_mapping). A sequence whose first blocks came from the
prefix cache never computed them: those blocks hold FP8 K/V only. So the step that computes its first own
position fills the sink seats of the cached positions with their K/V dequantized from the FP8 cache, before any
layer reads them: the values attention reads there without sinks, so nothing is lost against S = 0.
"""

from __future__ import annotations

import torch

from fp8cache.kvcache import formats
from fp8cache.kvcache.spec import KVCacheSpec
from fp8cache.model.batch import StepBatch, window_slot

Caches = list[tuple[torch.Tensor, torch.Tensor]]


def sink_fills(batch: StepBatch, spec: KVCacheSpec) -> tuple[list[int], list[int]]:
    """(paged cache slots, window ring slots) of the cached sinks [0, min(S, window_floor)) of every chunk that
    is the first its sequence computes after a prefix-cache hit; empty lists when there is none."""
    sinks, bs = spec.window_sinks, spec.block_size
    paged, ring = [], []
    if not sinks:
        return paged, ring
    for chunk in batch.seqs:
        floor = chunk.window_floor
        if floor <= 0 or chunk.context_len - chunk.query_len != floor:
            continue
        for p in range(min(sinks, floor)):
            paged.append(chunk.block_table[p // bs] * bs + p % bs)
            ring.append(window_slot(chunk.window_block_table, p, spec.window_size, bs, sinks))
    return paged, ring


def fill_sink_seats(spec: KVCacheSpec, kv_caches: Caches, scale_caches: Caches | None, window_caches: Caches,
                    paged: list[int], ring: list[int]) -> None:
    """Every layer's K/V at the paged cache's slots `paged`, dequantized, written to the ring's slots `ring`."""
    if not paged:
        return
    device = window_caches[0][0].device
    src, dst = (torch.tensor(slots, dtype=torch.long, device=device) for slots in (paged, ring))
    bs = spec.block_size
    blocks, offsets, ring_blocks, ring_offsets = src // bs, src % bs, dst // bs, dst % bs
    backend = formats.backend_of(device)
    for layer, ((key_cache, value_cache), (ring_k, ring_v)) in enumerate(zip(kv_caches, window_caches)):
        k = key_cache[blocks, :, :, offsets, :].reshape(len(paged), spec.num_kv_heads, spec.head_size)
        v = value_cache[blocks, :, :, offsets]
        fmt = formats.get_format(spec.layer_formats[layer], backend)
        if fmt is not None:
            scales = scale_caches[layer] if scale_caches is not None else ()
            if scales:  # dynamic: one bfloat16 scale per token and head at the same slot
                k_scale, v_scale = (c[blocks, :, offsets].float()[..., None] for c in scales)
            else:
                k_scale, v_scale = (t.float().reshape(1, -1, 1) for t in (spec.k_scales[layer], spec.v_scales[layer]))
            k = k.view(fmt.torch_dtype).float() * k_scale
            v = v.view(fmt.torch_dtype).float() * v_scale
        ring_k[ring_blocks, :, :, ring_offsets, :] = k.reshape(len(paged), *ring_k.shape[1:3], ring_k.shape[4]).to(
            ring_k.dtype)
        ring_v[ring_blocks, :, :, ring_offsets] = v.to(ring_v.dtype)
