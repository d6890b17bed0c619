"""Pure-torch reference of every compiled op: slow, obvious, and built on torch's own float8 dtypes.

Tests hold the compiled kernels to these. Layouts are DESIGN section 4 (vLLM's paged layouts).
"""

from __future__ import annotations

import torch

from fp8cache import formats


def cache_x(cache_dtype: torch.dtype) -> int:
    """Elements per 16-byte chunk of the key cache's innermost dimension."""
    return 16 // torch.empty((), dtype=cache_dtype).element_size()


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                      kv_cache_dtype: str, model_dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    backend = formats.backend_of(device)
    storage = formats.cache_storage_dtype(kv_cache_dtype, model_dtype, backend)
    x = cache_x(storage)
    if head_size % x:
        raise ValueError(f"head_size {head_size} must be a multiple of {x} for this cache dtype")
    key_cache = torch.zeros(num_blocks, num_kv_heads, head_size // x, block_size, x, dtype=storage,
                            device=device)
    value_cache = torch.zeros(num_blocks, num_kv_heads, head_size, block_size, dtype=storage,
                              device=device)
    return key_cache, value_cache


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: formats.Fp8Format) -> torch.Tensor:
    """x [tokens, heads, d] -> uint8 codes: clamp(x / s, -max, max).to(float8), s per tensor or per head."""
    s = scale.to(torch.float32).reshape(1, -1, 1)
    q = torch.clamp(x.to(torch.float32) / s, -fmt.max, fmt.max).to(fmt.torch_dtype)
    return q.view(torch.uint8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt: formats.Fp8Format,
               head_dim: int) -> torch.Tensor:
    """uint8 codes -> float32 values times the scale broadcast along `head_dim`."""
    shape = [1] * codes.dim()
    shape[head_dim] = -1
    return codes.view(fmt.torch_dtype).to(torch.float32) * scale.to(torch.float32).reshape(shape)


def _check_slots(slot_mapping: torch.Tensor, num_slots: int) -> torch.Tensor:
    valid = slot_mapping >= 0
    if bool((slot_mapping[valid] >= num_slots).any()):
        raise IndexError(f"slot_mapping holds a slot >= {num_slots} (num_blocks * block_size)")
    return valid


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
                      k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    num_blocks, num_kv_heads, _, block_size, x = key_cache.shape
    head_size = value_cache.shape[2]
    valid = _check_slots(slot_mapping, num_blocks * block_size)
    slots = slot_mapping[valid].long()
    key, value = key[valid], value[valid]
    fmt = formats.get_format(kv_cache_dtype, formats.backend_of(key_cache.device))
    if fmt is None:
        k_store, v_store = key.to(key_cache.dtype), value.to(value_cache.dtype)
    else:
        k_store, v_store = quantize(key, k_scale, fmt), quantize(value, v_scale, fmt)
    blocks, offsets = slots // block_size, slots % block_size
    # key_cache[b, h, d // x, off, d % x] = k[t, h, d]
    k_view = k_store.reshape(-1, num_kv_heads, head_size // x, x)
    key_cache[blocks, :, :, offsets, :] = k_view
    value_cache[blocks, :, :, offsets] = v_store


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
              seq_len: int, kv_cache_dtype: str, k_scale: torch.Tensor,
              v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions [0, seq_len) of one sequence, dequantized to float32 [seq_len, heads, d]."""
    num_blocks, num_kv_heads, _, block_size, _ = key_cache.shape
    head_size = value_cache.shape[2]
    n_blocks = (seq_len + block_size - 1) // block_size
    ids = block_table[:n_blocks].long()
    if n_blocks and (bool((ids < 0).any()) or bool((ids >= num_blocks).any())):
        raise IndexError(f"block table holds a block id outside [0, {num_blocks})")
    k = key_cache[ids]  # [n, h, d/x, bs, x]
    k = k.permute(0, 3, 1, 2, 4).reshape(n_blocks * block_size, num_kv_heads, head_size)[:seq_len]
    v = value_cache[ids].permute(0, 3, 1, 2).reshape(n_blocks * block_size, num_kv_heads, head_size)
    v = v[:seq_len]
    fmt = formats.get_format(kv_cache_dtype, formats.backend_of(key_cache.device))
    if fmt is None:
        return k.to(torch.float32), v.to(torch.float32)
    return dequantize(k, k_scale, fmt, head_dim=1), dequantize(v, v_scale, fmt, head_dim=1)


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, num_kv_heads: int, scale: float,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    max_seq_len: int, alibi_slopes: torch.Tensor | None, kv_cache_dtype: str,
                    k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Decode attention: each query row attends to positions [0, seq_len) of its sequence."""
    num_seqs, num_heads, _ = query.shape
    group = num_heads // num_kv_heads
    for i in range(num_seqs):
        seq_len = int(seq_lens[i])
        if seq_len == 0:
            out[i] = 0
            continue
        k, v = gather_kv(key_cache, value_cache, block_tables[i], seq_len, kv_cache_dtype,
                         k_scale, v_scale)
        k = k.repeat_interleave(group, dim=1)  # [T, heads, d]
        v = v.repeat_interleave(group, dim=1)
        q = query[i].to(torch.float32)  # [heads, d]
        logits = torch.einsum("hd,thd->ht", q, k) * scale
        if alibi_slopes is not None:
            pos = torch.arange(seq_len, dtype=torch.float32, device=q.device)
            logits = logits + alibi_slopes.to(torch.float32)[:, None] * (pos - (seq_len - 1))[None]
        probs = torch.softmax(logits, dim=-1)
        out[i] = torch.einsum("ht,thd->hd", probs, v).to(out.dtype)
