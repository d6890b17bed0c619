"""Our paged FP8 attention, plugged into transformers through its AttentionInterface.

Every attention layer of the Hugging Face model calls `paged_attention_forward` with post-RoPE query/key/value
for the whole packed step (batch dim 1, all sequences' tokens concatenated). What the call needs beyond its
arguments (cache tensors, slots, block tables, scales) comes from the step's `ForwardContext`
(model/forward_context.py), which the runner passes to the model's forward and transformers passes down.

Prefill is "decode-faithful" to the letter: a prefill (or chunked-prefill) sequence writes its K/V into the
cache first, then every row of the chunk is a query of the compiled decode op over positions [0, its own
position] (RowQueries), so it attends to the same quantized K/V that decode would see, and a cached prefix or
earlier chunks are read from the FP8 cache. The decode kernel reads FP8 in registers and needs no read-back
or mask: default model, 16 x 256 prompts, prefill time per run 3.81 -> 3.30 s (float32), 2.53 -> 2.00 s
(bfloat16) against a read-back and SDPA. Prefill chunks of one shape form one group, built once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8cache.kvcache.formats import CacheFormat
from fp8cache.kvcache.layout import gather_window_at
from fp8cache.kvcache.rotation import NONE, apply_rotation
from fp8cache.model.forward_context import ForwardContext, PrefillGroup, from_kwargs

ATTENTION_NAME = "fp8kv_paged"


@dataclass(frozen=True)
class LayerFeatures:
    """What a layer's attention adds to plain causal attention, as transformers hands it to its own attention
    functions: a sliding window (Mistral, Gemma 2/3, gpt-oss, Qwen2 with use_sliding_window), logit
    soft-capping (Gemma 2) and attention sinks (gpt-oss). The compiled ops do all three."""

    sliding_window: int = 0  # 0: none
    logit_softcap: float = 0.0  # 0: none
    sinks: torch.Tensor | None = None  # [num_heads], the layer's own parameter

    @property
    def plain(self) -> bool:
        return not self.sliding_window and not self.logit_softcap and self.sinks is None

    def op_args(self) -> tuple[int, float, torch.Tensor | None]:
        sinks = self.sinks
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.to(torch.float32)
        return self.sliding_window, self.logit_softcap, sinks


PLAIN = LayerFeatures()


def features_of(attn: torch.nn.Module, config: object) -> LayerFeatures:
    """The features transformers passes to `attn`'s attention function: models with per-layer types keep the
    layer's window in attn.sliding_window (None on full-attention layers); the others (Mistral, Mixtral,
    Phi-3, Qwen3-MoE) pass config.sliding_window to every layer."""
    window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
    softcap = getattr(attn, "attn_logit_softcapping", None)
    sinks = getattr(attn, "sinks", None)
    return LayerFeatures(binding_window(window, config), float(softcap or 0.0),
                         sinks if isinstance(sinks, torch.Tensor) else None)


def binding_window(window: int | None, config: object) -> int:
    """A sliding window, or 0 where it can never mask anything: one at least as long as the model's context
    (Mistral's config default of 4096 on a shorter model) is plain causal attention."""
    longest = getattr(config, "max_position_embeddings", None)
    return 0 if not window or (longest is not None and window >= longest) else int(window)


def model_window(model: torch.nn.Module) -> int:
    """The sliding window every attention layer of `model` keeps within (the longest of theirs), or 0 when
    any layer attends to its whole context (Gemma 2/3 and gpt-oss mix full layers in). Positions further back
    than it are never read again, so their cache blocks can be given back (BlockManager)."""
    windows = [features_of(m, getattr(m, "config", None)).sliding_window for m in model.modules()
               if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")]
    return max(windows) if windows and all(windows) else 0


# Attention a model may ask for that the ops do not compute: refused when the model loads, naming it.
UNSUPPORTED_CONFIG = {"attention_chunk_size": "chunked attention (Llama 4's attention_chunk_size)"}


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, d], key/value [1, kv_heads, T, d] -> output [1, T, heads, d], no weights. The layer's
    sliding window, soft cap and sinks come as transformers passes them to its own attention functions."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    features = LayerFeatures(binding_window(kwargs.get("sliding_window"), getattr(module, "config", None)),
                             float(kwargs.get("softcap") or 0.0), kwargs.get("s_aux"))
    out = attend(from_kwargs(kwargs), module.layer_idx, query[0].transpose(0, 1),
                 key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous(), scaling, features)
    return out.unsqueeze(0), None


def attend(ctx: ForwardContext, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
           features: LayerFeatures = PLAIN) -> torch.Tensor:
    """One layer's attention for the step: q [T, heads, d], k/v [T, kv_heads, d] (any strides) -> [T, heads, d].
    Writes the step's K/V into the caches first. Prefill rows are decode queries of their own lengths, so a
    sliding window, soft cap and sinks apply to them exactly as to decode."""
    fmt = ctx.layer_formats[layer]  # AUTO for a layer kept in the model dtype: no scales, no rotation
    rotation = ctx.rotation if fmt != CacheFormat.AUTO else NONE
    if rotation != NONE:
        # q.k and softmax(qk)V are unchanged: Q meets K in the same rotated basis and the output rotates back
        # below (H is its own inverse). apply_rotation runs the compiled O(d log d) transform when it can.
        q, k, v = (apply_rotation(t, rotation) for t in (q, k, v))
    if ctx.calculate_scales is not None:
        # Scales come from this step's own K/V, so they must exist before anything is written.
        ctx.k_scales[layer], ctx.v_scales[layer] = ctx.calculate_scales(layer, k, v)
    key_cache, value_cache = ctx.kv_caches[layer]
    k_scale, v_scale = ctx.k_scales[layer], ctx.v_scales[layer]
    scale_caches = ctx.scale_caches[layer] if ctx.scale_caches is not None else ()
    window = ctx.window_caches[layer] if ctx.window_size else None
    # A prefill chunk's rows see their predecessors' full-precision K/V, which this step's window writes
    # may overwrite in the ring: read them first.
    earlier = [_ring_before_writes(window, g) for g in ctx.prefill_groups] if window else []
    ctx.ops.reshape_and_cache(k, v, key_cache, value_cache, ctx.slot_mapping, fmt, k_scale, v_scale, *scale_caches)
    if ctx.saturation is not None and fmt != CacheFormat.AUTO:
        ctx.saturation.count(layer, k, v, k_scale, v_scale)
    if window:
        ctx.ops.reshape_and_cache(k, v, window[0], window[1], ctx.window_slot_mapping, CacheFormat.AUTO, k_scale,
                                  v_scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: the decode op writes into it
    if ctx.num_decode:
        _decode(ctx, q, out, key_cache, value_cache, k_scale, v_scale, scaling, window, features, scale_caches,
                fmt=fmt)
    for n, group in enumerate(ctx.prefill_groups):
        _prefill(ctx, group, q, k, v, out, key_cache, value_cache, k_scale, v_scale, scaling,
                 earlier[n] if window else None, features, scale_caches, fmt=fmt)
    if rotation != NONE:
        out = apply_rotation(out, rotation)
    return out


def _decode(ctx: ForwardContext, q: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, scaling: float,
            window: tuple[torch.Tensor, torch.Tensor] | None, features: LayerFeatures, scale_caches: tuple = (), *,
            fmt: CacheFormat) -> None:
    if ctx.all_decode:  # the packed rows are the decode rows already: write the output in place
        # The GPU op reads rows of any stride (q is a column view of the merged q/k/v projection).
        query, result = (q.contiguous() if q.device.type == "cpu" else q), out
    else:
        query = q.index_select(0, ctx.decode_tokens)
        result = torch.empty_like(query)
    ring = None if window is None else (*window, ctx.decode_window_block_tables, ctx.decode_window_starts,
                                         ctx.window_size, ctx.window_sinks)
    _decode_op(ctx, result, query, key_cache, value_cache, k_scale, v_scale, scaling, ctx.decode_block_tables,
               ctx.decode_context_lens, ctx.max_decode_len, ring, features, scale_caches, fmt=fmt)
    if not ctx.all_decode:
        out.index_copy_(0, ctx.decode_tokens, result)


def _decode_op(ctx: ForwardContext, result: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, scaling: float,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
               ring: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None,
               features: LayerFeatures = PLAIN, scale_caches: tuple[torch.Tensor, torch.Tensor] | tuple = (),
               *, fmt: CacheFormat) -> None:
    """One query row per entry of seq_lens through the decode op; ring: (window key cache, window value cache,
    window block tables, window starts, ring size, sinks) reads each row's newest positions and its attention
    sinks from there; scale_caches:
    the layer's dynamic scales, () for static ones; fmt: the layer's format (ctx.layer_formats)."""
    extra = (*features.op_args(), *scale_caches) if scale_caches or not features.plain else ()
    if ring is None:
        ctx.ops.paged_attention(result, query, key_cache, value_cache, key_cache.shape[1], float(scaling),
                                block_tables, seq_lens, ctx.block_size, max_len, None, fmt,
                                k_scale, v_scale, *extra)
    else:
        ring_k, ring_v, ring_tables, window_starts, ring_size, sinks = ring
        if sinks:  # a trailing argument: every optional one before it is passed
            extra = (*features.op_args(), *(scale_caches or (None, None)), sinks)
        ctx.ops.paged_attention_window(
            result, query, key_cache, value_cache, ring_k, ring_v, key_cache.shape[1], float(scaling), block_tables,
            ring_tables, seq_lens, window_starts, ring_size, ctx.block_size, max_len, None, fmt,
            k_scale, v_scale, *extra)


def _ring_before_writes(window: tuple[torch.Tensor, torch.Tensor], group: PrefillGroup
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the group's rows read from the ring: copies of its sequences' ring blocks (group.ring_blocks), or
    its earlier positions' K/V in float32."""
    if group.ring_blocks is not None:
        return window[0].index_select(0, group.ring_blocks), window[1].index_select(0, group.ring_blocks)
    return gather_window_at(window[0], window[1], group.earlier_index)


def _prefill(ctx: ForwardContext, group: PrefillGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: torch.Tensor,
             v_scale: torch.Tensor, scaling: float,
             earlier: tuple[torch.Tensor, torch.Tensor] | None, features: LayerFeatures = PLAIN,
             scale_caches: tuple = (), *, fmt: CacheFormat) -> None:
    """The group's rows through the decode op (see RowQueries); the chunk's K/V are in the cache already.
    earlier: _ring_before_writes' copies (recent-token window); None without a window."""
    rows = group.rows

    def take(t: torch.Tensor) -> torch.Tensor:  # the group's rows of a [tokens, ...] tensor
        return t[slice(*group.token_range)] if group.token_range else t.index_select(0, group.tokens)

    query = take(q)
    result = take(out) if group.token_range else torch.empty_like(query)  # a slice of out: written in place
    ring = None
    if group.ring_blocks is not None:  # the copied ring blocks take the chunks' own K/V
        scratch_k, scratch_v = earlier
        ctx.ops.reshape_and_cache(take(k), take(v), scratch_k, scratch_v, rows.window_slots, CacheFormat.AUTO,
                                  k_scale, v_scale)
        ring = (scratch_k, scratch_v, rows.window_tables, rows.window_starts, rows.window_span, ctx.window_sinks)
    elif rows.window_starts is not None:
        if rows.scratch is None:
            rows.scratch = tuple(torch.zeros((rows.window_blocks, *ring.shape[1:]), dtype=ring.dtype, device=ring.device)
                                 for ring in ctx.window_caches[0])
        scratch_k, scratch_v = rows.scratch
        # every chunk's earlier positions, then every chunk's own rows: the order of rows.window_slots
        full = [take(new) if old.shape[0] == 0 else torch.cat([old.to(new.dtype), take(new)])
                for old, new in ((earlier[0], k), (earlier[1], v))]
        ctx.ops.reshape_and_cache(full[0], full[1], scratch_k, scratch_v, rows.window_slots, CacheFormat.AUTO, k_scale,
                                  v_scale)
        ring = (scratch_k, scratch_v, rows.window_tables, rows.window_starts, rows.window_span, ctx.window_sinks)
    _decode_op(ctx, result, query, key_cache, value_cache, k_scale, v_scale, scaling, rows.block_tables,
               rows.seq_lens, rows.max_len, ring, features, scale_caches, fmt=fmt)
    if not group.token_range:
        out.index_copy_(0, group.tokens, result)


def register() -> None:
    """Make ATTENTION_NAME a valid attn_implementation everywhere in transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def install(model: torch.nn.Module) -> None:
    """Switch every attention layer of `model` to our paged attention; refuse, naming it, attention the ops do
    not compute (at load, not at the first request)."""
    for key, what in UNSUPPORTED_CONFIG.items():
        if getattr(model.config, key, None) is not None:
            raise ValueError(f"{type(model).__name__} uses {what}, which fp8kv's paged attention does not "
                             "compute; serve it with another engine")
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        raise ValueError(f"{type(model).__name__} does not route attention through transformers' "
                         "AttentionInterface, so fp8kv cannot plug its paged FP8 attention into it")
    layers = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layers with a layer_idx; fp8kv supports "
                         "decoder-only models whose attention modules carry layer_idx (Llama, Mistral, Qwen2, ...)")
