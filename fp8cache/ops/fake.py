"""Fake (meta) kernels of torch.ops.fp8kv: what each op checks and returns, without touching data.

They let the engine run on a stand-in device under torch's FakeTensorMode (tests of the GPU code paths on
machines without a GPU: a CPU tensor that meets a device tensor raises there, as on CUDA) and let
torch.compile trace through the ops. Each one checks what the CUDA binding checks of devices, dtypes and
shapes (csrc/cuda/torch_bindings_cuda.cu); the values are the compiled ops' business.
"""

from __future__ import annotations

import torch

from fp8cache.kvcache.formats import CacheFormat, format_name

_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_registered = False


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _same_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None:
            _check(t.device == device, f"{name} is on {t.device} but the caches are on {device}; "
                                       f"move it with .to({device})")


def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, kv_cache_format: int,
                  what: str = "") -> None:
    _check(key_cache.dim() == 5, f"{what}key_cache must be [num_blocks, num_kv_heads, head_size // x, "
                                 f"block_size, x], got {tuple(key_cache.shape)}")
    _check(value_cache.dim() == 4, f"{what}value_cache must be [num_blocks, num_kv_heads, head_size, block_size], "
                                   f"got {tuple(value_cache.shape)}")
    _same_device(key_cache.device, **{f"{what}value_cache": value_cache})
    _check(key_cache.dtype == value_cache.dtype, f"{what}key_cache and {what}value_cache dtypes differ")
    if kv_cache_format == CacheFormat.AUTO:
        _check(key_cache.dtype in _MODEL_DTYPES, f"an 'auto' {what}key_cache must hold a model dtype")
    else:
        _check(key_cache.dtype == torch.uint8, f"kv_cache_dtype {format_name(kv_cache_format)!r} stores uint8 "
                                               f"caches, got {key_cache.dtype}")
    x = 16 // key_cache.element_size()
    _check(key_cache.shape[4] == x and key_cache.shape[2] * x == value_cache.shape[2]
           and key_cache.shape[:2] == value_cache.shape[:2] and key_cache.shape[3] == value_cache.shape[3],
           f"{what}key_cache {tuple(key_cache.shape)} and {what}value_cache {tuple(value_cache.shape)} do not match")


def _check_scale(scale: torch.Tensor, num_kv_heads: int, device: torch.device, name: str) -> None:
    _check(scale.dtype == torch.float32, f"{name} must be float32, got {scale.dtype}")
    _check(scale.numel() in (1, num_kv_heads), f"{name} must have 1 or {num_kv_heads} elements")
    _same_device(device, **{name: scale})


def _check_scale_caches(key_cache, kv_cache_format, k_scale_cache, v_scale_cache) -> None:
    """Dynamic scales: bfloat16 [num_blocks, num_kv_heads, block_size] each, both or neither, FP8 caches only."""
    if k_scale_cache is None and v_scale_cache is None:
        return
    _check(k_scale_cache is not None and v_scale_cache is not None,
           "give both k_scale_cache and v_scale_cache (dynamic scales) or neither (static scales)")
    _check(kv_cache_format != CacheFormat.AUTO, "an 'auto' cache holds the values themselves: pass no scale caches")
    shape = (key_cache.shape[0], key_cache.shape[1], key_cache.shape[3])
    for name, t in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        _check(t.dtype == torch.bfloat16 and tuple(t.shape) == shape,
               f"{name} must be bfloat16 {shape} ([num_blocks, num_kv_heads, block_size]), got {t.dtype} {tuple(t.shape)}")
        _same_device(key_cache.device, **{name: t})


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_format, k_scale, v_scale,
                      k_scale_cache=None, v_scale_cache=None) -> None:
    _check_caches(key_cache, value_cache, kv_cache_format)
    _check_scale_caches(key_cache, kv_cache_format, k_scale_cache, v_scale_cache)
    device, heads, head_size = key_cache.device, key_cache.shape[1], value_cache.shape[2]
    for name, t in (("key", key), ("value", value)):
        _check(t.dim() == 3 and t.shape[1] == heads and t.shape[2] == head_size,
               f"{name} must be [num_tokens, {heads}, {head_size}], got {tuple(t.shape)}")
        _check(t.dtype in _MODEL_DTYPES, f"{name} must be float32, bfloat16 or float16")
    _same_device(device, key=key, value=value, slot_mapping=slot_mapping)
    _check(slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0],
           f"slot_mapping must be 1-D with one slot per token ({key.shape[0]})")
    _check(slot_mapping.dtype in (torch.int64, torch.int32), "slot_mapping must be int64 (or int32)")
    _check_scale(k_scale, heads, device, "k_scale")
    _check_scale(v_scale, heads, device, "v_scale")


def _check_attention(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens, kv_cache_format,
                     k_scale, v_scale, alibi_slopes) -> None:
    _check_caches(key_cache, value_cache, kv_cache_format)
    device = key_cache.device
    _same_device(device, out=out, query=query, block_tables=block_tables, seq_lens=seq_lens,
                 alibi_slopes=alibi_slopes)
    _check(query.dim() == 3 and out.shape == query.shape, "query and out must be [num_seqs, num_heads, head_size]")
    _check(query.dtype in _MODEL_DTYPES and out.dtype in _MODEL_DTYPES, "query and out must hold a model dtype")
    _check(kv_cache_format != CacheFormat.AUTO or key_cache.dtype == query.dtype,
           "an 'auto' cache holds the model dtype; allocate it with the query's dtype")
    _check(num_kv_heads == key_cache.shape[1] and query.shape[1] % num_kv_heads == 0,
           f"num_kv_heads {num_kv_heads} does not match the cache or divide num_heads {query.shape[1]}")
    _check(query.shape[2] == value_cache.shape[2], "query head_size does not match the cache")
    _check(block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == query.shape[0],
           "block_tables must be int32 [num_seqs, max_blocks]")
    _check(seq_lens.dtype == torch.int32 and seq_lens.shape == (query.shape[0],), "seq_lens must be int32 [num_seqs]")
    _check_scale(k_scale, num_kv_heads, device, "k_scale")
    _check_scale(v_scale, num_kv_heads, device, "v_scale")


def _check_features(query, key_cache, sliding_window, logit_softcap, sinks) -> None:
    _check(sliding_window >= 0, f"sliding_window = {sliding_window} must be >= 0 (0: no sliding window)")
    _check(logit_softcap >= 0 and logit_softcap != float("inf"),
           f"logit_softcap = {logit_softcap} must be a finite number >= 0 (0: no soft-capping)")
    if sinks is not None:
        _check(sinks.numel() == query.shape[1], f"sinks must have num_heads = {query.shape[1]} values")
        _same_device(key_cache.device, sinks=sinks)


def paged_attention(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
                    max_seq_len, alibi_slopes, kv_cache_format, k_scale, v_scale, sliding_window=0, logit_softcap=0.0,
                    sinks=None, k_scale_cache=None, v_scale_cache=None) -> None:
    _check_attention(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens, kv_cache_format,
                     k_scale, v_scale, alibi_slopes)
    _check_scale_caches(key_cache, kv_cache_format, k_scale_cache, v_scale_cache)
    _check_features(query, key_cache, sliding_window, logit_softcap, sinks)


def paged_attention_window(out, query, key_cache, value_cache, window_key_cache, window_value_cache, num_kv_heads,
                           scale, block_tables, window_block_tables, seq_lens, window_starts, window_size,
                           block_size, max_seq_len, alibi_slopes, kv_cache_format, k_scale, v_scale, sliding_window=0,
                           logit_softcap=0.0, sinks=None, k_scale_cache=None, v_scale_cache=None,
                           window_sinks=0) -> None:
    _check_attention(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens, kv_cache_format,
                     k_scale, v_scale, alibi_slopes)
    _check_scale_caches(key_cache, kv_cache_format, k_scale_cache, v_scale_cache)
    _check_features(query, key_cache, sliding_window, logit_softcap, sinks)
    _check_caches(window_key_cache, window_value_cache, CacheFormat.AUTO, "window_")
    _same_device(key_cache.device, window_key_cache=window_key_cache, window_block_tables=window_block_tables,
                 window_starts=window_starts)
    _check(window_size >= 1, "window_size must be >= 1")
    _check(window_sinks >= 0, "window_sinks must be >= 0")
    _check(window_block_tables.dtype == torch.int32 and window_starts.dtype == torch.int32,
           "window_block_tables and window_starts must be int32")


def quantize_fp8(x, kv_cache_format, scale):
    _same_device(x.device, scale=scale)
    return torch.empty(x.shape, dtype=torch.uint8, device=x.device)


def dequantize_fp8(codes, kv_cache_format, scale, out_dtype):
    _same_device(codes.device, scale=scale)
    return torch.empty(codes.shape, dtype=out_dtype, device=codes.device)


def hadamard_transform(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _same_device_as_first(**tensors: torch.Tensor) -> None:
    """The decoder-layer ops' one check: every tensor on the first one's device (named as the op names it)."""
    first = next(iter(tensors.values()))
    _same_device(first.device, **tensors)


# The decoder-layer elementwise ops write in place and return nothing; their parameters are the ops' own.

def rms_norm(out, input, weight, epsilon) -> None:
    _same_device_as_first(out=out, input=input, weight=weight)


def fused_add_rms_norm(input, residual, weight, epsilon) -> None:
    _same_device_as_first(input=input, residual=residual, weight=weight)


def rotary_embedding_cos_sin(query, key, cos, sin) -> None:
    _same_device_as_first(query=query, key=key, cos=cos, sin=sin)


def silu_and_mul(out, gate, up) -> None:
    _same_device_as_first(out=out, gate=gate, up=up)


_FAKES = {
    "reshape_and_cache": reshape_and_cache,
    "paged_attention": paged_attention,
    "paged_attention_window": paged_attention_window,
    "quantize_fp8": quantize_fp8,
    "dequantize_fp8": dequantize_fp8,
    "hadamard_transform": hadamard_transform,
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding_cos_sin": rotary_embedding_cos_sin,
    "silu_and_mul": silu_and_mul,
}


def register() -> None:
    """Register the fake kernels of the loaded op library (idempotent; ops it lacks are skipped)."""
    global _registered
    if _registered:
        return
    for name, fn in _FAKES.items():
        if hasattr(torch.ops.fp8kv, name):
            torch.library.register_fake(f"fp8kv::{name}", fn)
    _registered = True
