"""Pure-torch reference of every compiled op: slow, obvious, and built on torch's own float8 dtypes.

Tests hold the compiled kernels to these. Layouts are docs/design.md section 4 (vLLM's paged layouts).
"""

from __future__ import annotations

import torch

from fp8cache.kvcache import dynamic_scales, formats
from fp8cache.kvcache.layout import allocate_kv_cache, cache_x, gather_window_at  # noqa: F401 (tests use them too)


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


def quantize_dynamic(x: torch.Tensor, fmt: formats.Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, heads, d] -> (uint8 codes, bfloat16 scales [tokens, heads]): each token and head's own scale,
    its largest |x| over the format's max rounded up (kvcache.dynamic_scales)."""
    scales = dynamic_scales.scales_of(dynamic_scales.token_head_amax(x), fmt.max)
    # times the float32 reciprocal, not divided: what the kernels compute (a multiply costs less than a divide)
    inverse = 1.0 / scales.float()[..., None]
    q = torch.clamp(x.to(torch.float32) * inverse, -fmt.max, fmt.max).to(fmt.torch_dtype)
    return q.view(torch.uint8), scales


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str | int,
                      k_scale: torch.Tensor, v_scale: torch.Tensor, k_scale_cache: torch.Tensor | None = None,
                      v_scale_cache: torch.Tensor | None = None) -> None:
    """k_scale_cache / v_scale_cache bfloat16 [num_blocks, kv_heads, block_size] (FP8 caches): dynamic scales, computed
    per token and head and stored at each token's slot; k_scale and v_scale are then not used."""
    num_blocks, num_kv_heads, _, block_size, x = key_cache.shape
    head_size = value_cache.shape[2]
    valid = _check_slots(slot_mapping, num_blocks * block_size)
    slots = slot_mapping[valid].long()
    key, value = key[valid], value[valid]
    fmt = formats.get_format(kv_cache_dtype, formats.backend_of(key_cache.device))
    blocks, offsets = slots // block_size, slots % block_size
    if fmt is None:
        k_store, v_store = key.to(key_cache.dtype), value.to(value_cache.dtype)
    elif k_scale_cache is not None:
        (k_store, k_codes), (v_store, v_codes) = quantize_dynamic(key, fmt), quantize_dynamic(value, fmt)
        k_scale_cache[blocks, :, offsets] = k_codes
        v_scale_cache[blocks, :, offsets] = v_codes
    else:
        k_store, v_store = quantize(key, k_scale, fmt), quantize(value, v_scale, fmt)
    # key_cache[b, h, d // x, off, d % x] = k[t, h, d]
    k_view = k_store.reshape(-1, num_kv_heads, head_size // x, x)
    key_cache[blocks, :, :, offsets, :] = k_view
    value_cache[blocks, :, :, offsets] = v_store


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
              seq_len: int, kv_cache_dtype: str | int, k_scale: torch.Tensor,
              v_scale: torch.Tensor, start: int = 0, k_scale_cache: torch.Tensor | None = None,
              v_scale_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions [start, seq_len) of one sequence, dequantized to float32 [seq_len - start, heads,
    d]. Only the blocks holding those positions are read (a sliding window's older blocks may be gone)."""
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[3]
    first = start // block_size
    n_blocks = (seq_len + block_size - 1) // block_size - first
    ids = block_table[first:first + n_blocks].long()
    if n_blocks > 0 and (bool((ids < 0).any()) or bool((ids >= num_blocks).any())):
        raise IndexError(f"block table holds a block id outside [0, {num_blocks})")
    if n_blocks <= 0:
        empty = torch.zeros(0, key_cache.shape[1], value_cache.shape[2], device=key_cache.device)
        return empty, empty.clone()
    k, v = gather_kv_blocks(key_cache, value_cache, ids[None], seq_len - first * block_size, kv_cache_dtype,
                            k_scale, v_scale, k_scale_cache, v_scale_cache)
    skip = start - first * block_size
    return k[0].transpose(0, 1)[skip:], v[0].transpose(0, 1)[skip:]


def gather_kv_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int,
                     kv_cache_dtype: str | int, k_scale: torch.Tensor,
                     v_scale: torch.Tensor, k_scale_cache: torch.Tensor | None = None,
                     v_scale_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_kv for n sequences at once, head-major: float32 [n, heads, seq_len, d], the same values.

    block_ids: int64 [n, blocks], each row a sequence's first blocks (covering seq_len), all in the cache.
    k_scale_cache / v_scale_cache: dynamic scales (see reshape_and_cache), used instead of k_scale / v_scale.
    """
    n, n_blocks = block_ids.shape
    _, num_kv_heads, _, block_size, x = key_cache.shape
    head_size = value_cache.shape[2]
    ids = block_ids.reshape(-1)
    k = key_cache[ids].view(n, n_blocks, num_kv_heads, head_size // x, block_size, x)
    k = k.permute(0, 2, 1, 4, 3, 5).reshape(n, num_kv_heads, n_blocks * block_size, head_size)[:, :, :seq_len]
    v = value_cache[ids].view(n, n_blocks, num_kv_heads, head_size, block_size)
    v = v.permute(0, 2, 1, 4, 3).reshape(n, num_kv_heads, n_blocks * block_size, head_size)[:, :, :seq_len]
    fmt = formats.get_format(kv_cache_dtype, formats.backend_of(key_cache.device))
    if fmt is None:
        return k.to(torch.float32), v.to(torch.float32)
    if k_scale_cache is not None:
        def token_scales(cache: torch.Tensor) -> torch.Tensor:  # [n, heads, seq_len, 1]
            scales = cache[ids].view(n, n_blocks, num_kv_heads, block_size).permute(0, 2, 1, 3)
            return scales.reshape(n, num_kv_heads, -1)[:, :, :seq_len].float()[..., None]

        one = torch.ones(1)
        return (dequantize(k, one, fmt, head_dim=1) * token_scales(k_scale_cache),
                dequantize(v, one, fmt, head_dim=1) * token_scales(v_scale_cache))
    return dequantize(k, k_scale, fmt, head_dim=1), dequantize(v, v_scale, fmt, head_dim=1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, alibi_slopes: torch.Tensor | None,
           first_pos: int = 0, logit_softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query row per head, the newest position's, against positions [first_pos, first_pos + T) of its
    sequence: q [heads, d], k and v [T, heads, d], float32; returns [heads, d].

    - logit_softcap c > 0 (Gemma 2): a logit l (scaled, ALiBi included) becomes c * tanh(l / c);
    - sinks [heads] (gpt-oss): one more logit per head in the softmax's denominator, with no value, as
      transformers' gpt-oss concatenates them to the scores and drops their column after the softmax.
    """
    newest = first_pos + k.shape[0] - 1
    logits = torch.einsum("hd,thd->ht", q, k) * scale
    if alibi_slopes is not None:
        pos = torch.arange(first_pos, newest + 1, dtype=torch.float32, device=q.device)
        logits = logits + alibi_slopes.to(torch.float32)[:, None] * (pos - newest)[None]
    if logit_softcap > 0:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    if sinks is not None:
        logits = torch.cat([logits, sinks.to(torch.float32).to(q.device)[:, None]], dim=-1)
    probs = torch.softmax(logits, dim=-1)[:, :k.shape[0]]
    return torch.einsum("ht,thd->hd", probs, v)


def window_first(seq_len: int, sliding_window: int) -> int:
    """The oldest position a query at seq_len - 1 attends to: 0, or seq_len - W with a sliding window of W
    (transformers' sliding-window mask: key j counts for query i when i - j < W)."""
    return max(0, seq_len - sliding_window) if sliding_window > 0 else 0


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, num_kv_heads: int, scale: float,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    max_seq_len: int, alibi_slopes: torch.Tensor | None, kv_cache_dtype: str | int,
                    k_scale: torch.Tensor, v_scale: torch.Tensor, sliding_window: int = 0,
                    logit_softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    k_scale_cache: torch.Tensor | None = None, v_scale_cache: torch.Tensor | None = None) -> None:
    """Decode attention: each query row attends to positions [0, seq_len) of its sequence, the newest
    sliding_window of them when that is > 0; see attend for logit_softcap and sinks, reshape_and_cache for the
    scale caches."""
    num_seqs, num_heads, _ = query.shape
    group = num_heads // num_kv_heads
    for i in range(num_seqs):
        seq_len = int(seq_lens[i])
        if seq_len == 0:
            out[i] = 0
            continue
        first = window_first(seq_len, sliding_window)
        k, v = gather_kv(key_cache, value_cache, block_tables[i], seq_len, kv_cache_dtype, k_scale, v_scale, first,
                         k_scale_cache, v_scale_cache)
        k = k.repeat_interleave(group, dim=1)  # [T, heads, d]
        v = v.repeat_interleave(group, dim=1)
        out[i] = attend(query[i].to(torch.float32), k, v, scale, alibi_slopes, first, logit_softcap,
                        sinks).to(out.dtype)


# ---- recent-token window (issue 8) ------------------------------------------------------------------
# The newest tokens of a sequence also live in a small "window" cache in the model dtype (auto layout of
# docs/design.md section 4), as a ring: position p sits at ring slot p % window_size, and ring slot r at
# window_block_table[r // block_size] * block_size + r % block_size. Attention reads positions
# [0, window_start) from the FP8 cache and [window_start, seq_len) from the window.


def window_slots(window_block_table: torch.Tensor | list[int], positions: torch.Tensor, window_size: int,
                 block_size: int, window_sinks: int = 0) -> torch.Tensor:
    """Window-cache slots (int64) of `positions` for one sequence's window block table: the attention sinks
    (positions below window_sinks) have seats of their own, then the ring of window_size seats."""
    table = torch.as_tensor(window_block_table, dtype=torch.long)
    positions = positions.long()
    ring = torch.where(positions < window_sinks, positions, window_sinks + positions % window_size)
    return table[ring // block_size] * block_size + ring % block_size


def gather_window_kv(window_key_cache: torch.Tensor, window_value_cache: torch.Tensor,
                     window_block_table: torch.Tensor, start: int, end: int,
                     window_size: int, window_sinks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions [start, end) of one sequence from its window ring, float32 [n, heads, d]."""
    index = window_index(window_block_table, start, end, window_size, window_key_cache.shape[0],
                         window_key_cache.shape[3], window_sinks)
    return gather_window_at(window_key_cache, window_value_cache, index)


def window_index(window_block_table: torch.Tensor | list[int], start: int, end: int, window_size: int,
                 num_blocks: int, block_size: int, window_sinks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, offsets), int64, of positions [start, end) in a window cache of num_blocks blocks; checked.
    A span either lies within the sinks [0, window_sinks) or is at most window_size of recent positions."""
    if end - start > window_size and not end <= window_sinks:
        raise ValueError(f"positions [{start}, {end}) span more than window_size {window_size}")
    slots = window_slots(window_block_table, torch.arange(start, end), window_size, block_size, window_sinks)
    if slots.numel() and (bool((slots < 0).any()) or bool((slots >= num_blocks * block_size).any())):
        raise IndexError(f"window block table holds a block id outside [0, {num_blocks})")
    return slots // block_size, slots % block_size


def paged_attention_window(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, window_key_cache: torch.Tensor,
                           window_value_cache: torch.Tensor, num_kv_heads: int, scale: float,
                           block_tables: torch.Tensor, window_block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, window_starts: torch.Tensor, window_size: int,
                           block_size: int, max_seq_len: int, alibi_slopes: torch.Tensor | None,
                           kv_cache_dtype: str | int, k_scale: torch.Tensor, v_scale: torch.Tensor,
                           sliding_window: int = 0, logit_softcap: float = 0.0,
                           sinks: torch.Tensor | None = None, k_scale_cache: torch.Tensor | None = None,
                           v_scale_cache: torch.Tensor | None = None, window_sinks: int = 0) -> None:
    """Decode attention over FP8 positions [sink_end, window_start) and window positions [0, sink_end) and
    [window_start, seq_len), sink_end = min(window_sinks, window_start); all from the sliding window's first
    position on."""
    if window_sinks < 0:
        raise ValueError(f"window_sinks {window_sinks} must be >= 0")
    if window_size < 1:
        raise ValueError(f"window_size {window_size} must be >= 1 (use paged_attention without a window)")
    num_seqs, num_heads, _ = query.shape
    group = num_heads // num_kv_heads
    for i in range(num_seqs):
        seq_len, start = int(seq_lens[i]), int(window_starts[i])
        if not max(0, seq_len - window_size) <= start <= seq_len:
            raise ValueError(f"window_starts[{i}]={start} must lie in [max(0, seq_len - window_size), seq_len]"
                             f" = [{max(0, seq_len - window_size)}, {seq_len}]")
        if seq_len == 0:
            out[i] = 0
            continue
        first, sink_end = window_first(seq_len, sliding_window), min(window_sinks, start)
        k_sink, v_sink = gather_window_kv(window_key_cache, window_value_cache, window_block_tables[i],
                                          min(first, sink_end), sink_end, window_size, window_sinks)
        k_old, v_old = gather_kv(key_cache, value_cache, block_tables[i], start, kv_cache_dtype, k_scale,
                                 v_scale, min(max(first, sink_end), start), k_scale_cache, v_scale_cache)
        k_new, v_new = gather_window_kv(window_key_cache, window_value_cache, window_block_tables[i],
                                        max(first, start), seq_len, window_size, window_sinks)
        k = torch.cat([k_sink, k_old, k_new]).repeat_interleave(group, dim=1)  # [T, heads, d]
        v = torch.cat([v_sink, v_old, v_new]).repeat_interleave(group, dim=1)
        out[i] = attend(query[i].to(torch.float32), k, v, scale, alibi_slopes, first, logit_softcap,
                        sinks).to(out.dtype)


# ---- decoder-layer elementwise ops: transformers' own formulas (Llama's RMSNorm, rotary, MLP) ----------

def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), x in float32 (LlamaRMSNorm)."""
    x = input.to(torch.float32)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    out.copy_(weight * normed.to(input.dtype))


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """residual += input (in the dtype); input = rms_norm(residual)."""
    residual.add_(input)
    rms_norm(input, residual, weight, epsilon)


def rotary_embedding_cos_sin(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place on [tokens, heads, d] query and key: x * cos + rotate_half(x) * sin, cos/sin [tokens, d]
    (transformers' apply_rotary_pos_emb, rotate_half(x) = [-x2, x1])."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for x in (query, key):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rotated * sin)


def silu_and_mul(out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    """out = silu(gate) * up, each rounded to the dtype (LlamaMLP's act_fn(gate_proj(x)) * up_proj(x))."""
    out.copy_(torch.nn.functional.silu(gate) * up)
