"""Continuous batching: each step picks which sequences feed how many tokens, within a token budget.

Order within a step: running decodes first (latency), then running prefills that are partway through
(chunked prefill), then waiting sequences in arrival order while budget, seats (max_num_seqs) and
blocks last. A prompt longer than the leftover budget is split; only the chunk that reaches its end
asks for logits. When blocks run out the latest-arrived running sequence is preempted by recompute:
its blocks are freed and it goes back to the front of the queue with everything it generated so far
as prompt, so nothing is lost or repeated (its sampler state lives on the sequence).

Overlapped loop (llm_engine.py): the next step is scheduled while the previous one still runs on the device,
so a sequence may hold a pending token (sampled, not yet on the host). It is scheduled as a decode whose input
id the runner takes from the device (StepBatch.future_rows); one whose pending token is certainly its last
(max_tokens or the length limit) is left out, so no step ever runs past a limit. A stop that only the token's
value shows (eos, stop ids, stop strings) is seen a step late: the engine drops that extra token.

Speculative decoding: a decode whose sequence holds proposed tokens (Sequence.draft_token_ids, set by the
engine before schedule()) feeds them after its last token, a chunk of 1 + K tokens over its cached context,
when the budget and the free blocks allow; else it decodes plainly. Drafts are not counted as computed here:
the engine adds those it accepts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fp8cache.engine.block_manager import BlockManager
from fp8cache.engine.sequence import Sequence, SequenceStatus
from fp8cache.model.batch import SeqChunk, StepBatch, in_window_ring, window_slot


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # fed tokens, drafts included
    num_draft_tokens: int = 0  # speculative decoding: the last fed tokens are seq.draft_token_ids[:this]

    @property
    def reaches_end(self) -> bool:
        return self.seq.num_computed_tokens + self.num_new_tokens - self.num_draft_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    batch: StepBatch
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_seq_len: int | None = None) -> None:
        """max_seq_len: the length at which a sequence finishes ("length"), when the engine has one."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must both be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_seq_len = max_seq_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefill_tokens_computed = 0  # fed tokens of steps that were not plain decodes
        self.num_cached_prompt_tokens = 0  # tokens taken from the prefix cache instead of computed

    # --- queues ------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> list[Sequence]:
        """Drop every sequence of the request and free its blocks now."""
        dropped = [s for s in self.running if s.request_id == request_id]
        dropped += [s for s in self.waiting if s.request_id == request_id]
        for seq in dropped:
            self.finish(seq, "abort")
        return dropped

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    # --- one step ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        runnable = [s for s in self.running if not self._last_token_pending(s)]
        decodes = [s for s in runnable if s.num_uncomputed_tokens == 1]
        queue = deque(decodes + [s for s in runnable if s.num_uncomputed_tokens > 1])
        num_preempted = 0
        while queue and budget > 0:
            seq = queue.popleft()
            num_drafts = self._drafts_that_fit(seq, budget)
            num_new = min(seq.num_uncomputed_tokens + num_drafts, budget)
            while not self.block_manager.can_allocate(seq, num_new):
                victim = max([seq, *queue], key=lambda s: s.arrival)
                if victim is not seq:
                    queue.remove(victim)
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.block_manager.append(seq, num_new)
            scheduled.append(ScheduledSeq(seq, num_new, num_drafts))
            budget -= num_new
        if not num_preempted:  # admitting new work right after running out of blocks would thrash
            budget = self._admit_waiting(budget, scheduled)
        return SchedulerOutput(scheduled, self._build_batch(scheduled), num_preempted)

    def _drafts_that_fit(self, seq: Sequence, budget: int) -> int:
        """How many of seq's proposed tokens this step verifies: all, when it is a decode and the budget and the
        free blocks take them (else none: proposals never preempt anything)."""
        drafts = len(seq.draft_token_ids)
        if not drafts or seq.num_uncomputed_tokens != 1 or seq.num_pending_tokens:
            return 0
        if 1 + drafts > budget or not self.block_manager.can_allocate(seq, 1 + drafts):
            return 0
        return drafts

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        bm = self.block_manager
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.num_pending_tokens:
                continue  # preempted this step with a token on its way: recomputed once the token is here
            if self._sibling_is_prefilling(seq):
                continue  # it will find the shared prompt in the prefix cache a step later
            cached = [] if seq.needs_prompt_logits else bm.lookup_prefix(seq)
            num_new = min(len(seq) - len(cached) * bm.block_size, budget)
            if not bm.can_allocate(seq, num_new, cached):
                break
            bm.allocate(seq, num_new, cached)
            bm.record_prefix_query(len(seq), len(cached) * bm.block_size)
            self.num_cached_prompt_tokens += len(cached) * bm.block_size
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return budget

    def _sibling_is_prefilling(self, seq: Sequence) -> bool:
        if seq.index == 0 or not self.block_manager.enable_prefix_caching:
            return False
        return any(s.request_id == seq.request_id and s.num_computed_tokens < s.num_prompt_tokens
                   for s in self.running)

    def _last_token_pending(self, seq: Sequence) -> bool:
        """Whether seq's pending token will end it by length whatever its value (it must not be fed)."""
        if not seq.num_pending_tokens:
            return False
        max_tokens = seq.params.max_tokens
        return (max_tokens is not None and seq.num_sampled_tokens >= max_tokens) \
            or (self.max_seq_len is not None and seq.num_tokens >= self.max_seq_len)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _build_batch(self, scheduled: list[ScheduledSeq]) -> StepBatch:
        batch = StepBatch()
        bs, window, sinks = self.block_manager.block_size, self.block_manager.window_size, self.block_manager.window_sinks
        for item in scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            known = len(seq.token_ids)
            batch.token_ids.extend(seq.token_ids[start:end - item.num_draft_tokens])
            batch.token_ids.extend(seq.draft_token_ids[:item.num_draft_tokens])
            if end - item.num_draft_tokens > known:  # its pending token: the runner copies it in from the previous step's tokens
                assert end == known + 1 and seq.pending_row is not None, f"{seq}: no pending token to feed"
                batch.future_rows.append(len(batch.token_ids))
                batch.future_src.append(seq.pending_row)
                batch.token_ids.append(0)
            table = seq.block_table
            if n == 1:  # a decode: one position, one slot
                batch.positions.append(start)
                batch.slot_mapping.append(table[start // bs] * bs + start % bs)
            else:
                batch.positions.extend(range(start, end))
                batch.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if window:
                batch.window_slot_mapping.extend(window_slot(seq.window_block_table, p, window, bs, sinks)
                                                 if in_window_ring(p, end, window, sinks) else -1
                                                 for p in range(start, end))
            # The ring's list is only ever replaced, never changed in place: the chunk may share it.
            batch.seqs.append(SeqChunk(query_len=n, context_len=end, block_table=table[:-(-end // bs)],
                                       want_logits=item.reaches_end, prompt_logits=seq.needs_prompt_logits,
                                       window_block_table=seq.window_block_table, window_floor=seq.window_floor,
                                       num_draft_tokens=item.num_draft_tokens))
            if n - item.num_draft_tokens > 1 or seq.num_sampled_tokens == 0:
                self.num_prefill_tokens_computed += n
        return batch

    def on_step_done(self, scheduled: list[ScheduledSeq]) -> None:
        """Mark the fed tokens as computed and offer newly full blocks to the prefix cache. Called once the step
        is queued on the device: any step that reads those K/V is queued after it."""
        for item in scheduled:  # drafts count once verified (the engine's acceptance)
            item.seq.num_computed_tokens += item.num_new_tokens - item.num_draft_tokens
        self.register_blocks([item.seq for item in scheduled])
        for item in scheduled:
            self.block_manager.release_behind_window(item.seq)

    def register_blocks(self, seqs: list[Sequence]) -> None:
        """Offer the full computed blocks to the prefix cache whose token ids are all on the host (a block is
        known by them): a block that ends in a pending token waits for the step that reads that token."""
        for seq in seqs:
            if not seq.is_finished:
                self.block_manager.register_computed_blocks(seq)
