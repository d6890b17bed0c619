"""One engine step as attention sees it: the ForwardContext every attention layer of the step shares (caches,
slots, block tables, scales, the recent-token window, prefill groups), built on the host from a StepBatch and
sent to the device in one copy (model/step_metadata.py).

The runner builds it and hands it to the model's forward as the keyword argument `fp8kv_context`; transformers
passes it down to each attention call, and fp8kv's lean decoder layers (model/fused_layer.py) read it there too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fp8cache.kvcache.formats import CacheFormat
from fp8cache.kvcache.rotation import NONE
from fp8cache.kvcache.saturation import SaturationCounter
from fp8cache.kvcache.spec import KVCacheSpec
from fp8cache.model import step_metadata
from fp8cache.model.batch import StepBatch, window_slot

# The keyword argument under which the context rides through the model's forward.
CONTEXT_KWARG = "fp8kv_context"

# (layer, key [T, kv_heads, d], value [T, kv_heads, d]) -> (k_scale, v_scale) for that layer
ScaleCalculator = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PrefillGroup:
    """Prefill chunks of one query_len, of any context lengths and window floors (a speculative verify step's
    1 + K token chunks among them): per layer one decode-op call over all their rows. Built once per step;
    every layer uses it."""

    seqs: list[int]  # indices into the step's seqs
    tokens: torch.Tensor  # int64 [n * query_len]: the chunks' rows in the packed stream, chunk after chunk
    query_len: int
    rows: RowQueries
    # Recent-token window: ring (blocks, offsets) of the positions before each chunk whose full-precision K/V
    # its rows read, chunk after chunk (RowQueries.window_slots places them, then the chunks' own K/V).
    earlier_index: tuple[torch.Tensor, torch.Tensor] | None = None
    # The chunks' rows as one slice [start, stop) of the packed stream when they are consecutive (a step of
    # equal prompts): the row path then reads and writes views instead of gathered copies.
    token_range: tuple[int, int] | None = None
    # Recent-token window, chunks no longer than it (a verify step's): each sequence's ring blocks twice
    # (int64 [n * 2 * blocks per ring]), copied before the step's writes as the rows' scratch ring instead of
    # earlier_index's positions (_ring_copy_arrays).
    ring_blocks: torch.Tensor | None = None


@dataclass
class RowQueries:
    """A prefill group's rows as decode queries: the row at position P reads positions [0, P] of its
    sequence, [0, window_start) from the paged cache and, with a recent-token window, [window_start, P] in
    full precision, and its attention sinks [0, min(window_sinks, window_start)) too. Those full-precision K/V
    (positions [first_recent, context_len) of each chunk's sequence and its sinks: the ring's earlier ones, then
    the chunk's own) are written to a scratch window cache per layer, where position p sits at ring seat p (a
    sink) or window_sinks + p of its sequence's blocks: the op's ring size (window_span) covers the longest
    context, so the op's seat of p (p < sinks ? p : sinks + p % window_span) is that seat."""

    block_tables: torch.Tensor  # int32 [rows, blocks]: each row's sequence's table
    seq_lens: torch.Tensor  # int32 [rows]: P + 1
    max_len: int
    window_starts: torch.Tensor | None = None  # int32 [rows]
    window_tables: torch.Tensor | None = None  # int32 [rows, (sinks + window_span) / block_size] into the scratch
    # int64: where the full-precision K/V go, every chunk's earlier positions, then every chunk's own rows
    window_slots: torch.Tensor | None = None
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
    # Per layer, the format code the ops take: the one the user's kv-cache-dtype resolved to, AUTO for a layer
    # kept in the model dtype (kv_cache_dtype_skip_layers).
    layer_formats: tuple[CacheFormat, ...]
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
    # The first window_sinks positions of each sequence (attention sinks) sit in the ring too, before the recent
    # seats (ring seat of p: p < window_sinks ? p : window_sinks + p % window_size); attention reads them from there.
    window_sinks: int = 0
    window_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer, auto layout
    window_slot_mapping: torch.Tensor | None = None  # int64 [num_tokens], -1 for tokens outside the window
    window_block_tables: torch.Tensor | None = None  # int32 [num_seqs, blocks per ring]
    decode_window_block_tables: torch.Tensor | None = None  # window_block_tables' decode rows
    window_floors: list[int] | None = None  # per seq: positions below came from the prefix cache (FP8 only)
    decode_window_starts: torch.Tensor | None = None  # int32: first position each decode reads from the window
    prefill_groups: list[PrefillGroup] = field(default_factory=list)  # prefill_seqs by shape
    # Dynamic KV scales: per layer (k_scale_cache, v_scale_cache), indexed by the same slots as kv_caches; the
    # cache write fills them and attention reads them instead of k_scales / v_scales. None: static scales.
    scale_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # Set for a step whose cache writes are counted (kvcache/saturation.py): attention adds each layer's
    # clipped and flushed-to-zero K/V values to it.
    saturation: SaturationCounter | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # the caller's arrays, on the device


def build_forward_context(batch: StepBatch, ops: object,
                          kv_caches: list[tuple[torch.Tensor, torch.Tensor]], spec: KVCacheSpec,
                          device: torch.device | str = "cpu",
                          window_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                          extra: dict[str, np.ndarray] | None = None,
                          metadata_buffer: torch.Tensor | None = None, table_width: int | None = None,
                          max_decode_len: int | None = None,
                          scale_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> ForwardContext:
    """The step's tensors from a StepBatch (sequences in order, tokens packed). Every index the step needs is
    computed on the host and reaches the device in one copy (step_metadata); `extra` arrays (the runner's
    token ids, positions, ...) ride along and come back as ctx.extra. `spec` is the cache's format, scales,
    rotation, block size and recent-token window.

    A CUDA graph's step keeps its shapes and its buffer: metadata_buffer (the device buffer to copy into),
    table_width (block table columns) and max_decode_len (the attention's max_seq_len) fix them."""
    device = torch.device(device)
    seqs = batch.seqs
    arrays, starts, plans = step_arrays(batch, kv_caches, spec.block_size, spec.window_size, window_caches,
                                        extra, table_width, spec.window_sinks)
    views = step_metadata.to_device(arrays, device, into=metadata_buffer)
    decode = [i for i, s in enumerate(seqs) if s.query_len == 1]
    all_decode = len(decode) == len(seqs)
    ctx = ForwardContext(
        ops=ops, kv_caches=kv_caches, k_scales=list(spec.k_scales),
        v_scales=list(spec.v_scales), layer_formats=spec.layer_formats, block_size=spec.block_size,
        slot_mapping=views["slot_mapping"],
        query_starts=starts.tolist(), query_lens=[s.query_len for s in seqs], context_lens=[s.context_len for s in seqs],
        block_tables=views["block_tables"], num_decode=len(decode),
        decode_block_tables=views["block_tables"] if all_decode else views["decode_block_tables"],
        all_decode=all_decode, decode_tokens=views.get("decode_tokens"),
        decode_context_lens=views["decode_context_lens"],
        max_decode_len=max_decode_len if max_decode_len is not None
        else max((seqs[i].context_len for i in decode), default=0),
        prefill_seqs=[i for i, s in enumerate(seqs) if s.query_len > 1], rotation=spec.rotation,
        extra={name: views[name] for name in extra or {}}, scale_caches=scale_caches)
    if spec.window_size:
        ctx.window_size, ctx.window_sinks, ctx.window_caches = spec.window_size, spec.window_sinks, window_caches
        ctx.window_slot_mapping, ctx.window_block_tables = views["window_slot_mapping"], views["window_block_tables"]
        ctx.decode_window_block_tables = views["window_block_tables"] if all_decode \
            else views["decode_window_block_tables"]
        ctx.decode_window_starts = views["decode_window_starts"]
        ctx.window_floors = [s.window_floor for s in seqs]
    ctx.prefill_groups = [_prefill_group(ctx, n, plan, views) for n, plan in enumerate(plans)]
    return ctx


def step_arrays(batch: StepBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                window_size: int, window_caches, extra: dict[str, np.ndarray] | None = None,
                table_width: int | None = None,
                window_sinks: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray, list[_PrefillPlan]]:
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
        arrays.update(_group_arrays(n, plan, batch, block_size, window_size, window_caches, window_sinks))
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
    """A prefill group's host-side shape: which sequences, their chunk, and where its keys come from. Chunks
    of one length share a group whatever their context lengths (a verify step's 1 + K token chunks, one per
    sequence, are one group: one decode-op call per layer instead of one per sequence)."""

    seqs: list[int]
    q_len: int
    prefixes: np.ndarray  # int64 [n]: each chunk's positions before it (cached prefix or earlier chunks)
    floors: np.ndarray  # int64 [n]: each sequence's window floor (0 without a window)
    starts: np.ndarray  # int64 [n]: each chunk's first token in the packed stream
    # The scratch window cache its rows read (_group_window_arrays): blocks in all, and the ring span in blocks.
    scratch_blocks: int = 0
    scratch_span_blocks: int = 0

    @property
    def context_lens(self) -> np.ndarray:
        return self.prefixes + self.q_len

    def first_recent(self, window_size: int) -> np.ndarray:
        """Each chunk's first row's first full-precision position."""
        return np.maximum(self.prefixes - window_size + 1, self.floors)

    @property
    def row_positions(self) -> np.ndarray:
        """int64 [n, q_len]: the position each row of each chunk queries at."""
        return self.prefixes[:, None] + np.arange(self.q_len)

    @property
    def consecutive(self) -> bool:
        return bool(np.all(self.starts == self.starts[0] + self.q_len * np.arange(len(self.seqs))))


def _prefill_plans(seqs, starts: np.ndarray, window_size: int) -> list[_PrefillPlan]:
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        if s.query_len > 1:
            by_len.setdefault(s.query_len, []).append(i)
    plans = []
    for q_len, group in by_len.items():
        prefixes = np.asarray([seqs[i].context_len - q_len for i in group], dtype=np.int64)
        floors = np.asarray([max(seqs[i].window_floor, 0) if window_size else 0 for i in group], dtype=np.int64)
        plans.append(_PrefillPlan(group, q_len, prefixes, floors, starts[group]))
    return plans


def _group_arrays(n: int, plan: _PrefillPlan, batch: StepBatch, block_size: int, window_size: int,
                  window_caches, window_sinks: int = 0) -> dict[str, np.ndarray]:
    rows = plan.row_positions
    arrays = {f"g{n}.tokens": (plan.starts[:, None] + np.arange(plan.q_len)).reshape(-1),
              f"g{n}.seqs": np.asarray(plan.seqs, dtype=np.int64),
              f"g{n}.seq_lens": (rows + 1).reshape(-1).astype(np.int32)}
    if window_size:
        if _copies_ring(plan, block_size, window_size, window_sinks):
            arrays.update(_ring_copy_arrays(n, plan, batch, block_size, window_size, window_caches))
        else:
            arrays.update(_group_window_arrays(n, plan, batch, block_size, window_size, window_caches, window_sinks))
    return arrays


def _group_window_arrays(n: int, plan: _PrefillPlan, batch: StepBatch, block_size: int, window_size: int,
                         window_caches, window_sinks: int = 0) -> dict[str, np.ndarray]:
    """A group's rows read positions [first_recent, context_len) of their sequence in full precision, and its
    attention sinks: the ring's earlier ones (gathered before the step's writes overwrite them) and the chunk's
    own. Both go to a scratch window cache where sequence s's position p sits at seat p (a sink) or
    window_sinks + p of its own blocks, so one ring size (window_span, the longest context) serves every row.
    Each row reads from max(P - window_size + 1, floor), and its sinks before that."""
    bs = block_size
    first_recent = plan.first_recent(window_size)
    earlier_positions = [_earlier_positions(first, prefix, window_sinks)
                         for first, prefix in zip(first_recent, plan.prefixes)]
    earlier = [window_slot(batch.seqs[i].window_block_table, p, window_size, bs, window_sinks)
               for i, positions in zip(plan.seqs, earlier_positions) for p in positions]
    earlier = np.asarray(earlier, dtype=np.int64)
    window_cache = window_caches[0][0]
    limit = window_cache.shape[0] * window_cache.shape[3]
    if earlier.size and (int(earlier.min()) < 0 or int(earlier.max()) >= limit):
        raise IndexError(f"window block table holds a block id outside [0, {window_cache.shape[0]})")
    columns, span_blocks = _scratch_layout(plan, bs, window_size, window_sinks)
    plan.scratch_blocks, plan.scratch_span_blocks = sum(map(len, columns)), span_blocks
    tables = np.zeros((len(plan.seqs), _scratch_columns(span_blocks, bs, window_sinks)), dtype=np.int32)
    base = 0  # columns a sequence does not use are never read
    for s, cols in enumerate(columns):
        tables[s, cols] = base + np.arange(len(cols))
        base += len(cols)

    def scratch_slots(positions: list[np.ndarray]) -> np.ndarray:  # each sequence's positions, in order
        slots = []
        for table, p in zip(tables, positions):
            seat = np.where(p < window_sinks, p, window_sinks + p)
            slots.append(table[seat // bs].astype(np.int64) * bs + seat % bs)
        return np.concatenate(slots).astype(np.int64)

    window_starts = np.maximum(plan.row_positions - window_size + 1, plan.floors[:, None])
    own = [np.arange(a, b) for a, b in zip(plan.prefixes, plan.context_lens)]
    return {f"g{n}.earlier_blocks": earlier // bs, f"g{n}.earlier_offsets": earlier % bs,
            # where the full-precision K/V go: every sequence's earlier positions, then every chunk's own
            f"g{n}.window_slots": np.concatenate([scratch_slots(earlier_positions), scratch_slots(own)]),
            f"g{n}.window_tables": np.repeat(tables, plan.q_len, axis=0),
            f"g{n}.window_starts": window_starts.reshape(-1).astype(np.int32)}


def _earlier_positions(first_recent: int, prefix: int, window_sinks: int) -> np.ndarray:
    """The positions before a chunk whose ring K/V its rows read: the sinks not among the recent ones, then
    [first_recent, prefix)."""
    sinks = np.arange(min(window_sinks, first_recent, prefix))
    return np.concatenate([sinks, np.arange(first_recent, prefix)]).astype(np.int64)


def _copies_ring(plan: _PrefillPlan, block_size: int, window_size: int, window_sinks: int = 0) -> bool:
    # With sinks the ring's recent seats start mid-block, so two copies of its blocks are no ring of 2 * window.
    return plan.q_len <= window_size and window_size % block_size == 0 and not window_sinks


def _ring_copy_arrays(n: int, plan: _PrefillPlan, batch: StepBatch, block_size: int, window_size: int,
                      window_caches) -> dict[str, np.ndarray]:
    """Chunks no longer than the window (a verify step's 1 + K tokens), whose ring is whole blocks and has no
    sinks: each sequence's ring blocks are copied twice, as a ring of 2 * window_size slots where position p sits
    at slot p % (2 * window_size). The copies hold the ring's positions before the step at both of their slots
    (p % window_size and window_size later), and the chunk's own K/V, written at theirs, never land on a slot
    of a position any of its rows reads: every row reads [max(P - window_size + 1, floor), P], and a chunk
    position lies less than 2 * window_size past each of those. No gather of single positions, one copy of
    whole blocks per layer."""
    ring = np.asarray([batch.seqs[i].window_block_table for i in plan.seqs], dtype=np.int64)
    if ring.size and (int(ring.min()) < 0 or int(ring.max()) >= window_caches[0][0].shape[0]):
        raise IndexError(f"window block table holds a block id outside [0, {window_caches[0][0].shape[0]})")
    count, width = len(plan.seqs), 2 * ring.shape[1]
    rows = plan.row_positions
    slots = np.arange(count)[:, None] * 2 * window_size + rows % (2 * window_size)
    tables = np.arange(count * width, dtype=np.int32).reshape(count, width)
    window_starts = np.maximum(rows - window_size + 1, plan.floors[:, None])
    return {f"g{n}.ring_blocks": np.concatenate([ring, ring], axis=1).reshape(-1),
            f"g{n}.window_slots": slots.reshape(-1), f"g{n}.window_tables": np.repeat(tables, plan.q_len, axis=0),
            f"g{n}.window_starts": window_starts.reshape(-1).astype(np.int32)}


def _scratch_layout(plan: _PrefillPlan, block_size: int, window_size: int,
                    window_sinks: int = 0) -> tuple[list[np.ndarray], int]:
    """(each sequence's scratch-table columns in use: its sinks' seats [0, min(sinks, context_len)) and its
    recent positions' seats sinks + [max(first_recent, sinks), context_len); the span in blocks: the longest
    context)."""
    bs, columns = block_size, []
    for first, end in zip(plan.first_recent(window_size), plan.context_lens):
        sink_cols = np.arange(-(-min(window_sinks, end) // bs))
        lo = max(first, window_sinks)
        recent_cols = np.arange((window_sinks + lo) // bs, -(-(window_sinks + end) // bs)) if lo < end else sink_cols[:0]
        columns.append(np.union1d(sink_cols, recent_cols).astype(np.int64))
    return columns, -(-int(plan.context_lens.max()) // bs)


def _scratch_columns(span_blocks: int, block_size: int, window_sinks: int) -> int:
    """Columns of a scratch table: the sinks' seats and a span of span_blocks blocks after them."""
    return -(-(window_sinks + span_blocks * block_size) // block_size)


def _prefill_group(ctx: ForwardContext, n: int, plan: _PrefillPlan,
                   views: dict[str, torch.Tensor]) -> PrefillGroup:
    q_len, seq_index = plan.q_len, views[f"g{n}.seqs"]
    rows = RowQueries(ctx.block_tables.index_select(0, seq_index).repeat_interleave(q_len, 0),
                      views[f"g{n}.seq_lens"], int(plan.context_lens.max()))
    earlier = ring_blocks = None
    if ctx.window_size:
        # Each row reads one key per position: from the window if within its last window_size positions (and
        # computed by this sequence), else from the cache. Both sets go into one softmax.
        rows.window_slots, rows.window_tables = views[f"g{n}.window_slots"], views[f"g{n}.window_tables"]
        rows.window_starts = views[f"g{n}.window_starts"]
        if _copies_ring(plan, ctx.block_size, ctx.window_size, ctx.window_sinks):
            ring_blocks, rows.window_span = views[f"g{n}.ring_blocks"], 2 * ctx.window_size
        else:
            earlier = (views[f"g{n}.earlier_blocks"], views[f"g{n}.earlier_offsets"])
            rows.window_blocks, rows.window_span = plan.scratch_blocks, plan.scratch_span_blocks * ctx.block_size
    first = int(plan.starts[0])
    return PrefillGroup(plan.seqs, views[f"g{n}.tokens"], q_len, rows, earlier,
                        (first, first + len(plan.seqs) * q_len) if plan.consecutive else None, ring_blocks)


def from_kwargs(kwargs: dict) -> ForwardContext:
    """The step's context from the keyword arguments transformers passed down; a clear error outside a step."""
    ctx = kwargs.get(CONTEXT_KWARG)
    if ctx is None:
        raise RuntimeError("fp8kv's paged attention was called outside a model runner step (no "
                           f"{CONTEXT_KWARG} reached it); run the model through fp8cache.model.runner.ModelRunner."
                           "execute, whose model must pass its forward's keyword arguments down to attention")
    return ctx
