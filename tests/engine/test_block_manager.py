"""Block manager: ref counts, prefix-cache hits, LRU eviction, invariants, no leaks.

The reference is a model of the cache contents: every "computed" token is written into a slot array,
and a sequence's block table must read back exactly its own tokens, shared blocks included.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8cache.engine.block_manager import BlockManager
from fp8cache.engine.sampling_params import SamplingParams
from fp8cache.engine.sequence import Sequence

BS = 4


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams())


class CacheModel:
    """Slot contents, to check what block tables point at."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: list[int | None] = [None] * (bm.num_blocks * bm.block_size)

    def compute(self, seq: Sequence, num_tokens: int) -> None:
        """What a model step does: write the K/V (here: the token id) of the next num_tokens tokens."""
        bm = self.bm
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + num_tokens):
            block = seq.block_table[p // bm.block_size]
            assert bm.blocks[block].ref_count == 1 or bm.blocks[block].hash is None, \
                "a sequence wrote into a shared, cached block"
            self.slots[block * bm.block_size + p % bm.block_size] = seq.token_ids[p]
        seq.num_computed_tokens += num_tokens
        bm.register_computed_blocks(seq)

    def read(self, seq: Sequence) -> list[int | None]:
        bs = self.bm.block_size
        return [self.slots[seq.block_table[p // bs] * bs + p % bs] for p in range(seq.num_computed_tokens)]

    def admit(self, seq: Sequence) -> int:
        """Admit seq with its cached prefix and compute the rest; returns the cached token count."""
        cached = self.bm.lookup_prefix(seq)
        num_new = len(seq) - len(cached) * self.bm.block_size
        self.bm.allocate(seq, num_new, cached)
        self.compute(seq, num_new)
        assert self.read(seq) == seq.token_ids
        return len(cached) * self.bm.block_size


def ref_counts_from_tables(bm: BlockManager, seqs: list[Sequence]) -> list[int]:
    counts = [0] * bm.num_blocks
    for s in seqs:
        for b in s.block_table:
            counts[b] += 1
    return counts


def test_allocate_append_free_counts_and_no_leak():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(10)))
    assert bm.can_allocate(seq, 10)
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    seq.num_computed_tokens = 10
    seq.append_token(99)
    seq.append_token(98)
    bm.append(seq, 2)  # 12 tokens still fit in 3 blocks
    assert len(seq.block_table) == 3
    seq.num_computed_tokens = 12
    seq.append_token(97)
    bm.append(seq, 1)
    assert len(seq.block_table) == 4
    bm.check_invariants()
    bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8
    bm.free(seq)  # a second free of the same sequence releases nothing more
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_can_allocate_refuses_and_allocate_raises_when_full():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq(list(range(9)))  # needs 3 blocks
    assert not bm.can_allocate(seq, 9)
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.allocate(seq, 9)
    assert bm.num_free_blocks == 2 and seq.block_table == []


def test_prefix_hit_shares_blocks_and_counts():
    bm = BlockManager(num_blocks=16, block_size=BS)
    cache = CacheModel(bm)
    a = make_seq(list(range(100, 111)))  # 11 tokens: 2 full blocks + 3
    assert cache.admit(a) == 0
    b = make_seq(list(range(100, 108)) + [7, 7, 7])  # shares the 2 full blocks
    assert cache.admit(b) == 2 * BS
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.record_prefix_query(len(b), 2 * BS)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (11, 8)
    assert [blk.ref_count for blk in bm.blocks] == ref_counts_from_tables(bm, [a, b])
    bm.free(a)
    assert cache.read(b) == b.token_ids  # b's shared blocks survive a's free
    bm.free(b)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_freed_blocks_stay_cached_and_last_token_is_always_recomputed():
    bm = BlockManager(num_blocks=16, block_size=BS)
    cache = CacheModel(bm)
    a = make_seq(list(range(8)))  # exactly 2 full blocks
    cache.admit(a)
    bm.free(a)
    assert bm.num_used_blocks == 0
    same = make_seq(list(range(8)))
    # Only the first block is taken: the block with the last token is recomputed for its logits.
    assert cache.admit(same) == BS
    longer = make_seq(list(range(9)))
    assert cache.admit(longer) == 2 * BS


def test_lru_eviction_drops_oldest_cached_blocks_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    cache = CacheModel(bm)
    old_prompt, new_prompt = [1] * BS + [2], [3] * BS + [4]
    for prompt in (old_prompt, new_prompt):
        seq = make_seq(prompt)
        cache.admit(seq)
        bm.free(seq)
    filler = make_seq([9] * (2 * BS))
    bm.allocate(filler, 2 * BS)  # never-used blocks go before cached ones
    assert len(bm.lookup_prefix(make_seq(old_prompt))) == 1
    assert len(bm.lookup_prefix(make_seq(new_prompt))) == 1
    bm.free(filler)
    evicting = make_seq([8] * (3 * BS))  # takes 3 of the 4 free blocks: the one cached last survives
    bm.allocate(evicting, 3 * BS)
    bm.check_invariants()
    assert bm.lookup_prefix(make_seq(old_prompt)) == []
    assert len(bm.lookup_prefix(make_seq(new_prompt))) == 1


def test_eviction_removes_hash_so_reuse_misses():
    bm = BlockManager(num_blocks=2, block_size=BS)
    cache = CacheModel(bm)
    a = make_seq([5] * (BS + 1))
    cache.admit(a)
    bm.free(a)
    other = make_seq([6] * (2 * BS))
    bm.allocate(other, 2 * BS)  # needs both blocks: a's cached one is evicted
    assert bm.hash_to_block_id == {}
    bm.free(other)
    assert bm.lookup_prefix(make_seq([5] * (BS + 1))) == []


def test_fingerprint_change_and_disabled_caching_never_hit():
    bm = BlockManager(num_blocks=8, block_size=BS, cache_fingerprint="scales-1")
    cache = CacheModel(bm)
    a = make_seq(list(range(9)))
    cache.admit(a)
    bm.free(a)
    assert len(bm.lookup_prefix(make_seq(list(range(9))))) == 2
    bm.set_fingerprint("scales-2")
    assert bm.lookup_prefix(make_seq(list(range(9)))) == []
    off = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    cache_off = CacheModel(off)
    a = make_seq(list(range(9)))
    cache_off.admit(a)
    off.free(a)
    assert off.lookup_prefix(make_seq(list(range(9)))) == [] and off.hash_to_block_id == {}


def test_reviving_a_cached_free_block_counts_against_free_blocks():
    bm = BlockManager(num_blocks=3, block_size=BS)
    cache = CacheModel(bm)
    a = make_seq([1] * (2 * BS + 1))
    cache.admit(a)
    bm.free(a)
    b = make_seq([1] * (2 * BS + 1))
    cached = bm.lookup_prefix(b)
    assert len(cached) == 2
    assert bm.can_allocate(b, 1, cached)  # 2 revived + 1 new == 3 free
    assert not bm.can_allocate(b, BS + 1, cached)  # would need 2 new
    bm.allocate(b, 1, cached)
    assert bm.num_free_blocks == 0
    bm.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(1, 9)), min_size=1, max_size=40))
def test_random_operations_keep_contents_and_invariants(ops):
    """Random admits (with shared prefixes), growth and frees; contents always read back right."""
    bm = BlockManager(num_blocks=10, block_size=BS)
    cache = CacheModel(bm)
    live: list[Sequence] = []
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [4, 3, 2, 1]]
    for kind, pick, length in ops:
        if kind == 0:  # admit a new sequence built on one of a few prefixes
            seq = make_seq(prefixes[pick % 3] + [pick] * length)
            cached = bm.lookup_prefix(seq)
            num_new = len(seq) - len(cached) * BS
            if bm.can_allocate(seq, num_new, cached):
                cache.admit(seq)
                live.append(seq)
        elif kind == 1 and live:  # a decode step: one more token
            seq = live[pick % len(live)]
            seq.append_token(length)
            if bm.can_allocate(seq, 1):
                bm.append(seq, 1)
                cache.compute(seq, 1)
            else:
                seq.token_ids.pop()
        elif kind == 2 and live:
            bm.free(live.pop(pick % len(live)))
        bm.check_invariants()
        assert [b.ref_count for b in bm.blocks] == ref_counts_from_tables(bm, live)
        for seq in live:
            assert cache.read(seq) == seq.token_ids
    for seq in live:
        bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks


def test_blocks_behind_every_layers_window_are_given_back_and_the_rest_read_back():
    """released_window W: a block ending more than W positions and a block before the next position is given
    back (its table entry -1); the positions any later query reads (the last W) still read back right."""
    window = 6
    bm = BlockManager(num_blocks=6, block_size=BS, released_window=window)
    cache = CacheModel(bm)
    seq = make_seq(list(range(100, 105)))
    cache.admit(seq)
    for t in range(60):  # 65 tokens in a cache of 24 slots: only possible by giving blocks back
        bm.release_behind_window(seq)
        seq.append_token(t)
        bm.append(seq, 1)
        cache.compute(seq, 1)
        bm.check_invariants()
        n = seq.num_computed_tokens
        given_back = [i for i, b in enumerate(seq.block_table) if b < 0]
        assert all((i + 1) * BS <= n - window - BS for i in given_back)  # never one a later query reads
        assert len(seq.block_table) - len(given_back) <= -(-(window + 2 * BS) // BS) + 1
        bs = BS
        recent = [cache.slots[seq.block_table[p // bs] * bs + p % bs] for p in range(n - window, n)]
        assert recent == seq.token_ids[n - window:n]
    assert seq.block_table[0] == -1 and seq.num_released_blocks > 10
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks and seq.block_table == []
    bm.check_invariants()


def test_a_shared_block_given_back_by_one_sequence_stays_with_the_other():
    bm = BlockManager(num_blocks=16, block_size=BS, released_window=BS)
    cache = CacheModel(bm)
    a = make_seq(list(range(100, 100 + 5 * BS + 1)))
    cache.admit(a)
    b = make_seq(list(range(100, 100 + 5 * BS)) + [7])
    assert cache.admit(b) == 5 * BS
    shared = a.block_table[0]
    bm.release_behind_window(a)
    assert a.block_table[0] == -1 and b.block_table[0] == shared
    assert bm.blocks[shared].ref_count == 1 and shared not in bm.free_block_ids
    bm.check_invariants()
    bm.free(b)
    assert shared in bm.free_block_ids  # the last user gone: free, and still findable in the prefix cache
    assert bm.lookup_prefix(make_seq(list(range(100, 100 + 2 * BS)) + [1]))[:1] == [shared]
    bm.free(a)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_no_window_keeps_every_block():
    bm = BlockManager(num_blocks=16, block_size=BS)
    seq = make_seq(list(range(40)))
    CacheModel(bm).admit(seq)
    bm.release_behind_window(seq)
    assert -1 not in seq.block_table and bm.num_used_blocks == 10
