"""Batched verify attention: a step in which several sequences each feed 1 + K tokens (speculative decoding's
verify chunks), at different context lengths, across block edges, with window floors, beside a plain decode and
a prefill chunk, runs those chunks as one group, and each of their rows equals one plain decode at its position
through the pure-torch reference ops: the FP8 cache up to its window start and, with a recent-token window, its
newest positions in full precision from a ring that holds exactly them, and its attention sinks (its first
positions: computed ones in full precision, those a prefix-cache hit gave it as the FP8 cache holds them)."""

from __future__ import annotations

import pytest
import torch
from numerics import attention_error

from fp8cache import ops
from fp8cache.kvcache import dynamic_scales
from fp8cache.kvcache.scales import KVScales
from fp8cache.kvcache.spec import KVCacheSpec
from fp8cache.model import attention, forward_context
from fp8cache.model.batch import SeqChunk, StepBatch, window_slot
from fp8cache.ops import reference

BLOCK, HEADS, KV_HEADS, D = 16, 4, 2, 64
SCALE = D ** -0.5
NUM_BLOCKS = 64
DRAFTS = 4  # verify chunks of 1 + DRAFTS tokens
# (positions cached before the step, window floor, tokens fed): the verify chunks first
SEQS = [(13, 0, 1 + DRAFTS),  # crosses the block edge at 16
        (27, 0, 1 + DRAFTS),  # ends on the block edge at 32
        (3, 0, 1 + DRAFTS),  # younger than the window
        (44, 32, 1 + DRAFTS),  # positions below 32 came from another sequence's blocks: FP8 only, not in its ring
        (70, 0, 1 + DRAFTS),
        (20, 0, 1),  # a plain decode
        (6, 0, 9)]  # a prefill chunk


class Case:
    """Caches holding every sequence's positions before the step, and the step's q/k/v."""

    def __init__(self, kv_cache_dtype: str, window: int, dynamic: bool, sinks: int = 0) -> None:
        g = torch.Generator().manual_seed(7)
        self.fmt, self.window, self.dynamic, self.sinks = kv_cache_dtype, window, dynamic, sinks
        self.caches = [reference.allocate_kv_cache(NUM_BLOCKS, BLOCK, KV_HEADS, D, kv_cache_dtype, torch.float32)]
        self.scale_caches = [dynamic_scales.allocate_scale_caches(NUM_BLOCKS, BLOCK, KV_HEADS)] if dynamic else None
        self.k_scale, self.v_scale = (torch.ones(1), torch.ones(1)) if dynamic else \
            (torch.tensor([0.004, 0.008]), torch.tensor([0.003]))
        ring_blocks = -(-(sinks + window) // BLOCK)
        self.ring_caches = [reference.allocate_kv_cache(len(SEQS) * ring_blocks, BLOCK, KV_HEADS, D, "auto",
                                                        torch.float32)] if window else None
        if window:  # garbage where no position of a sequence was written (positions below its floor)
            for t in self.ring_caches[0]:
                t.copy_(torch.randn(t.shape, generator=g) * 30)
        order = torch.randperm(NUM_BLOCKS, generator=g).tolist()  # blocks scattered over the cache
        self.batch, self.rows, step_rows = StepBatch(), [], []
        self.k_full, self.v_full, self.blocks = [], [], []
        for i, (cached, floor, fed) in enumerate(SEQS):
            end = cached + fed
            blocks = order[:-(-end // BLOCK)]
            order = order[len(blocks):]
            ring = list(range(i * ring_blocks, (i + 1) * ring_blocks))
            size = torch.exp(torch.randn(end, 1, 1, generator=g) * 2) if dynamic else torch.ones(end, 1, 1)
            k = torch.randn(end, KV_HEADS, D, generator=g) * size * 0.05
            v = torch.randn(end, KV_HEADS, D, generator=g) * size * 0.05
            self.k_full.append(k)
            self.v_full.append(v)
            self.blocks.append(blocks)
            slots = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(end)]
            reference.reshape_and_cache(k[:cached], v[:cached], *self.caches[0], torch.tensor(slots[:cached]),
                                        kv_cache_dtype, self.k_scale, self.v_scale,
                                        *(self.scale_caches[0] if dynamic else ()))
            if window:  # the ring as the sequence left it: its newest computed positions and its sinks
                old = [p for p in range(cached) if p >= max(cached - window, floor) or p < sinks]
                ring_k, ring_v = self.ring_values(i, floor, torch.tensor(old, dtype=torch.long))
                reference.reshape_and_cache(ring_k, ring_v, *self.ring_caches[0],
                                            torch.tensor([window_slot(ring, p, window, BLOCK, sinks) for p in old],
                                                         dtype=torch.long), "auto", self.k_scale, self.v_scale)
            b = self.batch
            b.token_ids += [0] * fed
            b.positions += list(range(cached, end))
            b.slot_mapping += slots[cached:]
            if window:
                b.window_slot_mapping += [window_slot(ring, p, window, BLOCK, sinks)
                                          if p >= end - window or p < sinks else -1 for p in range(cached, end)]
            b.seqs.append(SeqChunk(fed, end, blocks, window_block_table=ring if window else [],
                                   window_floor=floor, num_draft_tokens=fed - 1 if fed == 1 + DRAFTS else 0))
            self.rows += [(i, blocks, ring, floor, p) for p in range(cached, end)]
            step_rows += [(i, p) for p in range(cached, end)]
        self.q = torch.randn(len(step_rows), HEADS, D, generator=g)
        self.k = torch.stack([self.k_full[i][p] for i, p in step_rows])
        self.v = torch.stack([self.v_full[i][p] for i, p in step_rows])

    def spec(self) -> KVCacheSpec:
        scales = None if self.dynamic else KVScales([self.k_scale], [self.v_scale], self.fmt, "test")
        return KVCacheSpec.build(self.fmt, torch.float32, BLOCK, 1, KV_HEADS, D, scales, window_size=self.window,
                                 window_dtype=torch.float32, dynamic=self.dynamic, window_sinks=self.sinks)

    def ring_values(self, i: int, floor: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of sequence i at `positions` as its ring holds them: computed ones (from the floor on) in full
        precision, the sinks below the floor as the FP8 cache holds them (the engine fills them so)."""
        k, v = self.k_full[i][positions].clone(), self.v_full[i][positions].clone()
        below = positions < floor
        if bool(below.any()):
            scale_caches = self.scale_caches[0] if self.dynamic else (None, None)
            k_fp8, v_fp8 = reference.gather_kv(*self.caches[0], torch.tensor(self.blocks[i]), floor, self.fmt,
                                               self.k_scale, self.v_scale, 0, *scale_caches)
            k[below], v[below] = k_fp8[positions[below]], v_fp8[positions[below]]
        return k, v

    def plain_decode(self, row: int) -> torch.Tensor:
        """Row `row` as one plain decode at its position, after the step wrote the FP8 cache: a fresh ring
        holding the full-precision K/V of exactly the positions plain decoding would keep there."""
        i, blocks, _, floor, p = self.rows[row]
        want = torch.empty(1, HEADS, D)
        table, seq_len = torch.tensor([blocks], dtype=torch.int32), torch.tensor([p + 1], dtype=torch.int32)
        scale_caches = self.scale_caches[0] if self.dynamic else ()
        if not self.window:
            reference.paged_attention(want, self.q[row][None], *self.caches[0], KV_HEADS, SCALE, table, seq_len,
                                      BLOCK, p + 1, None, self.fmt, self.k_scale, self.v_scale, 0, 0.0, None,
                                      *scale_caches)
            return want[0]
        ring_blocks = -(-(self.sinks + self.window) // BLOCK)
        ring_k, ring_v = reference.allocate_kv_cache(ring_blocks, BLOCK, KV_HEADS, D, "auto", torch.float32)
        start = max(p - self.window + 1, floor)
        kept = torch.cat([torch.arange(min(self.sinks, start)), torch.arange(start, p + 1)])
        reference.reshape_and_cache(*self.ring_values(i, floor, kept), ring_k, ring_v,
                                    reference.window_slots(list(range(ring_blocks)), kept, self.window, BLOCK,
                                                           self.sinks),
                                    "auto", self.k_scale, self.v_scale)
        reference.paged_attention_window(
            want, self.q[row][None], *self.caches[0], ring_k, ring_v, KV_HEADS, SCALE, table,
            torch.arange(ring_blocks, dtype=torch.int32)[None], seq_len, torch.tensor([start], dtype=torch.int32),
            self.window, BLOCK, p + 1, None, self.fmt, self.k_scale, self.v_scale, 0, 0.0, None,
            *(scale_caches or (None, None)), window_sinks=self.sinks)
        return want[0]


@pytest.mark.parametrize("use_compiled", [True, False], ids=["compiled", "reference"])
@pytest.mark.parametrize("kv_cache_dtype,window,dynamic,sinks", [
    ("fp8_e4m3", 0, False, 0),
    ("fp8_e5m2", 0, True, 0),
    ("fp8_e4m3", 8, False, 0),  # a window shorter than a block: the rows' scratch ring is filled position by position
    ("fp8_e5m2", 13, True, 0),
    ("fp8_e4m3", 16, False, 0),  # whole-block rings: the rows read a copy of their ring blocks, twice
    ("fp8_e5m2", 32, True, 0),
    ("fp8_e4m3", 8, False, 1),  # attention sinks: the rows' scratch ring holds them too
    ("fp8_e5m2", 13, True, 3),
    ("fp8_e4m3", 16, False, 1),  # sinks put the recent seats mid-block: no ring copy, a scratch ring
    ("fp8_e5m2", 32, True, 20),  # more sinks than a block, some below the window floor 32: FP8 there
])
def test_verify_rows_equal_plain_decodes(kv_cache_dtype, window, dynamic, sinks, use_compiled):
    case = Case(kv_cache_dtype, window, dynamic, sinks)
    ctx = forward_context.build_forward_context(
        case.batch, ops if use_compiled else reference, case.caches, case.spec(),
        window_caches=case.ring_caches, scale_caches=case.scale_caches)
    verify = [i for i, (_, _, fed) in enumerate(SEQS) if fed == 1 + DRAFTS]
    groups = {g.query_len: g for g in ctx.prefill_groups}
    assert sorted(groups) == [1 + DRAFTS, 9] and groups[1 + DRAFTS].seqs == verify  # one call for every verify chunk
    assert (groups[1 + DRAFTS].ring_blocks is not None) == (window in (16, 32) and not sinks)
    out = attention.attend(ctx, 0, case.q, case.k, case.v, SCALE)
    for row in range(len(case.rows)):
        assert attention_error(out[row], case.plain_decode(row)) <= 2e-5, case.rows[row][::4]
