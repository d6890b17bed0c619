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


@dataclass
class StepBatch:
    token_ids: list[int] = field(default_factory=list)  # packed: seq 0's tokens, then seq 1's, ...
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)  # block * block_size + offset per token
    seqs: list[SeqChunk] = field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        return all(s.query_len == 1 for s in self.seqs)
