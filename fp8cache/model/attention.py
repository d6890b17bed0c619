"""Our paged FP8 attention, plugged into transformers through its AttentionInterface.

Every attention layer of the Hugging Face model calls `paged_attention_forward` with post-RoPE query/key/value
for the whole packed step (batch dim 1, all sequences' tokens concatenated). What the call needs beyond its
arguments (cache tensors, slots, block tables, scales) comes from the `ForwardContext` the runner sets for
the step.

Prefill is "decode-faithful": a prefill (or chunked-prefill) sequence writes its K/V into the cache first and
then reads its whole context back from the cache, so every position attends to the same quantized K/V that
decode would see, and a cached prefix or earlier chunks are read from the FP8 cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp8cache.model.batch import StepBatch
from fp8cache.ops.reference import gather_window_kv
from fp8cache.rotation import HADAMARD, apply_rotation

ATTENTION_NAME = "fp8kv_paged"

# (layer, key [T, kv_heads, d], value [T, kv_heads, d]) -> (k_scale, v_scale) for that layer
ScaleCalculator = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ForwardContext:
    """Everything one step's attention layers share."""

    ops: object  # fp8cache.ops or fp8cache.ops.reference: reshape_and_cache, paged_attention
    gather_kv: Callable  # (key_cache, value_cache, block_table, seq_len, dtype, k_scale, v_scale) -> K, V
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer
    k_scales: list[torch.Tensor]  # per layer, [1] or [num_kv_heads]
    v_scales: list[torch.Tensor]
    kv_cache_dtype: str
    block_size: int
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_starts: list[int]  # per seq: first token of the seq in the packed stream
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    decode_seqs: torch.Tensor  # int64 indices of the seqs with query_len 1
    decode_tokens: torch.Tensor  # int64 their tokens' indices in the packed stream
    decode_context_lens: torch.Tensor  # int32
    max_decode_len: int
    prefill_seqs: list[int]
    calculate_scales: ScaleCalculator | None = None  # set for the step that computes the scales
    rotation: torch.Tensor | None = None  # [d, d] Hadamard (kv_rotation "hadamard"): K/V are cached rotated
    # Recent-token window (kv_recent_window > 0): each sequence's newest window_size tokens also sit, in the
    # model dtype, in a ring of window blocks; attention reads them from there instead of from FP8.
    window_size: int = 0
    window_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer, auto layout
    window_slot_mapping: torch.Tensor | None = None  # int64 [num_tokens], -1 for tokens outside the window
    window_block_tables: torch.Tensor | None = None  # int32 [num_seqs, blocks per ring]
    window_floors: list[int] | None = None  # per seq: positions below came from the prefix cache (FP8 only)
    decode_window_starts: torch.Tensor | None = None  # int32: first position each decode reads from the window


def build_forward_context(batch: StepBatch, ops: object, gather_kv: Callable,
                          kv_caches: list[tuple[torch.Tensor, torch.Tensor]], k_scales: list[torch.Tensor],
                          v_scales: list[torch.Tensor], kv_cache_dtype: str, block_size: int,
                          device: torch.device | str = "cpu", rotation: torch.Tensor | None = None,
                          window_size: int = 0,
                          window_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> ForwardContext:
    """The step's tensors from a StepBatch (sequences in order, tokens packed)."""
    seqs = batch.seqs
    starts, offset = [], 0
    for s in seqs:
        starts.append(offset)
        offset += s.query_len
    tables = torch.zeros(len(seqs), max(len(s.block_table) for s in seqs), dtype=torch.int32)
    for i, s in enumerate(seqs):
        # Entries past a table's end stay 0 and are never read: only blocks below
        # ceil(context_len / block_size) are.
        tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
    decode = [i for i, s in enumerate(seqs) if s.query_len == 1]
    return ForwardContext(
        ops=ops, gather_kv=gather_kv, kv_caches=kv_caches, k_scales=list(k_scales), v_scales=list(v_scales),
        kv_cache_dtype=kv_cache_dtype, block_size=block_size,
        slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.long, device=device),
        query_starts=starts, query_lens=[s.query_len for s in seqs], context_lens=[s.context_len for s in seqs],
        block_tables=tables.to(device),
        decode_seqs=torch.tensor(decode, dtype=torch.long, device=device),
        decode_tokens=torch.tensor([starts[i] for i in decode], dtype=torch.long, device=device),
        decode_context_lens=torch.tensor([seqs[i].context_len for i in decode], dtype=torch.int32,
                                         device=device),
        max_decode_len=max((seqs[i].context_len for i in decode), default=0),
        prefill_seqs=[i for i, s in enumerate(seqs) if s.query_len > 1], rotation=rotation,
        **(_window_fields(batch, decode, window_size, window_caches, device) if window_size else {}))


def _window_fields(batch: StepBatch, decode: list[int], window_size: int,
                   window_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str) -> dict:
    seqs = batch.seqs
    starts = [max(seqs[i].context_len - window_size, seqs[i].window_floor) for i in decode]
    tables = torch.tensor([s.window_block_table for s in seqs], dtype=torch.int32, device=device)
    return {"window_size": window_size, "window_caches": window_caches,
            "window_slot_mapping": torch.tensor(batch.window_slot_mapping, dtype=torch.long, device=device),
            "window_block_tables": tables, "window_floors": [s.window_floor for s in seqs],
            "decode_window_starts": torch.tensor(starts, dtype=torch.int32, device=device)}


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError(f"attention implementation {ATTENTION_NAME!r} was called outside a model runner "
                           "step; run the model through fp8cache.model.runner.ModelRunner.execute")
    return _current


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, d], key/value [1, kv_heads, T, d] -> output [1, T, heads, d], no weights."""
    _refuse_unsupported(kwargs)
    ctx = get_forward_context()
    layer = module.layer_idx
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)  # [T, heads, d]
    k = key[0].transpose(0, 1).contiguous()  # [T, kv_heads, d]
    v = value[0].transpose(0, 1).contiguous()
    if ctx.rotation is not None:
        # q.k and softmax(qk)V are unchanged: Q meets K in the same rotated basis and the output rotates back
        # below (H is its own inverse). apply_rotation runs the compiled O(d log d) transform when it can.
        q, k, v = (apply_rotation(t, HADAMARD) for t in (q, k, v))
    if ctx.calculate_scales is not None:
        # Scales come from this step's own K/V, so they must exist before anything is written.
        ctx.k_scales[layer], ctx.v_scales[layer] = ctx.calculate_scales(layer, k, v)
    key_cache, value_cache = ctx.kv_caches[layer]
    k_scale, v_scale = ctx.k_scales[layer], ctx.v_scales[layer]
    window = ctx.window_caches[layer] if ctx.window_size else None
    # A prefill chunk's rows see their predecessors' full-precision K/V, which this step's window writes
    # may overwrite in the ring: read them first.
    earlier = {i: _earlier_window_kv(ctx, i, window) for i in ctx.prefill_seqs} if window else {}
    ctx.ops.reshape_and_cache(k, v, key_cache, value_cache, ctx.slot_mapping, ctx.kv_cache_dtype,
                              k_scale, v_scale)
    if window:
        ctx.ops.reshape_and_cache(k, v, window[0], window[1], ctx.window_slot_mapping, "auto", k_scale, v_scale)
    out = torch.empty_like(q)
    if ctx.decode_seqs.numel():
        _decode(ctx, q, out, key_cache, value_cache, k_scale, v_scale, scaling, window)
    for i in ctx.prefill_seqs:
        recent = None
        if window:
            start, q_len = ctx.query_starts[i], ctx.query_lens[i]
            recent = tuple(torch.cat([old, new[start:start + q_len].to(torch.float32)])
                           for old, new in zip(earlier[i], (k, v)))
        _prefill(ctx, i, q, out, key_cache, value_cache, k_scale, v_scale, scaling, recent)
    if ctx.rotation is not None:
        out = apply_rotation(out, HADAMARD)
    return out.unsqueeze(0), None


def _refuse_unsupported(kwargs: dict) -> None:
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"this model's attention uses {name!r}, which fp8kv's paged attention "
                                      "does not implement")


def _decode(ctx: ForwardContext, q: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, scaling: float,
            window: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    query = q.index_select(0, ctx.decode_tokens).contiguous()
    result = torch.empty_like(query)
    tables = ctx.block_tables.index_select(0, ctx.decode_seqs).contiguous()
    if window is None:
        ctx.ops.paged_attention(result, query, key_cache, value_cache, key_cache.shape[1], float(scaling),
                                tables, ctx.decode_context_lens, ctx.block_size, ctx.max_decode_len,
                                None, ctx.kv_cache_dtype, k_scale, v_scale)
    else:
        ctx.ops.paged_attention_window(
            result, query, key_cache, value_cache, window[0], window[1], key_cache.shape[1], float(scaling),
            tables, ctx.window_block_tables.index_select(0, ctx.decode_seqs).contiguous(),
            ctx.decode_context_lens, ctx.decode_window_starts, ctx.window_size, ctx.block_size,
            ctx.max_decode_len, None, ctx.kv_cache_dtype, k_scale, v_scale)
    out.index_copy_(0, ctx.decode_tokens, result)


def _first_full_position(ctx: ForwardContext, i: int, position: int) -> int:
    """The oldest position whose full-precision K/V a query at `position` of seq i reads."""
    return max(position - ctx.window_size + 1, ctx.window_floors[i], 0)


def _earlier_window_kv(ctx: ForwardContext, i: int,
                       window: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-precision K/V of the positions before seq i's chunk that its first row still reads."""
    prefix = ctx.context_lens[i] - ctx.query_lens[i]
    return gather_window_kv(window[0], window[1], ctx.window_block_tables[i],
                            _first_full_position(ctx, i, prefix), prefix, ctx.window_size)


def _prefill(ctx: ForwardContext, i: int, q: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, scaling: float,
             recent: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """recent: float32 K/V of the positions [first full position of the chunk's first row, context_len)
    in full precision (recent-token window); None reads everything from the cache."""
    start, q_len, ctx_len = ctx.query_starts[i], ctx.query_lens[i], ctx.context_lens[i]
    prefix = ctx_len - q_len
    k, v = ctx.gather_kv(key_cache, value_cache, ctx.block_tables[i], ctx_len, ctx.kv_cache_dtype,
                         k_scale, v_scale)  # float32 [ctx_len, kv_heads, d], read back from the cache
    qs = q[start:start + q_len].transpose(0, 1).to(torch.float32)  # [heads, q_len, d]
    rows = torch.arange(q_len, device=q.device)[:, None] + prefix  # query row r sits at position prefix + r
    positions = torch.arange(ctx_len, device=q.device)[None, :]
    mask = None if not prefix else positions <= rows
    if recent is not None:
        # Each row reads one key per position: from the window if within its last window_size positions
        # (and computed by this sequence), else from the cache. Both sets go into one softmax.
        first_recent = ctx_len - recent[0].shape[0]
        full_from = torch.clamp(rows - ctx.window_size + 1, min=max(ctx.window_floors[i], 0))
        recent_positions = positions[:, first_recent:]
        mask = torch.cat([positions < full_from, (recent_positions >= full_from) & (recent_positions <= rows)], 1)
        k, v = torch.cat([k, recent[0]]), torch.cat([v, recent[1]])
    ks, vs = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, keys, d]
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                       enable_gqa=qs.shape[0] != ks.shape[0])
    out[start:start + q_len] = o.transpose(0, 1).to(out.dtype)


def register() -> None:
    """Make ATTENTION_NAME a valid attn_implementation everywhere in transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def install(model: torch.nn.Module) -> None:
    """Switch every attention layer of `model` to our paged attention."""
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        raise ValueError(f"{type(model).__name__} does not route attention through transformers' "
                         "AttentionInterface, so fp8kv cannot plug its paged FP8 attention into it")
    layers = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layers with a layer_idx; fp8kv supports "
                         "decoder-only models whose attention modules carry layer_idx (Llama, Mistral, Qwen2, ...)")
