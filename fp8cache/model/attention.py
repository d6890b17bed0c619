"""Our paged FP8 attention, plugged into transformers through its AttentionInterface.

Every attention layer of the Hugging Face model calls `paged_attention_forward` with post-RoPE query/key/value
for the whole packed step (batch dim 1, all sequences' tokens concatenated). What the call needs beyond its
arguments (cache tensors, slots, block tables, scales) comes from the `ForwardContext` the runner sets for
the step.

Prefill is "decode-faithful" to the letter: a prefill (or chunked-prefill) sequence writes its K/V into the
cache first, then every row of the chunk is a query of the compiled decode op over positions [0, its own
position] (RowQueries), so it attends to the same quantized K/V that decode would see, and a cached prefix or
earlier chunks are read from the FP8 cache. The decode kernel reads FP8 in registers and needs no read-back
or mask: default model, 16 x 256 prompts, prefill time per run 3.81 -> 3.30 s (float32), 2.53 -> 2.00 s
(bfloat16) against a read-back and SDPA. Prefill chunks of one shape form one group, built once per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from fp8cache.kvcache.formats import CacheFormat
from fp8cache.kvcache.layout import gather_window_at
from fp8cache.kvcache.rotation import NONE, apply_rotation
from fp8cache.kvcache.spec import KVCacheSpec
from fp8cache.model import step_metadata
from fp8cache.model.batch import StepBatch, window_slot

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

# (layer, key [T, kv_heads, d], value [T, kv_heads, d]) -> (k_scale, v_scale) for that layer
ScaleCalculator = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PrefillGroup:
    """Prefill chunks of one shape (query_len, context_len, window floor): per layer one decode-op call over
    all their rows. Built once per step; every layer uses it."""

    seqs: list[int]  # indices into the step's seqs
    tokens: torch.Tensor  # int64 [n * query_len]: the chunks' rows in the packed stream, chunk after chunk
    query_len: int
    rows: RowQueries
    # Recent-token window: ring (blocks, offsets) [n * earlier] of the positions before each chunk whose
    # full-precision K/V its rows read; each chunk's own full-precision K/V follow them.
    earlier_index: tuple[torch.Tensor, torch.Tensor] | None = None
    # The chunks' rows as one slice [start, stop) of the packed stream when they are consecutive (a step of
    # equal prompts): the row path then reads and writes views instead of gathered copies.
    token_range: tuple[int, int] | None = None


@dataclass
class RowQueries:
    """A prefill group's rows as decode queries: the row at position P reads positions [0, P] of its
    sequence, [0, window_start) from the paged cache and, with a recent-token window, [window_start, P] in
    full precision. Those full-precision K/V (positions [first_recent, context_len) of each chunk's sequence:
    the ring's earlier ones, then the chunk's own) are written to a scratch window cache per layer, where
    position p sits at ring slot p: the op's ring size (window_span) covers the whole context."""

    block_tables: torch.Tensor  # int32 [rows, blocks]: each row's sequence's table
    seq_lens: torch.Tensor  # int32 [rows]: P + 1
    max_len: int
    window_starts: torch.Tensor | None = None  # int32 [rows]
    window_tables: torch.Tensor | None = None  # int32 [rows, window_span / block_size] into the scratch cache
    window_slots: torch.Tensor | None = None  # int64 [n * (context_len - first_recent)]: where the K/V go
    window_blocks: int = 0  # scratch blocks
    window_span: int = 0
    # The scratch window cache (K, V), made on the first layer and reused by the others. Zeroed once: a row
    # whose window starts inside a block also reads that block's earlier slots (weighted 0), which must
    # hold finite values; slots of an earlier layer do.
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class ForwardContext:
    """Everything one step's attention layers share."""

    ops: object  # fp8cache.ops (tests may pass its pure-torch twin): reshape_and_cache, paged_attention(_window)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer
    k_scales: list[torch.Tensor]  # per layer, [1] or [num_kv_heads]
    v_scales: list[torch.Tensor]
    kv_cache_dtype: CacheFormat  # resolved once per step; the ops take the code, never the string
    block_size: int
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_starts: list[int]  # per seq: first token of the seq in the packed stream
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    num_decode: int  # seqs with query_len 1
    decode_tokens: torch.Tensor | None  # int64 their tokens' indices in the packed stream (None: all_decode)
    decode_context_lens: torch.Tensor  # int32
    max_decode_len: int
    prefill_seqs: list[int]
    decode_block_tables: torch.Tensor | None = None  # block_tables' decode rows (every layer reads them)
    all_decode: bool = False  # every token is a decode token, in order: no gather/scatter of rows needed
    calculate_scales: ScaleCalculator | None = None  # set for the step that computes the scales
    rotation: str = NONE  # kv rotation ("hadamard"): K/V are cached rotated, Q meets them rotated
    # Recent-token window (kv_recent_window > 0): each sequence's newest window_size tokens also sit, in the
    # model dtype, in a ring of window blocks; attention reads them from there instead of from FP8.
    window_size: int = 0
    window_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer, auto layout
    window_slot_mapping: torch.Tensor | None = None  # int64 [num_tokens], -1 for tokens outside the window
    window_block_tables: torch.Tensor | None = None  # int32 [num_seqs, blocks per ring]
    decode_window_block_tables: torch.Tensor | None = None  # window_block_tables' decode rows
    window_floors: list[int] | None = None  # per seq: positions below came from the prefix cache (FP8 only)
    decode_window_starts: torch.Tensor | None = None  # int32: first position each decode reads from the window
    prefill_groups: list[PrefillGroup] = field(default_factory=list)  # prefill_seqs by shape
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # the caller's arrays, on the device


def build_forward_context(batch: StepBatch, ops: object,
                          kv_caches: list[tuple[torch.Tensor, torch.Tensor]], spec: KVCacheSpec,
                          device: torch.device | str = "cpu",
                          window_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                          extra: dict[str, np.ndarray] | None = None,
                          metadata_buffer: torch.Tensor | None = None, table_width: int | None = None,
                          max_decode_len: int | None = None) -> ForwardContext:
    """The step's tensors from a StepBatch (sequences in order, tokens packed). Every index the step needs is
    computed on the host and reaches the device in one copy (step_metadata); `extra` arrays (the runner's
    token ids, positions, ...) ride along and come back as ctx.extra. `spec` is the cache's format, scales,
    rotation, block size and recent-token window.

    A CUDA graph's step keeps its shapes and its buffer: metadata_buffer (the device buffer to copy into),
    table_width (block table columns) and max_decode_len (the attention's max_seq_len) fix them."""
    device = torch.device(device)
    seqs = batch.seqs
    arrays, starts, plans = step_arrays(batch, kv_caches, spec.block_size, spec.window_size, window_caches,
                                        extra, table_width)
    views = step_metadata.to_device(arrays, device, into=metadata_buffer)
    decode = [i for i, s in enumerate(seqs) if s.query_len == 1]
    all_decode = len(decode) == len(seqs)
    ctx = ForwardContext(
        ops=ops, kv_caches=kv_caches, k_scales=list(spec.k_scales),
        v_scales=list(spec.v_scales), kv_cache_dtype=spec.format, block_size=spec.block_size,
        slot_mapping=views["slot_mapping"],
        query_starts=starts.tolist(), query_lens=[s.query_len for s in seqs], context_lens=[s.context_len for s in seqs],
        block_tables=views["block_tables"], num_decode=len(decode),
        decode_block_tables=views["block_tables"] if all_decode else views["decode_block_tables"],
        all_decode=all_decode, decode_tokens=views.get("decode_tokens"),
        decode_context_lens=views["decode_context_lens"],
        max_decode_len=max_decode_len if max_decode_len is not None
        else max((seqs[i].context_len for i in decode), default=0),
        prefill_seqs=[i for i, s in enumerate(seqs) if s.query_len > 1], rotation=spec.rotation,
        extra={name: views[name] for name in extra or {}})
    if spec.window_size:
        ctx.window_size, ctx.window_caches = spec.window_size, window_caches
        ctx.window_slot_mapping, ctx.window_block_tables = views["window_slot_mapping"], views["window_block_tables"]
        ctx.decode_window_block_tables = views["window_block_tables"] if all_decode \
            else views["decode_window_block_tables"]
        ctx.decode_window_starts = views["decode_window_starts"]
        ctx.window_floors = [s.window_floor for s in seqs]
    ctx.prefill_groups = [_prefill_group(ctx, n, plan, views) for n, plan in enumerate(plans)]
    return ctx


def step_arrays(batch: StepBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                window_size: int, window_caches, extra: dict[str, np.ndarray] | None = None,
                table_width: int | None = None) -> tuple[dict[str, np.ndarray], np.ndarray, list[_PrefillPlan]]:
    """(the step's host arrays by name, each sequence's first token, its prefill groups). Two batches of the
    same shapes give arrays of the same names, shapes and order: the same packed layout."""
    seqs = batch.seqs
    query_lens = [s.query_len for s in seqs]
    starts = np.concatenate(([0], np.cumsum(query_lens)[:-1])).astype(np.int64)
    decode = [i for i, s in enumerate(seqs) if s.query_len == 1]
    all_decode = len(decode) == len(seqs)
    tables = _block_table_array([s.block_table for s in seqs], kv_caches[0][0].shape[0], table_width)
    arrays: dict[str, np.ndarray] = {
        "slot_mapping": np.asarray(batch.slot_mapping, dtype=np.int64), "block_tables": tables,
        "decode_context_lens": np.asarray([seqs[i].context_len for i in decode], dtype=np.int32)}
    if not all_decode:
        arrays["decode_tokens"] = starts[decode]
        arrays["decode_block_tables"] = tables[decode]
    if window_size:
        arrays.update(_window_arrays(batch, decode, all_decode, window_size, window_caches))
    plans = _prefill_plans(seqs, starts, window_size)
    for n, plan in enumerate(plans):
        arrays.update(_group_arrays(n, plan, batch, block_size, window_size, window_caches))
    arrays.update(extra or {})
    return arrays, starts, plans


def _block_table_array(rows: list[list[int]], num_blocks: int, width: int | None = None) -> np.ndarray:
    """int32 [rows, longest (or width)]; entries past a row's end stay 0 and are never read (only blocks below
    ceil(context_len / block_size) are). Ids are checked here, on the host, so no kernel ever sees one
    outside the cache; -1 marks a block given back behind every layer's sliding window, which the ops never
    look up (they start at the window)."""
    longest = max(len(r) for r in rows)
    if width is not None and width < longest:
        raise ValueError(f"a block table of {longest} blocks does not fit the {width} columns of this step")
    tables = np.zeros((len(rows), width or longest), dtype=np.int32)
    for i, row in enumerate(rows):
        tables[i, :len(row)] = row
    if tables.size and (int(tables.min()) < -1 or int(tables.max()) >= num_blocks):
        raise IndexError(f"block table holds a block id outside [0, {num_blocks})")
    return tables


def _window_arrays(batch: StepBatch, decode: list[int], all_decode: bool, window_size: int,
                   window_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, np.ndarray]:
    seqs = batch.seqs
    tables = _block_table_array([s.window_block_table for s in seqs], window_caches[0][0].shape[0])
    arrays = {"window_slot_mapping": np.asarray(batch.window_slot_mapping, dtype=np.int64),
              "window_block_tables": tables,
              "decode_window_starts": np.asarray([max(seqs[i].context_len - window_size, seqs[i].window_floor)
                                                  for i in decode], dtype=np.int32)}
    if not all_decode:
        arrays["decode_window_block_tables"] = tables[decode]
    return arrays


@dataclass
class _PrefillPlan:
    """A prefill group's host-side shape: which sequences, their chunk, and where its keys come from."""

    seqs: list[int]
    q_len: int
    ctx_len: int
    floor: int
    starts: np.ndarray  # int64 [n]: each chunk's first token in the packed stream

    @property
    def prefix(self) -> int:
        return self.ctx_len - self.q_len

    def first_recent(self, window_size: int) -> int:
        """The chunk's first row's first full-precision position."""
        return max(self.prefix - window_size + 1, self.floor)

    @property
    def consecutive(self) -> bool:
        return bool(np.all(self.starts == self.starts[0] + self.q_len * np.arange(len(self.seqs))))


def _prefill_plans(seqs, starts: np.ndarray, window_size: int) -> list[_PrefillPlan]:
    by_shape: dict[tuple[int, int, int], list[int]] = {}
    for i, s in enumerate(seqs):
        if s.query_len > 1:
            floor = max(s.window_floor, 0) if window_size else 0
            by_shape.setdefault((s.query_len, s.context_len, floor), []).append(i)
    return [_PrefillPlan(group, q, c, f, starts[group]) for (q, c, f), group in by_shape.items()]


def _group_arrays(n: int, plan: _PrefillPlan, batch: StepBatch, block_size: int, window_size: int,
                  window_caches) -> dict[str, np.ndarray]:
    arrays = {f"g{n}.tokens": (plan.starts[:, None] + np.arange(plan.q_len)).reshape(-1),
              f"g{n}.seqs": np.asarray(plan.seqs, dtype=np.int64)}
    if window_size:
        window_cache = window_caches[0][0]
        slots = [window_slot(batch.seqs[i].window_block_table, p, window_size, block_size)
                 for i in plan.seqs for p in range(plan.first_recent(window_size), plan.prefix)]
        slots = np.asarray(slots, dtype=np.int64)
        limit = window_cache.shape[0] * window_cache.shape[3]
        if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= limit):
            raise IndexError(f"window block table holds a block id outside [0, {window_cache.shape[0]})")
        arrays[f"g{n}.earlier_blocks"], arrays[f"g{n}.earlier_offsets"] = slots // block_size, slots % block_size
    return arrays


def _prefill_group(ctx: ForwardContext, n: int, plan: _PrefillPlan,
                   views: dict[str, torch.Tensor]) -> PrefillGroup:
    q_len, ctx_len = plan.q_len, plan.ctx_len
    earlier = None
    seq_index = views[f"g{n}.seqs"]
    if ctx.window_size:
        # Each row reads one key per position: from the window if within its last window_size positions (and
        # computed by this sequence), else from the cache. Both sets go into one softmax.
        rows = torch.arange(q_len, device=ctx.block_tables.device)[:, None] + plan.prefix  # r at prefix + r
        earlier = (views[f"g{n}.earlier_blocks"], views[f"g{n}.earlier_offsets"])
        full_from = torch.clamp(rows - ctx.window_size + 1, min=plan.floor)
        row_queries = _row_queries(ctx, seq_index, len(plan.seqs), q_len, ctx_len,
                                   plan.first_recent(ctx.window_size), full_from)
    else:
        row_queries = _row_queries(ctx, seq_index, len(plan.seqs), q_len, ctx_len)
    first = int(plan.starts[0])
    return PrefillGroup(plan.seqs, views[f"g{n}.tokens"], q_len, row_queries, earlier,
                        (first, first + len(plan.seqs) * q_len) if plan.consecutive else None)


def _row_queries(ctx: ForwardContext, seq_index: torch.Tensor, n: int, q_len: int, ctx_len: int,
                 first_recent: int = 0, full_from: torch.Tensor | None = None) -> RowQueries:
    prefix, bs = ctx_len - q_len, ctx.block_size
    device = ctx.block_tables.device
    rows = RowQueries(ctx.block_tables.index_select(0, seq_index).repeat_interleave(q_len, 0),
                      torch.arange(prefix + 1, ctx_len + 1, dtype=torch.int32, device=device).repeat(n), ctx_len)
    if full_from is None:
        return rows
    span_blocks, first_block = -(-ctx_len // bs), first_recent // bs
    per_seq = span_blocks - first_block  # scratch blocks of one sequence: its positions from first_block * bs
    tables = torch.zeros(n, span_blocks, dtype=torch.int32, device=device)  # columns below first_block: unread
    tables[:, first_block:] = torch.arange(n * per_seq, dtype=torch.int32, device=device).view(n, per_seq)
    positions = torch.arange(first_recent, ctx_len, device=device)
    seq_base = torch.arange(n, device=device)[:, None] * per_seq
    rows.window_slots = ((seq_base + positions // bs - first_block) * bs + positions % bs).reshape(-1)
    rows.window_tables = tables.repeat_interleave(q_len, 0)
    rows.window_starts = full_from.view(-1).to(torch.int32).repeat(n)
    rows.window_blocks, rows.window_span = n * per_seq, span_blocks * bs
    return rows


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
    """query [1, heads, T, d], key/value [1, kv_heads, T, d] -> output [1, T, heads, d], no weights. The layer's
    sliding window, soft cap and sinks come as transformers passes them to its own attention functions."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    features = LayerFeatures(binding_window(kwargs.get("sliding_window"), getattr(module, "config", None)),
                             float(kwargs.get("softcap") or 0.0), kwargs.get("s_aux"))
    out = attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1).contiguous(),
                 value[0].transpose(0, 1).contiguous(), scaling, features)
    return out.unsqueeze(0), None


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
           features: LayerFeatures = PLAIN) -> torch.Tensor:
    """One layer's attention for the step: q [T, heads, d], k/v [T, kv_heads, d] (any strides) -> [T, heads, d].
    Writes the step's K/V into the caches first. Prefill rows are decode queries of their own lengths, so a
    sliding window, soft cap and sinks apply to them exactly as to decode."""
    ctx = get_forward_context()
    if ctx.rotation != NONE:
        # q.k and softmax(qk)V are unchanged: Q meets K in the same rotated basis and the output rotates back
        # below (H is its own inverse). apply_rotation runs the compiled O(d log d) transform when it can.
        q, k, v = (apply_rotation(t, ctx.rotation) for t in (q, k, v))
    if ctx.calculate_scales is not None:
        # Scales come from this step's own K/V, so they must exist before anything is written.
        ctx.k_scales[layer], ctx.v_scales[layer] = ctx.calculate_scales(layer, k, v)
    key_cache, value_cache = ctx.kv_caches[layer]
    k_scale, v_scale = ctx.k_scales[layer], ctx.v_scales[layer]
    window = ctx.window_caches[layer] if ctx.window_size else None
    # A prefill chunk's rows see their predecessors' full-precision K/V, which this step's window writes
    # may overwrite in the ring: read them first.
    earlier = [gather_window_at(window[0], window[1], g.earlier_index) for g in ctx.prefill_groups] if window else []
    ctx.ops.reshape_and_cache(k, v, key_cache, value_cache, ctx.slot_mapping, ctx.kv_cache_dtype,
                              k_scale, v_scale)
    if window:
        ctx.ops.reshape_and_cache(k, v, window[0], window[1], ctx.window_slot_mapping, CacheFormat.AUTO, k_scale,
                                  v_scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: the decode op writes into it
    if ctx.num_decode:
        _decode(ctx, q, out, key_cache, value_cache, k_scale, v_scale, scaling, window, features)
    for n, group in enumerate(ctx.prefill_groups):
        _prefill(ctx, group, q, k, v, out, key_cache, value_cache, k_scale, v_scale, scaling,
                 earlier[n] if window else None, features)
    if ctx.rotation != NONE:
        out = apply_rotation(out, ctx.rotation)
    return out


def decode_step_args(layer: int) -> tuple | None:
    """The attention arguments of torch.ops.fp8kv.decode_layer for `layer` (key_cache .. window_size) when this
    step is one attend() can hand over whole: decode tokens only, the compiled CPU ops, no kv rotation and no
    scale calculation. None otherwise (the layer then runs attend())."""
    ctx = get_forward_context()
    if (not ctx.all_decode or ctx.rotation != NONE or ctx.calculate_scales is not None
            or ctx.slot_mapping.device.type != "cpu"):
        return None
    key_cache, value_cache = ctx.kv_caches[layer]
    window = ctx.window_caches[layer] if ctx.window_size else ()
    return (key_cache, value_cache, ctx.slot_mapping, ctx.kv_cache_dtype, ctx.k_scales[layer], ctx.v_scales[layer],
            ctx.decode_block_tables, ctx.decode_context_lens, ctx.max_decode_len, list(window),
            ctx.window_slot_mapping if window else None, ctx.decode_window_block_tables if window else None,
            ctx.decode_window_starts if window else None, ctx.window_size)


def _decode(ctx: ForwardContext, q: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, scaling: float,
            window: tuple[torch.Tensor, torch.Tensor] | None, features: LayerFeatures) -> None:
    if ctx.all_decode:  # the packed rows are the decode rows already: write the output in place
        # The GPU op reads rows of any stride (q is a column view of the merged q/k/v projection).
        query, result = (q.contiguous() if q.device.type == "cpu" else q), out
    else:
        query = q.index_select(0, ctx.decode_tokens)
        result = torch.empty_like(query)
    ring = None if window is None else (*window, ctx.decode_window_block_tables, ctx.decode_window_starts,
                                         ctx.window_size)
    _decode_op(ctx, result, query, key_cache, value_cache, k_scale, v_scale, scaling, ctx.decode_block_tables,
               ctx.decode_context_lens, ctx.max_decode_len, ring, features)
    if not ctx.all_decode:
        out.index_copy_(0, ctx.decode_tokens, result)


def _decode_op(ctx: ForwardContext, result: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, scaling: float,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
               ring: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int] | None,
               features: LayerFeatures = PLAIN) -> None:
    """One query row per entry of seq_lens through the decode op; ring: (window key cache, window value cache,
    window block tables, window starts, ring size) reads each row's newest positions from there."""
    extra = () if features.plain else features.op_args()
    if ring is None:
        ctx.ops.paged_attention(result, query, key_cache, value_cache, key_cache.shape[1], float(scaling),
                                block_tables, seq_lens, ctx.block_size, max_len, None, ctx.kv_cache_dtype,
                                k_scale, v_scale, *extra)
    else:
        ring_k, ring_v, ring_tables, window_starts, ring_size = ring
        ctx.ops.paged_attention_window(
            result, query, key_cache, value_cache, ring_k, ring_v, key_cache.shape[1], float(scaling), block_tables,
            ring_tables, seq_lens, window_starts, ring_size, ctx.block_size, max_len, None, ctx.kv_cache_dtype,
            k_scale, v_scale, *extra)


def _prefill(ctx: ForwardContext, group: PrefillGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: torch.Tensor,
             v_scale: torch.Tensor, scaling: float,
             earlier: tuple[torch.Tensor, torch.Tensor] | None, features: LayerFeatures = PLAIN) -> None:
    """The group's rows through the decode op (see RowQueries); the chunk's K/V are in the cache already.
    earlier: float32 full-precision K/V [n * earlier, kv_heads, d] of the positions before each chunk that its
    rows read (recent-token window; the chunk's own K/V follow them); None without a window."""
    rows, kv_heads = group.rows, key_cache.shape[1]

    def take(t: torch.Tensor) -> torch.Tensor:  # the group's rows of a [tokens, ...] tensor
        return t[slice(*group.token_range)] if group.token_range else t.index_select(0, group.tokens)

    query = take(q)
    result = take(out) if group.token_range else torch.empty_like(query)  # a slice of out: written in place
    ring = None
    if rows.window_starts is not None:
        if rows.scratch is None:
            rows.scratch = tuple(torch.zeros((rows.window_blocks, *ring.shape[1:]), dtype=ring.dtype, device=ring.device)
                                 for ring in ctx.window_caches[0])
        scratch_k, scratch_v = rows.scratch
        n, d = len(group.seqs), k.shape[2]
        full = []
        for old, new in ((earlier[0], k), (earlier[1], v)):
            if old.shape[0] == 0:  # a first chunk: no earlier positions, the chunk's own K/V as they are
                full.append(take(new))
                continue
            chunk = take(new).view(n, group.query_len, kv_heads, d)
            old = old.to(chunk.dtype).view(n, old.shape[0] // n, kv_heads, d)
            full.append(torch.cat([old, chunk], 1).flatten(0, 1))
        ctx.ops.reshape_and_cache(full[0], full[1], scratch_k, scratch_v, rows.window_slots, CacheFormat.AUTO, k_scale,
                                  v_scale)
        ring = (scratch_k, scratch_v, rows.window_tables, rows.window_starts, rows.window_span)
    _decode_op(ctx, result, query, key_cache, value_cache, k_scale, v_scale, scaling, rows.block_tables,
               rows.seq_lens, rows.max_len, ring, features)
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
