"""Speculative decoding over the paged (FP8) cache: propose, verify in one step, accept, roll back.

Before each step every decoding sequence that may speculate gets up to K proposed tokens (ngram_proposer.py).
The scheduler feeds them after its last token: a chunk of 1 + K tokens attending to the cached context
through the same paged path as a chunked prefill, mixed with plain decodes and prefill chunks; the chunks of
all sequences are one attention call per layer (forward_context.PrefillGroup). The step returns logits at all
1 + K positions; spec_accept.py picks the emitted tokens (the accepted drafts and one more).

How many drafts a step verifies: on a CPU a step's linear layers cost about the same up to VERIFY_ROWS_CPU rows
(they stream the weights once) and then grow with the rows (compute-bound), so drafts pay only while the
verify step stays within that many rows: K per sequence is cut to VERIFY_ROWS_CPU // running - 1 (none at 16
running sequences). Above disable_by_batch_size running sequences nothing is proposed (vLLM's meaning).

Rejected tokens leave no trace: they are never counted as computed (so attention never reads their slots,
which the next steps overwrite, and the prefix cache never registers them), the blocks allocated only for
them are given back, and the recent-window ring slots they overwrote get their old K/V back
(window_rollback.py). A step with proposals runs synchronously: acceptance needs the logits on the host side.
On a GPU it waits for the device once (the drawn tokens; sampled drafts' probabilities and logprobs add one copy
each, for all sequences together) and runs eagerly, not from the decode CUDA graphs (model/runner.py).

Not speculated: sequences with a structured output grammar or penalties (their next row depends on the
previous token's value on the host), sequences still scoring their prompt, and proposals past max_tokens, the
length limit, or past min_tokens' edge (the stop-token ban must be the same at every verified row).
"""

from __future__ import annotations

import torch

from fp8cache.engine import spec_accept, window_rollback
from fp8cache.engine.logprobs import logprob_entries, score_prompt
from fp8cache.engine.ngram_proposer import NgramProposer
from fp8cache.engine.sampler import Sampler, has_penalties, to_device
from fp8cache.engine.scheduler import SchedulerOutput
from fp8cache.engine.sequence import Sequence
from fp8cache.engine.speculative_config import SpeculativeConfig
from fp8cache.model import window_slots

# Rows a CPU step's linears take for about the cost of one (default model, bfloat16, one thread, 16 sequences at
# ~300 tokens, recent window 32; ms per step for 1 + k rows each): 1 seq: 13.0 (k=0), 19.3 (k=4), 16.9 (k=8);
# 4 seqs: 16.8, 19.6 (k=2, 12 rows), 32.7 (k=4, 20 rows); 8 seqs: 21.0, 23.6 (k=1, 16 rows), 51.2 (k=4);
# 16 seqs: 21.4, 44.1 (k=1), 80.6 (k=4). The panel kernels take up to 16 rows in one pass over the weights.
VERIFY_ROWS_CPU = 16


class Speculation:
    def __init__(self, config: SpeculativeConfig, block_manager, runner, length_limit: int) -> None:
        self.config = config
        on_cpu = torch.device(getattr(runner, "device", "cpu")).type == "cpu"
        self.verify_rows = VERIFY_ROWS_CPU if on_cpu else None  # None: no cap (a GPU's step is memory-bound)
        self.proposer = NgramProposer(config)
        self.block_manager = block_manager
        self.runner = runner
        self.length_limit = length_limit
        self.window = block_manager.window_size
        self.num_draft_tokens = 0  # proposed tokens that were verified
        self.num_accepted_tokens = 0  # of those, accepted
        self.num_verify_steps = 0  # steps that verified at least one proposal

    # --- before schedule() -------------------------------------------------------------------------

    def propose(self, running: list[Sequence], eos_token_ids: set[int]) -> None:
        for seq in running:
            seq.draft_token_ids = []
        if len(running) > self.config.disable_by_batch_size:
            return  # a verify step of many sequences costs more than it gains (SpeculativeConfig)
        room = self.drafts_per_sequence(len(running))
        for seq in running:
            if _may_speculate(seq):
                seq.draft_token_ids = self.proposer.propose(seq, min(room, self._limit(seq, eos_token_ids)))

    def drafts_per_sequence(self, running: int) -> int:
        """K, cut so that a step of `running` sequences verifying as many drafts each stays within
        verify_rows rows."""
        k = self.config.num_speculative_tokens
        return k if self.verify_rows is None else max(0, min(k, self.verify_rows // max(running, 1) - 1))

    def _limit(self, seq: Sequence, eos_token_ids: set[int]) -> int:
        """The most drafts seq may verify now: the emitted tokens (drafts + 1) stay within max_tokens and the
        length limit, within the recent window's ring, and on one side of min_tokens."""
        p = seq.params
        limit = min(self.config.num_speculative_tokens, self.length_limit - seq.num_tokens - 1)
        if p.max_tokens is not None:
            limit = min(limit, p.max_tokens - seq.num_sampled_tokens - 1)
        if self.window:
            limit = min(limit, self.window - 1)
        bans = p.stop_token_ids or (eos_token_ids and not p.ignore_eos)
        if seq.num_sampled_tokens < p.min_tokens and bans:
            limit = min(limit, p.min_tokens - seq.num_sampled_tokens - 1)
        return limit

    # --- around the forward pass -------------------------------------------------------------------

    def save_window(self, plan: SchedulerOutput) -> tuple[list[int], object] | None:
        """Copies of the ring slots the step's drafts will overwrite (None without a recent window)."""
        if not self.window:
            return None
        slots = window_slots.draft_slots(plan.batch)  # the same slots every worker rank saves
        caches = self.runner.window_caches
        return slots, window_rollback.save_slots(caches, slots, self.block_manager.block_size)

    def verify(self, plan: SchedulerOutput, logits: torch.Tensor, sampler: Sampler, eos_token_ids: set[int],
               tokenizer, saved) -> tuple[list[Sequence], list[list[int]], list[list[dict | None]]]:
        """The sequences that emit tokens this step, their emitted tokens and logprobs; rejected drafts rolled
        back. Called after scheduler.on_step_done (which counted only the non-draft tokens as computed)."""
        spans, row = [], 0  # (seq, first logits row, number of drafts)
        for item, chunk in zip(plan.scheduled, plan.batch.seqs):
            if chunk.prompt_logits:
                score_prompt(item.seq, logits[row:row + chunk.query_len], chunk.context_len - chunk.query_len,
                             tokenizer)
                row += chunk.query_len
                if chunk.want_logits:
                    spans.append((item.seq, row - 1, 0))
            elif chunk.want_logits:
                spans.append((item.seq, row, chunk.num_draft_tokens))
                row += 1 + chunk.num_draft_tokens
        rows = [first + j for _, first, drafts in spans for j in range(drafts + 1)]
        row_seqs = [seq for seq, _, drafts in spans for _ in range(drafts + 1)]
        logits = _pick_rows(logits, rows)
        # One wait for the device a step: the drawn tokens (and the target probabilities of sampled drafts) come
        # to the host in one copy each, not one per sequence.
        drawn = sampler.sample(logits, row_seqs, eos_token_ids).cpu().tolist()
        probs = self._sampled_probs(spans, logits, sampler, eos_token_ids)
        emitted, keep, r = [], [], 0
        for seq, _, num_drafts in spans:
            rows_of_seq = slice(r, r + num_drafts + 1)
            tokens = self._accept(seq, num_drafts, drawn[rows_of_seq], probs.get(r), sampler)
            if num_drafts:
                self._roll_back(seq, num_drafts, len(tokens) - 1)
                keep += [j < len(tokens) - 1 for j in range(num_drafts)]
            emitted.append(tokens)
            r += num_drafts + 1
        entries = _logprobs(spans, logits, emitted, tokenizer)
        if saved is not None:
            slots, copies = saved
            window_rollback.restore_slots(self.runner.window_caches, slots, copies, keep,
                                          self.block_manager.block_size)
        self.num_verify_steps += 1
        return [seq for seq, _, _ in spans], emitted, entries

    @staticmethod
    def _sampled_probs(spans: list[tuple[Sequence, int, int]], logits: torch.Tensor, sampler: Sampler,
                       eos_token_ids: set[int]) -> dict[int, torch.Tensor]:
        """The target probabilities of the sampled (not greedy) sequences with drafts, on the host, by their first
        row in logits: computed on the device for all of them and copied to the host once."""
        rows, firsts, r = [], [], 0
        for seq, _, num_drafts in spans:
            if num_drafts and not seq.params.greedy:
                firsts.append((r, len(rows), num_drafts + 1))
                rows += [(seq, r + j) for j in range(num_drafts + 1)]
            r += num_drafts + 1
        if not rows:
            return {}
        picked = _pick_rows(logits, [row for _, row in rows])
        probs = sampler.target_probs(picked, [seq for seq, _ in rows], eos_token_ids).cpu()
        return {first: probs[at:at + n] for first, at, n in firsts}

    @staticmethod
    def _accept(seq: Sequence, num_drafts: int, drawn: list[int], probs: torch.Tensor | None,
                sampler: Sampler) -> list[int]:
        if not num_drafts:
            return drawn
        drafts = seq.draft_token_ids[:num_drafts]
        if seq.params.greedy:
            return spec_accept.accept_greedy(drafts, drawn)
        generator = seq.generator if seq.generator is not None else sampler.generator
        return spec_accept.accept_sampled(drafts, probs, generator)

    def _roll_back(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Count the accepted drafts as computed; give back the blocks only rejected ones needed."""
        seq.num_computed_tokens += num_accepted
        self.block_manager.trim(seq, seq.num_computed_tokens + 1)  # + 1: the emitted token fed next step
        seq.draft_token_ids = []
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        NgramProposer.observe(seq, num_accepted)


def _may_speculate(seq: Sequence) -> bool:
    return (seq.guide is None and not has_penalties(seq.params) and not seq.num_pending_tokens
            and seq.num_uncomputed_tokens == 1 and not seq.needs_prompt_logits)


def _pick_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits' rows (all of them when rows names each once in order: a step of decodes and verify chunks)."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, to_device(rows, torch.long, logits.device))


def _logprobs(spans: list[tuple[Sequence, int, int]], logits: torch.Tensor, emitted: list[list[int]],
              tokenizer) -> list[list[dict | None]]:
    """Per sequence, its emitted tokens' logprob entries (None each without logprobs), from one pass over the
    rows of every sequence that asks for them (a sequence's row j predicts its emitted token j)."""
    rows, tokens, tops, r = [], [], [], 0
    for (seq, _, num_drafts), emitted_of_seq in zip(spans, emitted):
        if seq.params.logprobs is not None:
            rows += range(r, r + len(emitted_of_seq))
            tokens += emitted_of_seq
            tops += [seq.params.logprobs] * len(emitted_of_seq)
        r += num_drafts + 1
    # On the host: a few rows, copied in one wait, instead of a wait for each of logprob_entries' reads.
    found = iter(logprob_entries(_pick_rows(logits, rows).cpu(), tokens, tops, tokenizer) if rows else [])
    return [[next(found) for _ in tokens_of_seq] if seq.params.logprobs is not None else [None] * len(tokens_of_seq)
            for (seq, _, _), tokens_of_seq in zip(spans, emitted)]
