"""Fixed-size KV blocks: a free list, reference counts, and a prefix cache keyed by block content.

A full block is known by a hash chained over (previous block's hash, its token ids, the cache
fingerprint). The fingerprint changes whenever the runner's scales change, so a block is shared only
when its bytes mean the same thing. Sequences with the same prefix point at the same blocks (no copy).
A block whose last user leaves keeps its hash and stays findable until the allocator reuses it; the
free list is LRU, so the blocks freed longest ago go first.

Sharing covers only blocks that are already computed: a block is registered after the step that filled
it. A sequence never writes into a block it shares, because the cached prefix it takes stops short of
its last token (that token must be fed again so that its logits exist).

When every attention layer slides within a window of W positions (Mistral; released_window=W), the blocks of a
running sequence that end more than W positions (and one block of slack, for a step still on the device) before
its next position are given back as it goes: its table keeps -1 in their place, which the attention ops never
read (they start at the window). A model that mixes in full-attention layers (Gemma 2/3, gpt-oss) keeps every
block, since those layers read the whole context.

With a recent-token window (kv_recent_window N > 0) sharing covers only the old, quantized part of a prompt:
a hit stops at the last block boundary at least N tokens before the prompt's end, so a shared prefix that
reaches into the newest N tokens is partly recomputed, and one shorter than N gives no hit at all.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from fp8cache.engine.sequence import Sequence
from fp8cache.engine.window_pool import WindowPool


class Block:
    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set while this block is the prefix cache's entry for `hash`
        self.token_ids: tuple[int, ...] = ()  # guards against a hash collision


def block_hash(prev_hash: int | None, token_ids: list[int], fingerprint: str) -> int:
    data = repr((prev_hash, fingerprint, tuple(token_ids))).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_fingerprint: str = "", window: WindowPool | None = None, released_window: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_fingerprint = cache_fingerprint
        self.window = window  # recent-token window seats (kv_recent_window > 0), else None
        self.released_window = released_window  # every layer's sliding window (0: keep every block)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU
        self.hash_to_block_id: dict[int, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found in the cache

    # --- counts ------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody uses, including cached ones that can be evicted."""
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    @property
    def window_size(self) -> int:
        return self.window.window_size if self.window else 0

    @property
    def window_sinks(self) -> int:
        return self.window.window_sinks if self.window else 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests and debugging)."""
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert all(b.ref_count >= 0 for b in self.blocks), "negative ref count"
        assert used + self.num_free_blocks == self.num_blocks, "a block is both used and free, or neither"
        assert all(self.blocks[i].ref_count == 0 for i in self.free_block_ids), "a used block is on the free list"
        for h, i in self.hash_to_block_id.items():
            assert self.blocks[i].hash == h, "prefix cache points at a block that lost its hash"

    # --- prefix cache ------------------------------------------------------------------------------

    def set_fingerprint(self, fingerprint: str) -> None:
        self.cache_fingerprint = fingerprint

    def _full_block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Hashes of the first `num_blocks` full blocks of seq.token_ids (cached on the sequence)."""
        if seq.hash_fingerprint != self.cache_fingerprint:
            seq.block_hashes, seq.hash_fingerprint = [], self.cache_fingerprint
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None, seq.token_ids[i * bs:(i + 1) * bs],
                                     self.cache_fingerprint))
        return hashes[:num_blocks]

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Ids of cached blocks holding seq's leading tokens; changes nothing.

        Stops before the block holding the last token: that token is always fed again for its logits.
        With a recent-token window of N it also stops N tokens before the end: cached blocks hold only FP8
        K/V, so the newest N tokens are computed again and enter the sequence's full-precision window.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(seq) - 1) // self.block_size
        if self.window:
            max_blocks = min(max_blocks, max(len(seq) - self.window.window_size, 0) // self.block_size)
        found = []
        for i, h in enumerate(self._full_block_hashes(seq, max_blocks)):
            block_id = self.hash_to_block_id.get(h)
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        return found

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Offer seq's blocks that are now full and computed to the prefix cache."""
        # Only blocks whose token ids are all on the host: a computed position may hold a pending token.
        num_full = min(min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size, len(seq.block_table))
        if not self.enable_prefix_caching or num_full <= seq.num_registered_blocks:
            return
        hashes = self._full_block_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            if seq.block_table[i] < 0:
                continue  # given back before it could be offered
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.hash_to_block_id:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                self.hash_to_block_id[block.hash] = block.block_id
            # else: an equal block is cached already (two sequences computed it at once); keep that one.
        seq.num_registered_blocks = num_full

    # --- allocation --------------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Whether seq can take `cached_block_ids` (from lookup_prefix) and room for `num_new_tokens`
        more tokens after its computed ones."""
        if not cached_block_ids and (seq.window_block_table or not self.window) \
                and seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
            return True  # most decode steps: the tokens fit the blocks it has
        num_computed = seq.num_computed_tokens + len(cached_block_ids) * self.block_size
        new_blocks = self.blocks_needed(num_computed + num_new_tokens) - len(seq.block_table) \
            - len(cached_block_ids)
        revived = sum(1 for i in cached_block_ids if self.blocks[i].ref_count == 0)
        if self.window and not seq.window_block_table and not self.window.num_free_seats:
            return False
        return max(new_blocks, 0) + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] = ()) -> None:
        """Give seq the cached blocks (they count as computed) and enough blocks for num_new_tokens more."""
        if not self.can_allocate(seq, num_new_tokens, cached_block_ids):
            raise RuntimeError(f"not enough free KV blocks for {seq}; call can_allocate first")
        if cached_block_ids:
            assert seq.num_computed_tokens == len(seq.block_table) * self.block_size, \
                "cached blocks can only extend a block-aligned computed prefix"
            for block_id in cached_block_ids:
                self._take(block_id)
                seq.block_table.append(block_id)
            cached_tokens = len(cached_block_ids) * self.block_size
            seq.num_computed_tokens += cached_tokens
            seq.num_cached_tokens += cached_tokens
            seq.num_registered_blocks = len(seq.block_table)
        if self.window and not seq.window_block_table:
            self.window.take(seq)
            # Cached blocks hold only FP8 K/V: the window fills from the first token this sequence computes.
            seq.window_floor = seq.num_computed_tokens
        self.append(seq, num_new_tokens)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to hold num_new_tokens tokens after its computed ones."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"not enough free KV blocks for {seq}; call can_allocate first")
        for _ in range(needed):
            block_id = next(iter(self.free_block_ids))
            self._evict(block_id)
            self._take(block_id)
            seq.block_table.append(block_id)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's tail blocks beyond the first num_tokens positions (rejected speculative tokens' blocks;
        never registered, they go to the front of the free list, to be reused first)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            self._release(block_id, seq)
            if block_id in self.free_block_ids:
                self.free_block_ids.move_to_end(block_id, last=False)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Cached ones stay findable until reused. Safe to call twice."""
        # Tail blocks first, so that they are evicted before the prefix blocks others may share.
        for block_id in reversed(seq.block_table):
            if block_id >= 0:
                self._release(block_id, seq)
        seq.block_table = []
        seq.num_released_blocks = 0
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        if self.window:
            self.window.release(seq)
        seq.window_floor = 0

    def release_behind_window(self, seq: Sequence) -> None:
        """Give back seq's blocks that no layer reads again: with every layer's window W, the next position p
        reads from p - W + 1 on; a block ending before p - W - block_size is past it, with one block of slack
        for the step still running on the device (it read positions up to a block earlier)."""
        if not self.released_window:
            return
        first_read = seq.num_computed_tokens - self.released_window - self.block_size
        behind = min(max(first_read, 0) // self.block_size, len(seq.block_table))
        for i in range(seq.num_released_blocks, behind):
            if seq.block_table[i] >= 0:
                self._release(seq.block_table[i], seq)
                seq.block_table[i] = -1
        seq.num_released_blocks = max(seq.num_released_blocks, behind)

    def _release(self, block_id: int, seq: Sequence) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {block_id} by {seq}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = None, ()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that nobody uses (e.g. after the scales changed)."""
        for block_id in self.free_block_ids:
            self._evict(block_id)
