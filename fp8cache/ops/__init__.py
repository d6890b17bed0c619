"""Python face of the compiled ops (torch.ops.fp8kv.*).

The C++ library is compiled for this machine on first use and cached on disk (see `_build`). Its pure-torch
twin, `fp8cache.ops.reference`, is the tests' oracle, which the engine never runs: nothing here imports it.
"""

from __future__ import annotations

import torch

from fp8cache.kvcache import formats

__all__ = ["build", "dequantize_fp8", "format_code", "fused_add_rms_norm", "load", "overload",
           "paged_attention", "paged_attention_window", "quantize_fp8", "reshape_and_cache", "rms_norm",
           "rotary_embedding_cos_sin", "silu_and_mul"]


def load(device: torch.device | str | None = None, cpu_isa: str | None = None) -> object:
    """Compile (once per source hash) and load the op library; returns torch.ops.fp8kv. device: what it must
    run on (a CPU device builds no GPU sources; None: the GPU too when torch sees one and nvcc is here).
    cpu_isa: avx512, avx2 or scalar instead of this CPU's best path (tests of the lower paths)."""
    from fp8cache.ops import _build, fake

    _build.load_library(device=device, cpu_isa=cpu_isa)
    fake.register()
    return torch.ops.fp8kv


def build(verbose: bool = False, progress_callback=None, device: torch.device | str | None = None) -> str:
    """Compile (unless cached) and load the op library; returns its path (used by `fp8kv build`)."""
    from fp8cache.ops import _build

    return _build.build(verbose=verbose, progress_callback=progress_callback, device=device)


def overload(name: str) -> object | None:
    """The loaded library's op `name`, bound to its default overload (the cheapest call, for the lean layers'
    hot loops, which pass arguments already checked); None where the library has no such op."""
    lib = torch.ops.fp8kv
    return getattr(lib, name).default if hasattr(lib, name) else None


def format_code(kv_cache_dtype: str | int, device: torch.device) -> int:
    """The compiled ops' kv_cache_format for a kv-cache-dtype string on `device` ("fp8": the device's native
    format), or a code the engine resolved already (passed through). A string names no format: RuntimeError, as
    when the compiled ops parsed it themselves."""
    if not isinstance(kv_cache_dtype, str):
        return int(kv_cache_dtype)
    try:
        return int(formats.format_code(kv_cache_dtype, formats.backend_of(device)))
    except formats.KVCacheDtypeError as e:
        raise RuntimeError(str(e)) from None


# kv_cache_dtype below: a kv-cache-dtype string (auto, fp8, fp8_e4m3, fp8_e5m2, fp8_e4m3fnuz) or a CacheFormat.

def quantize_fp8(x: torch.Tensor, kv_cache_dtype: str | int, scale: torch.Tensor) -> torch.Tensor:
    """uint8 codes of clamp(x / scale, -max, max); scale is [1] or one per head (dim -2 of x)."""
    return load().quantize_fp8(x, format_code(kv_cache_dtype, x.device), scale)


def dequantize_fp8(codes: torch.Tensor, kv_cache_dtype: str | int, scale: torch.Tensor,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of uint8 codes times scale ([1] or one per head, dim -2), as out_dtype."""
    return load().dequantize_fp8(codes, format_code(kv_cache_dtype, codes.device), scale, out_dtype)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str | int,
                      k_scale: torch.Tensor, v_scale: torch.Tensor, k_scale_cache: torch.Tensor | None = None,
                      v_scale_cache: torch.Tensor | None = None) -> None:
    """Quantize K/V into their slots. k_scale_cache / v_scale_cache (bfloat16 [num_blocks, kv_heads, block_size],
    FP8 caches): dynamic scales, one per token and head computed here and stored at the token's slot
    (fp8cache.kvcache.dynamic_scales); k_scale and v_scale are then not used."""
    load().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                             format_code(kv_cache_dtype, key_cache.device), k_scale, v_scale, k_scale_cache,
                             v_scale_cache)


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, num_kv_heads: int, scale: float,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    max_seq_len: int, alibi_slopes: torch.Tensor | None, kv_cache_dtype: str | int,
                    k_scale: torch.Tensor, v_scale: torch.Tensor, sliding_window: int = 0,
                    logit_softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    k_scale_cache: torch.Tensor | None = None, v_scale_cache: torch.Tensor | None = None) -> None:
    """Decode attention over the paged cache (docs/design.md section 4); sliding_window > 0: the newest positions
    only; logit_softcap > 0: logits become cap * tanh(logit / cap); sinks [num_heads]: one more logit per head
    in the softmax's denominator; k_scale_cache / v_scale_cache: dynamic scales (see reshape_and_cache)."""
    load().paged_attention(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                           seq_lens, block_size, max_seq_len, alibi_slopes,
                           format_code(kv_cache_dtype, key_cache.device), k_scale, v_scale, sliding_window,
                           logit_softcap, sinks, k_scale_cache, v_scale_cache)


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
    """paged_attention reading positions [window_starts[i], seq_lens[i]) and the attention sinks [0,
    min(window_sinks, window_starts[i])) from the model-dtype window ring (ring slot = position < window_sinks ?
    position : window_sinks + position % window_size) instead of the paged cache; one softmax over all positions."""
    load().paged_attention_window(out, query, key_cache, value_cache, window_key_cache, window_value_cache,
                                  num_kv_heads, scale, block_tables, window_block_tables, seq_lens,
                                  window_starts, window_size, block_size, max_seq_len, alibi_slopes,
                                  format_code(kv_cache_dtype, key_cache.device), k_scale, v_scale, sliding_window,
                                  logit_softcap, sinks, k_scale_cache, v_scale_cache, window_sinks)


# Decoder-layer elementwise ops (CPU kernels only; fp8cache.model.fused_layer binds them with overload()).

def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """out = LlamaRMSNorm(input) for [tokens, n] or [tokens, heads, n] (last dim contiguous)."""
    load().rms_norm(out, input, weight, epsilon)


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """residual += input (rounded to the dtype); input = RMSNorm(residual). Both in place."""
    load().fused_add_rms_norm(input, residual, weight, epsilon)


def rotary_embedding_cos_sin(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """transformers' apply_rotary_pos_emb in place on [tokens, heads, d] query and key; cos/sin [tokens, d]."""
    load().rotary_embedding_cos_sin(query, key, cos, sin)


def silu_and_mul(out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    """out = silu(gate) * up for [tokens, n] operands (views of one gate/up output are fine)."""
    load().silu_and_mul(out, gate, up)
