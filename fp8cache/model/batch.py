"""What the scheduler hands the model runner for one step: all sequences packed as one token stream."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SeqChunk:
    """One sequence's share of a step.

    The step feeds `query_len` new tokens; before the step `context_len - query_len` tokens of this
    sequence are already in the cache (a cached prefix or earlier chunks). After the step the cache holds
    `context_len` tokens. Decode is query_len == 1.
    """

    query_len: int
    context_len: int
    block_table: list[int]  # block ids covering positions [0, context_len)
    want_logits: bool = True  # False for a prefill chunk that does not reach the prompt's end
    prompt_logits: bool = False  # logits at every fed position (prompt logprobs), the last one included
    # Recent-token window (kv_recent_window > 0): the sequence's ring of window blocks, and the first position
    # it computed itself (older ones came from the prefix cache and exist only in FP8).
    window_block_table: list[int] = field(default_factory=list)
    window_floor: int = 0
    # Speculative decoding: the last num_draft_tokens fed tokens are proposals to verify; the step returns
    # logits at each of them and at the token before them (query_len = 1 + num_draft_tokens).
    num_draft_tokens: int = 0


@dataclass
class StepBatch:
    token_ids: list[int] = field(default_factory=list)  # packed: seq 0's tokens, then seq 1's, ...
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)  # block * block_size + offset per token
    seqs: list[SeqChunk] = field(default_factory=list)
    window_slot_mapping: list[int] = field(default_factory=list)  # ring slot per token, -1 outside the window
    # Tokens whose value is still on the device (the overlapped loop): token_ids[future_rows[i]] is a placeholder
    # for row future_src[i] of the previous step's sampled tokens, which the runner copies in on the device.
    future_rows: list[int] = field(default_factory=list)
    future_src: list[int] = field(default_factory=list)

    @property
    def num_draft_tokens(self) -> int:
        return sum(s.num_draft_tokens for s in self.seqs)

    @property
    def is_decode_only(self) -> bool:
        return all(s.query_len == 1 for s in self.seqs)


def window_slot(window_block_table: list[int], position: int, window_size: int, block_size: int,
                window_sinks: int = 0) -> int:
    """Where `position` lives in a sequence's window ring: the attention sinks (positions below window_sinks) at
    seats of their own, the others at seat window_sinks + position % window_size."""
    seat = position if position < window_sinks else window_sinks + position % window_size
    return window_block_table[seat // block_size] * block_size + seat % block_size


def in_window_ring(position: int, chunk_end: int, window_size: int, window_sinks: int) -> bool:
    """Whether a chunk ending before chunk_end writes `position` to the ring: one of its last window_size
    positions, or an attention sink."""
    return position >= chunk_end - window_size or position < window_sinks
