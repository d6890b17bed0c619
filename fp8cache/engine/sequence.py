"""One generated continuation: its tokens, how many of them are in the KV cache, its blocks, its text.

A request with n > 1 becomes n sequences that share the prompt. Prefill, chunked prefill, decode and the
recompute after preemption are all one thing here: feed the tokens in [num_computed_tokens, len) and,
when a step reaches the end, sample one more.

With the overlapped loop (llm_engine.py) a sampled token may still be on the device: it counts in
num_pending_tokens, not in token_ids, until its step's tokens reach the host. The scheduler feeds it from the
device (pending_row: its row in that step's sampled tokens); everything that reads token values sees only
token_ids.
"""

from __future__ import annotations

import enum
import itertools

import torch

from fp8cache.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: int = 0) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n outputs this is
        self.params = params
        self.arrival = arrival  # FCFS order; preemption picks the latest
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in this sequence's blocks
        self.num_pending_tokens = 0  # sampled on the device, not yet in token_ids (the overlapped loop)
        self.pending_row: int | None = None  # the newest pending token's row in its step's sampled tokens
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache at admission
        self.block_table: list[int] = []  # -1: a block given back behind every layer's sliding window
        self.num_released_blocks = 0  # leading block_table entries given back (BlockManager.release_behind_window)
        self.block_hashes: list[int] = []  # hashes of the full blocks of token_ids, filled lazily
        self.hash_fingerprint: str | None = None  # the cache fingerprint block_hashes were made with
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.window_block_table: list[int] = []  # full-precision ring of the newest tokens (kv_recent_window)
        self.window_floor = 0  # first position computed by this sequence (older: prefix cache, FP8 only)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generator = _generator(params, index)
        self.guide = None  # with params.structured_outputs: its SequenceGuide (set by the engine)
        # Speculative decoding (ngram_proposer.py): this step's proposed tokens, and the back-off state.
        self.draft_token_ids: list[int] = []
        self.spec_skip = 0  # steps left without proposals
        self.spec_misses = 0  # proposals in a row whose first token was rejected
        self.logprobs: list[dict] = []  # with params.logprobs: one dict of Logprob per output token
        # With params.prompt_logprobs, on the request's first sequence (its siblings share the prompt): one
        # entry per prompt token scored so far, None for the first.
        self.prompt_logprobs: list[dict | None] = [None] if params.prompt_logprobs is not None and index == 0 else []
        self.cumulative_logprob = 0.0
        # Incremental detokenization state (see detokenizer.py).
        self.output_text = ""
        self.prefix_offset = max(self.num_prompt_tokens - 5, 0)
        self.read_offset = self.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}#{self.index}, len={len(self)}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Its length with the tokens still on the device: what the scheduler and the sampler count."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens so far, those still on the device included."""
        return self.num_output_tokens + self.num_pending_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether its prompt still has tokens to score: its steps then return logits at every position, and
        it is not admitted from the prefix cache (cached tokens are not computed)."""
        return 0 < len(self.prompt_logprobs) < self.num_prompt_tokens

    def append_token(self, token_id: int, logprobs: dict | None = None) -> None:
        """logprobs: this step's Logprob per token id (logprobs.py), when the request asked for them."""
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id].logprob

    def visible_text(self) -> str:
        """The text a client may see now: while running, hold back a tail that could still turn out to
        be the start of a stop string (it would be cut off later)."""
        if self.is_finished or not self.params.stop_strings:
            return self.output_text
        hold = max(len(s) for s in self.params.stop_strings) - 1
        return self.output_text[:max(len(self.output_text) - hold, 0)]


def _generator(params: SamplingParams, index: int) -> torch.Generator | None:
    # Siblings of one seeded request get different streams, else n > 1 would give n copies.
    if params.seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed((params.seed + index) % (2**63))
    return gen
