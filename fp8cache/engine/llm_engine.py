"""The engine loop: requests in, one scheduled model step at a time, RequestOutputs out.

add_request and abort_request may be called from any thread (the HTTP server's); they only validate
and drop a message in an inbox under a lock. step() drains the inbox, then schedules, runs the model,
samples and detokenizes without holding the lock, so one thread must own step().

The decode loop overlaps the host with the device (on by default where the device runs asynchronously, a GPU;
docs/design.md section 1, "The overlapped decode loop"): step() schedules step N+1, builds its metadata and
queues its forward pass and sampling, and only then reads step N's tokens (TokenReadback, inflight.py) and
runs N's stop checks and detokenization while N+1 runs. N+1 takes N's tokens on the device. So step() returns
the progress of the step before the one it launched; a stop that N's token value shows is seen after N+1 was
queued, and the extra token that sequence gets from N+1 is dropped. Batches with a sequence whose sampling
needs its newest token on the host (structured outputs, penalties) or whose logprobs are read run as one
synchronous step, as do all steps with overlap off and with tensor parallelism.

With a speculative_config (spec_decode.py) each step first gives decoding sequences proposed tokens; a step
that verifies some runs synchronously and hands each sequence its accepted tokens and one more, appended and
stop-checked one at a time. The overlapped loop is off then. With tensor parallelism only rank 0 proposes and
accepts; the other ranks run the verify step as any batch and repair their recent window as rank 0 tells them
(window_rollback.py).

Length limits: a prompt longer than max_model_len, or longer than the whole KV cache holds, is refused
by add_request with ValueError. A sequence that reaches either limit while generating finishes with
finish_reason "length".
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8cache.config import EngineConfig
from fp8cache.engine.block_manager import BlockManager
from fp8cache.engine.detokenizer import check_stops
from fp8cache.engine.inflight import InFlightStep, TokenReadback
from fp8cache.engine.logprobs import score_prompt, token_logprobs
from fp8cache.engine.outputs import CompletionOutput, RequestOutput
from fp8cache.engine.sampler import Sampler, reads_host_history
from fp8cache.engine.sampling_params import SamplingParams
from fp8cache.engine.scheduler import Scheduler, SchedulerOutput
from fp8cache.engine.sequence import Sequence
from fp8cache.engine.spec_decode import Speculation
from fp8cache.engine.speculative_config import SpeculativeConfig
from fp8cache.engine.structured_output import factory_for
from fp8cache.engine.window_pool import WindowPool
from fp8cache.platform.log import configure_default_logging, log_function


@dataclass
class EngineStats:
    num_prefill_tokens_computed: int  # prompt (and recomputed) tokens fed to the model
    num_cached_prompt_tokens: int  # prompt tokens taken from the prefix cache instead
    prefix_cache_queries: int  # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    num_generated_tokens: int
    num_steps: int
    blocks_used: int
    blocks_free: int
    blocks_total: int
    num_running: int
    num_waiting: int
    spec_decode_num_draft_tokens: int = 0  # speculative decoding: proposed tokens verified
    spec_decode_num_accepted_tokens: int = 0  # of those, accepted


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        wants_logprobs = self.params.logprobs is not None
        outs = [CompletionOutput(index=s.index, text=s.visible_text(), token_ids=s.output_token_ids,
                                 finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                 cumulative_logprob=s.cumulative_logprob if wants_logprobs else None,
                                 logprobs=list(s.logprobs) if wants_logprobs else None)
                for s in self.seqs]
        prompt_logprobs = list(self.seqs[0].prompt_logprobs) if self.params.prompt_logprobs is not None else None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             prompt_logprobs)


class LLMEngine:
    def __init__(self, config: EngineConfig, log: Callable[[str], None] | None = None, runner=None,
                 overlap: bool | None = None) -> None:
        """runner: a ready model runner (tests pass a fake one); None builds fp8cache's ModelRunner.
        log: where progress lines go (default: the "fp8kv.engine" logger, see fp8cache/platform/log.py).
        overlap: run the overlapped decode loop (None: where the runner's device runs asynchronously, a GPU;
        on a CPU it would only hand each step's tokens out one forward pass later). May be changed between
        steps."""
        if log is None:
            configure_default_logging()
            log = log_function("fp8kv.engine")
        if runner is None:
            from fp8cache.model.runner import ModelRunner

            runner = ModelRunner(config, log=log)
        self.config = config
        self.log = log
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.eos_token_ids = set(runner.eos_token_ids)
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, config.enable_prefix_caching,
                                          runner.cache_fingerprint, _window_pool(runner),
                                          released_window=getattr(runner, "attention_window", 0))
        self.max_model_len = runner.max_model_len
        self.cache_capacity_tokens = runner.num_blocks * runner.block_size
        self.cache_bounds_length = not _window_releases_enough(self.block_manager, config.max_num_batched_tokens)
        # A sequence this long stops: the cache's capacity too, unless blocks behind the window are given back.
        self.length_limit = min(self.max_model_len, self.cache_capacity_tokens) if self.cache_bounds_length \
            else self.max_model_len
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.length_limit)
        self.sampler = Sampler(config.seed)
        self.speculation = self._speculation(SpeculativeConfig.parse(getattr(config, "speculative_config", None)))
        supported = bool(getattr(runner, "supports_overlap", False)) and self.speculation is None
        if overlap and not supported:
            why = "speculative decoding verifies on the host" if self.speculation else "tensor parallelism"
            raise ValueError(f"{type(runner).__name__} cannot take a step's input ids from the previous step's "
                             f"tokens on the device ({why}); run it with overlap=False")
        self.overlap = (supported and _runs_asynchronously(runner)) if overlap is None else overlap
        self.trace: Callable[[str, int], None] | None = None  # sees ("schedule"|"launch"|"read", step) in order
        self._in_flight: InFlightStep | None = None  # launched, its tokens not yet read (overlapped loop)
        self.requests: dict[str, Request] = {}  # owned by the step() thread
        self._lock = threading.Lock()
        self._inbox: deque[tuple[str, object]] = deque()  # ("add", Request) | ("abort", request_id)
        self._live_ids: set[str] = set()  # ids added and not yet finished or aborted; under _lock
        self._arrivals = itertools.count()
        self.num_generated_tokens = 0
        self.num_steps = 0

    # --- any thread --------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None) -> None:
        """Queue a request. prompt: text, or token ids. prompt_token_ids: the ids of a text prompt when
        the caller tokenized it already (e.g. after a chat template)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt, prompt_token_ids)
        self._check_prompt(token_ids)
        self._check_logit_bias(params)
        seqs = [Sequence(request_id, i, token_ids, params, arrival=next(self._arrivals))
                for i in range(params.n)]
        if params.structured_outputs is not None:  # compiled here, so a bad pattern fails the request now
            factory = self.guide_factory()
            for seq in seqs:
                seq.guide = factory.guide(params.structured_outputs)
        request = Request(request_id, text, token_ids, params, seqs)
        with self._lock:
            if request_id in self._live_ids:
                raise ValueError(f"request id {request_id!r} is already in use; give each request its own id")
            self._live_ids.add(request_id)
            self._inbox.append(("add", request))

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop the request(s) and free their blocks at the start of the next step. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            for rid in ids:
                if rid in self._live_ids:
                    self._live_ids.discard(rid)
                    self._inbox.append(("abort", rid))

    def _speculation(self, config: SpeculativeConfig | None) -> Speculation | None:
        if config is None:
            return None
        self.log(config.describe())
        return Speculation(config, self.block_manager, self.runner, self.length_limit)

    def guide_factory(self):
        """Compiles structured output patterns for this engine's tokenizer (cached per pattern)."""
        return factory_for(self.tokenizer)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._live_ids)

    def get_num_unfinished_requests(self) -> int:
        with self._lock:
            return len(self._live_ids)

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_prefill_tokens_computed=sched.num_prefill_tokens_computed,
            num_cached_prompt_tokens=sched.num_cached_prompt_tokens,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=sched.num_preemptions, num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps, blocks_used=bm.num_used_blocks, blocks_free=bm.num_free_blocks,
            blocks_total=bm.num_blocks, num_running=len(sched.running), num_waiting=len(sched.waiting),
            spec_decode_num_draft_tokens=self.speculation.num_draft_tokens if self.speculation else 0,
            spec_decode_num_accepted_tokens=self.speculation.num_accepted_tokens if self.speculation else 0)

    # --- the step thread ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled model step; return the requests that got new tokens or finished (with overlap:
        from the step launched by the previous call, see the module docstring)."""
        self._drain_inbox()
        previous, self._in_flight = self._in_flight, None
        progressed: dict[str, Request] = {}
        if previous is not None and not self.overlap:  # overlap was switched off since it was launched
            self._finish(previous, progressed)
            previous = None
        self.block_manager.set_fingerprint(self.runner.cache_fingerprint)
        self._trace("schedule", self.num_steps)
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running, self.eos_token_ids)
        plan = self.scheduler.schedule()
        try:
            current = None if plan.is_empty else self._launch(plan, previous)
        except BaseException:
            self._in_flight = previous  # still queued on the device: its tokens are read by the next step
            raise
        if previous is not None:  # step N's tokens, read while step N+1 runs
            self._finish(previous, progressed)
        if current is not None and not current.overlaps:
            self._finish(current, progressed)
        elif current is not None:
            self._in_flight = current
        outputs = [r.output() for r in progressed.values()]
        self._forget_finished(progressed.values())
        return outputs

    def _launch(self, plan: SchedulerOutput, previous: InFlightStep | None) -> InFlightStep:
        """Queue the step's forward pass and its sampling on the device; nothing here waits for the device."""
        number, batch = self.num_steps, plan.batch
        verifies = bool(batch.num_draft_tokens)
        saved = self.speculation.save_window(plan) if verifies else None
        if batch.future_rows:  # decodes of tokens the previous step sampled: the runner takes them on the device
            if previous is None or previous.readback is None:
                raise RuntimeError("a step feeds pending tokens but no step before it is in flight")
            logits = self.runner.execute(batch, prev_tokens=previous.readback.tokens)
        else:
            logits = self.runner.execute(batch)
        self._trace("launch", number)
        # Scales may have been computed from this very batch: hash its blocks with what they hold now.
        self.block_manager.set_fingerprint(self.runner.cache_fingerprint)
        if verifies:
            self.scheduler.on_step_done(plan.scheduled)
            self.num_steps += 1
            sampled, emitted, entries = self.speculation.verify(plan, logits, self.sampler, self.eos_token_ids,
                                                                self.tokenizer, saved)
            return InFlightStep(number, plan, sampled, None, None, overlaps=False, emitted=emitted,
                                emitted_logprobs=entries)
        sampled, logits = self._sampling_rows(plan, logits)
        self.scheduler.on_step_done(plan.scheduled)
        self.num_steps += 1
        if not sampled:  # nothing to wait for: register its blocks at once
            return InFlightStep(number, plan, [], None, None, overlaps=False)
        readback = TokenReadback(self.sampler.sample(logits, sampled, self.eos_token_ids))
        for row, seq in enumerate(sampled):
            seq.num_pending_tokens += 1
            seq.pending_row = row
        wants_logprobs = any(s.params.logprobs is not None for s in sampled)
        # Synchronous: logprobs are read from this step's logits, and a sequence whose next sampling reads its
        # newest token on the host (a grammar's state, penalties' history) must have it before the next step.
        overlaps = self.overlap and not wants_logprobs and not any(reads_host_history(s) for s in sampled)
        return InFlightStep(number, plan, sampled, readback, logits if wants_logprobs else None, overlaps)

    def _finish(self, step: InFlightStep, progressed: dict[str, Request]) -> None:
        """Take a launched step's tokens to the host: append them, offer full blocks to the prefix cache,
        check stops, free what finished. A sequence that finished or was aborted after the step was scheduled
        drops its token (the one step too many of the overlapped loop)."""
        if step.emitted is not None:  # a verify step: each sequence's accepted tokens and one more
            self._trace("read", step.number)
            emitted, entries = step.emitted, step.emitted_logprobs
        else:
            tokens = step.readback.wait() if step.readback is not None else []
            self._trace("read", step.number)
            logprobs = token_logprobs(step.logits, step.sampled, tokens, self.tokenizer) \
                if step.logits is not None else [None] * len(tokens)
            emitted, entries = [[t] for t in tokens], [[e] for e in logprobs]
            for seq in step.sampled:
                seq.num_pending_tokens -= 1
                if not seq.num_pending_tokens:
                    seq.pending_row = None
        # One token per sequence at a time: a stop at an accepted token drops the ones after it.
        for j in range(max((len(t) for t in emitted), default=0)):
            live = []
            for seq, tokens, logprobs in zip(step.sampled, emitted, entries):
                if j < len(tokens) and not seq.is_finished:
                    self._append(seq, tokens[j], logprobs[j])
                    live.append(seq)
            self._check(live, progressed)

    def _append(self, seq: Sequence, token: int, logprobs: dict | None) -> None:
        seq.append_token(token, logprobs)
        if seq.guide is not None and token not in self.eos_token_ids:  # eos ends it: nothing to advance
            self._advance_guide(seq, token)

    def _check(self, live: list[Sequence], progressed: dict[str, Request]) -> None:
        # Blocks that end in the tokens just read; before the stop checks, so that a finishing sequence's full
        # blocks stay findable, as they always were.
        self.scheduler.register_blocks(live)
        self.num_generated_tokens += len(live)
        check_stops(self.tokenizer, live, self.eos_token_ids, self.length_limit)
        for seq in live:
            if seq.finish_reason is not None:
                self.scheduler.finish(seq, seq.finish_reason)
            progressed[seq.request_id] = self.requests[seq.request_id]

    def _trace(self, what: str, number: int) -> None:
        if self.trace is not None:
            self.trace(what, number)

    def _advance_guide(self, seq: Sequence, token: int) -> None:
        try:
            seq.guide.advance(token)
        except ValueError as exc:  # a token the mask allowed should always advance; never stop the engine
            self.log(f"structured output of request {seq.request_id} dropped its constraint: {exc}")
            seq.guide = None

    def _sampling_rows(self, plan, logits):
        """The sequences that sample this step and their logits rows; prompt_logits chunks' other rows go to
        their prompt logprobs."""
        if not any(chunk.prompt_logits for chunk in plan.batch.seqs):
            return [item.seq for item, chunk in zip(plan.scheduled, plan.batch.seqs) if chunk.want_logits], logits
        sampled, rows, row = [], [], 0
        for item, chunk in zip(plan.scheduled, plan.batch.seqs):
            if chunk.prompt_logits:
                start = chunk.context_len - chunk.query_len
                score_prompt(item.seq, logits[row:row + chunk.query_len], start, self.tokenizer)
                row += chunk.query_len
            elif chunk.want_logits:
                row += 1
            if chunk.want_logits:
                sampled.append(item.seq)
                rows.append(row - 1)
        return sampled, logits[rows]

    def _drain_inbox(self) -> None:
        with self._lock:
            messages, self._inbox = list(self._inbox), deque()
        for kind, payload in messages:
            if kind == "add":
                self.requests[payload.request_id] = payload
                for seq in payload.seqs:
                    self.scheduler.add(seq)
            elif payload in self.requests:
                self.scheduler.abort(payload)
                del self.requests[payload]

    def _forget_finished(self, requests) -> None:
        done = [r.request_id for r in requests if r.finished]
        for rid in done:
            del self.requests[rid]
        with self._lock:
            self._live_ids.difference_update(done)

    # --- validation --------------------------------------------------------------------------------

    def _tokenize(self, prompt: str | list[int], prompt_token_ids: list[int] | None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt_token_ids is None else list(prompt_token_ids)
            return prompt, ids
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
            return None, list(prompt)
        raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _vocab_size(self) -> int | None:
        return getattr(getattr(self.runner, "hf_config", None), "vocab_size", None)

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self._vocab_size()
        bad = [t for t in params.logit_bias or {} if vocab is not None and t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens); give at least one token")
        vocab = self._vocab_size()
        bad = [t for t in token_ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len};"
                             f" shorten the prompt or raise max_model_len")
        if len(token_ids) > self.cache_capacity_tokens and self.cache_bounds_length:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but the whole KV cache holds "
                             f"{self.cache_capacity_tokens}; raise kv_cache_memory or shorten the prompt")


def _window_releases_enough(block_manager: BlockManager, max_num_batched_tokens: int) -> bool:
    """Whether one sequence, giving back its blocks behind every layer's sliding window, never holds more than
    the cache: its window, a block of slack, a partly filled block and one step's chunk of new tokens."""
    window = block_manager.released_window
    held = window + 2 * block_manager.block_size + max_num_batched_tokens
    return bool(window) and held <= block_manager.num_blocks * block_manager.block_size


def _runs_asynchronously(runner) -> bool:
    """Whether the runner's device queues work instead of doing it in the call (any but the CPU)."""
    device = getattr(runner, "device", None)
    return device is not None and torch.device(device).type != "cpu"


def _window_pool(runner) -> WindowPool | None:
    plan = getattr(runner, "cache_plan", None)
    if plan is None or not plan.window_seats:
        return None
    return WindowPool(plan.window_size, plan.window_seats, plan.window_blocks_per_seat, plan.window_sinks)
