"""Scheduler and engine loop against a fake model runner.

The fake runner stores each fed token in the slot the batch names and, for a sequence that wants
logits, reads its whole context back through its block table. Its logits are a fixed function of that
context. So the reference for every request is that function applied to the growing token list with no
cache at all: wrong block tables, lost chunks, bad prefix sharing or a botched preemption all show up as
different tokens.
"""

from __future__ import annotations

import types

import pytest
import torch

from fp8cache.config import EngineConfig
from fp8cache.engine.block_manager import BlockManager
from fp8cache.engine.llm_engine import LLMEngine
from fp8cache.engine.sampling_params import SamplingParams
from fp8cache.engine.scheduler import Scheduler
from fp8cache.engine.sequence import Sequence
from fp8cache.model.batch import StepBatch

VOCAB = 50
EOS = 0


def context_logits(context: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash(tuple(context)) % (2**61))
    logits = torch.randn(VOCAB, generator=gen) * 3
    logits[EOS] = -1e4  # keep sequences running unless a test wants eos
    return logits


def reference_tokens(prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(context_logits(tokens).argmax()))
    return tokens[len(prompt):]


class FakeTokenizer:
    """Token t is the letter chr(ord('a') + t % 26); enough for stop strings and text checks."""

    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - ord("a") + 1 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + (t - 1) % 26) for t in ids if not (skip_special_tokens and t == EOS))


class FakeRunner:
    supports_overlap = True  # takes a step's pending tokens from the previous step's (CPU) token tensor

    def __init__(self, num_blocks: int, block_size: int = 4, max_model_len: int = 512) -> None:
        self.tokenizer = FakeTokenizer()
        self.hf_config = types.SimpleNamespace(vocab_size=VOCAB)
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.eos_token_ids = {EOS}
        self.cache_fingerprint = "fake"
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)  # (token, position)
        self.batches: list[StepBatch] = []

    def execute(self, batch: StepBatch, all_logits: bool = False, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        self.batches.append(batch)
        token_ids = list(batch.token_ids)
        for row, src in zip(batch.future_rows, batch.future_src):  # what the device would copy in
            token_ids[row] = int(prev_tokens[src])
        bs, offset, rows = self.block_size, 0, []
        for chunk in batch.seqs:
            start = chunk.context_len - chunk.query_len
            assert batch.positions[offset:offset + chunk.query_len] == list(range(start, chunk.context_len))
            for i in range(offset, offset + chunk.query_len):
                slot, pos = batch.slot_mapping[i], batch.positions[i]
                assert slot == chunk.block_table[pos // bs] * bs + pos % bs, "slot outside the block table"
                self.slots[slot] = (token_ids[i], pos)
            offset += chunk.query_len
            if chunk.want_logits:
                context = []
                for pos in range(chunk.context_len):
                    token, stored_pos = self.slots[chunk.block_table[pos // bs] * bs + pos % bs]
                    assert stored_pos == pos, "the block table points at another position's K/V"
                    context.append(token)
                rows.append(context_logits(context))
        assert offset == len(batch.token_ids)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


def make_engine(num_blocks: int = 64, block_size: int = 4, overlap: bool = False, **config) -> LLMEngine:
    runner = FakeRunner(num_blocks, block_size, config.pop("max_model_len", 512))
    return LLMEngine(EngineConfig(block_size=block_size, **config), log=lambda _: None, runner=runner,
                     overlap=overlap)


def run_all(engine: LLMEngine, check=None) -> dict[str, list[int]]:
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.block_manager.check_invariants()
        if check:
            check(engine)
    assert engine.stats.blocks_used == 0, "blocks leaked after all requests finished"
    return results


def prompts(n: int, base_len: int = 5) -> list[list[int]]:
    return [[1 + (7 * i + j) % (VOCAB - 1) for j in range(base_len + 3 * i)] for i in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


# --- scheduler on its own ------------------------------------------------------------------------

def test_budget_seats_and_decodes_before_prefills():
    bm = BlockManager(num_blocks=100, block_size=4)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=10)
    seqs = [Sequence(str(i), 0, p, greedy(4), arrival=i) for i, p in enumerate(prompts(5))]
    for s in seqs:
        sched.add(s)
    for step in range(12):
        plan = sched.schedule()
        if plan.is_empty:
            break
        assert len(plan.batch.token_ids) <= 10 and len(sched.running) <= 3
        kinds = ["decode" if c.query_len == 1 and c.context_len > seq.num_prompt_tokens else "prefill"
                 for c, seq in zip(plan.batch.seqs, (x.seq for x in plan.scheduled))]
        assert kinds == sorted(kinds), f"step {step}: a prefill was put before a decode: {kinds}"
        sched.on_step_done(plan.scheduled)
        for item, chunk in zip(plan.scheduled, plan.batch.seqs):
            if chunk.want_logits:
                item.seq.append_token(1)
        bm.check_invariants()


def test_long_prompt_is_chunked_and_only_the_last_chunk_wants_logits():
    bm = BlockManager(num_blocks=100, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    seq = Sequence("long", 0, list(range(1, 24)), greedy(4))
    sched.add(seq)
    chunks = []
    while seq.num_computed_tokens < 23:
        plan = sched.schedule()
        chunks.append((plan.batch.seqs[0].query_len, plan.batch.seqs[0].want_logits))
        sched.on_step_done(plan.scheduled)
    assert chunks == [(8, False), (8, False), (7, True)]


def test_abort_frees_blocks_at_once():
    bm = BlockManager(num_blocks=20, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = Sequence("a", 0, list(range(1, 11)), greedy(4)), Sequence("b", 0, [1, 2, 3], greedy(4))
    sched.add(a)
    sched.add(b)
    sched.on_step_done(sched.schedule().scheduled)
    used_before = bm.num_used_blocks
    assert sched.abort("a") == [a]
    assert bm.num_used_blocks == used_before - 3 and a.finish_reason == "abort"
    assert sched.running == [b]
    bm.check_invariants()


# --- the engine loop with the fake runner ---------------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_match_cache_free_reference_with_chunking(overlap):
    engine = make_engine(max_num_batched_tokens=7, max_num_seqs=3, overlap=overlap)
    ps = prompts(5)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, greedy(6))
    results = run_all(engine)
    assert results == {str(i): reference_tokens(p, 6) for i, p in enumerate(ps)}
    assert any(not c.want_logits for b in engine.runner.batches for c in b.seqs), "nothing was chunked"


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_keeps_outputs_identical(overlap):
    ps = prompts(6, base_len=6)
    roomy = make_engine(num_blocks=200, overlap=overlap)
    tight = make_engine(num_blocks=12, overlap=overlap)  # 48 tokens of cache for ~6 sequences of ~30
    for engine in (roomy, tight):
        for i, p in enumerate(ps):
            engine.add_request(str(i), p, greedy(12))
    expected = {str(i): reference_tokens(p, 12) for i, p in enumerate(ps)}
    assert run_all(roomy) == expected
    assert run_all(tight) == expected
    assert tight.stats.num_preemptions > 0 and roomy.stats.num_preemptions == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_keeps_seeded_sampling_identical(overlap):
    ps = prompts(5, base_len=6)
    params = [SamplingParams(temperature=1.0, top_k=20, seed=100 + i, max_tokens=12) for i in range(5)]
    runs = []
    for num_blocks in (200, 12):
        engine = make_engine(num_blocks=num_blocks, overlap=overlap)
        for i, (p, sp) in enumerate(zip(ps, params)):
            engine.add_request(str(i), p, sp)
        runs.append(run_all(engine))
        if num_blocks == 12:
            assert engine.stats.num_preemptions > 0
    assert runs[0] == runs[1]


@pytest.mark.parametrize("overlap", [False, True])
def test_prefix_cache_computes_fewer_tokens_with_same_output(overlap):
    shared = list(range(1, 21))
    results, computed = [], []
    for caching in (True, False):
        engine = make_engine(enable_prefix_caching=caching, overlap=overlap)
        engine.add_request("first", shared + [3, 4], greedy(5))
        first = run_all(engine)
        before = engine.stats.num_prefill_tokens_computed
        engine.add_request("second", shared + [5, 6, 7], greedy(5))
        second = run_all(engine)
        results.append((first, second))
        computed.append(engine.stats.num_prefill_tokens_computed - before)
        if caching:
            assert engine.stats.prefix_cache_hits == 20 and engine.stats.num_cached_prompt_tokens == 20
    assert results[0] == results[1]
    assert results[0][1]["second"] == reference_tokens(shared + [5, 6, 7], 5)
    assert computed == [3, 23]


@pytest.mark.parametrize("overlap", [False, True])
def test_n_siblings_share_the_prompt_blocks(overlap):
    engine = make_engine(overlap=overlap)
    prompt = list(range(1, 18))
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs) == 1 and [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert engine.stats.num_cached_prompt_tokens == 2 * 16  # siblings took 4 full blocks each
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1, "seeded siblings must differ"
    assert engine.stats.blocks_used == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_abort_mid_generation_frees_blocks_and_others_finish(overlap):
    engine = make_engine(overlap=overlap)
    ps = prompts(3)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, greedy(10))
    engine.step()
    engine.step()
    engine.abort_request("1")
    results = run_all(engine)
    assert set(results) == {"0", "2"}
    assert results["0"] == reference_tokens(ps[0], 10)


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_string_eos_and_length_reasons(overlap):
    engine = make_engine(overlap=overlap)
    prompt = prompts(1)[0]
    tokens = reference_tokens(prompt, 8)
    text = FakeTokenizer().decode(tokens)
    stop = text[3:5]
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=8, stop=stop))
    engine.add_request("t", prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[tokens[2]]))
    engine.add_request("l", prompt, greedy(8))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    first = text.find(stop)
    assert outs["s"].finish_reason == "stop" and outs["s"].text == text[:first]
    assert outs["s"].stop_reason == stop
    assert outs["t"].finish_reason == "stop" and outs["t"].token_ids == tokens[:tokens.index(tokens[2]) + 1]
    assert outs["l"].finish_reason == "length" and outs["l"].token_ids == tokens and outs["l"].text == text


@pytest.mark.parametrize("overlap", [False, True])
def test_too_long_prompts_are_refused_and_cache_limit_finishes_with_length(overlap):
    engine = make_engine(num_blocks=4, max_model_len=64, overlap=overlap)  # the cache holds 16 tokens
    with pytest.raises(ValueError, match="max_model_len is 64"):
        engine.add_request("a", list(range(1, 40)) * 2, greedy(4))
    with pytest.raises(ValueError, match="whole KV cache holds 16"):
        engine.add_request("b", list(range(1, 20)), greedy(4))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("c", [], greedy(4))
    engine.add_request("d", list(range(1, 13)), greedy(30))
    out = None
    while engine.has_unfinished_requests():
        out = engine.step() or out
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("overlap", [False, True])
def test_duplicate_request_id_is_refused(overlap):
    engine = make_engine(overlap=overlap)
    engine.add_request("x", [1, 2, 3], greedy(2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [1, 2, 3], greedy(2))
    run_all(engine)
    engine.add_request("x", [1, 2, 3], greedy(2))  # free again once finished
    run_all(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_before_the_first_step_and_unknown_ids(overlap):
    engine = make_engine(overlap=overlap)
    engine.add_request("gone", [1, 2, 3], greedy(4))
    engine.add_request("kept", [4, 5, 6], greedy(4))
    engine.abort_request(["gone", "never-added"])
    results = run_all(engine)
    assert results == {"kept": reference_tokens([4, 5, 6], 4)}


@pytest.mark.parametrize("overlap", [False, True])
def test_requests_added_from_another_thread_while_stepping(overlap):
    import threading

    engine = make_engine(max_num_batched_tokens=16, overlap=overlap)
    ps = prompts(8)
    engine.add_request("0", ps[0], greedy(8))
    added = threading.Event()

    def client() -> None:
        for i, p in enumerate(ps[1:], start=1):
            engine.add_request(str(i), p, greedy(8))
        added.set()

    thread = threading.Thread(target=client)
    thread.start()
    results = {}
    while not added.is_set() or engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    thread.join()
    assert results == {str(i): reference_tokens(p, 8) for i, p in enumerate(ps)}
    assert engine.stats.blocks_used == 0


# --- the overlapped loop (step N+1 launched before step N's tokens are read) ---------------------

def traced(engine: LLMEngine) -> list[tuple[str, int]]:
    log: list[tuple[str, int]] = []
    engine.trace = lambda what, number: log.append((what, number))
    return log


def launched_before_read(log: list[tuple[str, int]]) -> list[bool]:
    """For each step N followed by a step N+1: whether N+1 was scheduled and launched before N's tokens were
    read."""
    at = {entry: i for i, entry in enumerate(log)}
    reads = sorted(n for what, n in log if what == "read")
    return [at[("launch", n + 1)] < at[("read", n)] for n in reads if ("launch", n + 1) in at]


def test_overlap_launches_step_n_plus_1_before_reading_step_n():
    ps = prompts(4)
    logs, results = [], []
    for overlap in (False, True):
        engine = make_engine(max_num_batched_tokens=16, overlap=overlap)
        logs.append(traced(engine))
        for i, p in enumerate(ps):
            engine.add_request(str(i), p, greedy(8))
        results.append(run_all(engine))
    sync, overlapped = (launched_before_read(log) for log in logs)
    assert sync and not any(sync)  # today's loop: read, then schedule the next step
    assert overlapped and all(overlapped)
    assert results[0] == results[1] == {str(i): reference_tokens(p, 8) for i, p in enumerate(ps)}


def fed_tokens(engine: LLMEngine) -> int:
    return sum(len(b.token_ids) for b in engine.runner.batches)


@pytest.mark.parametrize("stop", ["eos", "stop_token_ids", "stop_string", "max_tokens"])
def test_a_stop_seen_a_step_late_drops_the_extra_token(stop):
    """The stopping token's value is on the host only after the next step was launched with that sequence in
    it: its extra token is dropped, its blocks freed, and the outputs are today's. max_tokens is known ahead:
    no extra step is fed."""
    prompt = prompts(1)[0]
    tokens = reference_tokens(prompt, 8)
    params = {"eos": {}, "stop_token_ids": {"stop_token_ids": [tokens[3]]},
              "stop_string": {"stop": FakeTokenizer().decode(tokens[2:4])}, "max_tokens": {}}[stop]
    runs = []
    for overlap in (False, True):
        engine = make_engine(overlap=overlap, enable_prefix_caching=False)
        if stop == "eos":
            engine.eos_token_ids = {tokens[3]}
        engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=4 if stop == "max_tokens" else 8,
                                                       **params))
        engine.add_request("other", prompts(2)[1], greedy(8))
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
            engine.block_manager.check_invariants()
        assert engine.stats.blocks_used == 0
        runs.append((outs, fed_tokens(engine), engine.stats.num_generated_tokens))
    (sync, sync_fed, sync_generated), (overlapped, overlapped_fed, overlapped_generated) = runs
    assert overlapped == sync
    assert sync["s"].token_ids == tokens[:4] and sync["other"].token_ids == reference_tokens(prompts(2)[1], 8)
    assert overlapped_fed == sync_fed + (stop != "max_tokens")
    assert overlapped_generated == sync_generated


def test_a_request_that_reads_its_tokens_on_the_host_runs_synchronous_steps():
    """Penalties (and structured outputs) need the newest token on the host before the next sampling: while
    such a request runs, each step's tokens are read before the next is scheduled. Plain requests beside it
    overlap before and after, and every output is the synchronous loop's."""
    ps = prompts(3)
    penalised = SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.5)
    runs = []
    for overlap in (False, True):
        engine = make_engine(overlap=overlap)
        log = traced(engine)
        engine.add_request("plain", ps[0], greedy(12))
        for _ in range(4):
            engine.step()
        engine.add_request("penalised", ps[1], penalised)
        engine.add_request("logprobs", ps[2], SamplingParams(temperature=0, max_tokens=3, logprobs=2))
        runs.append(run_all(engine))
    assert runs[0] == runs[1]
    assert runs[1]["plain"] == reference_tokens(ps[0], 12)
    # Steps 0-3: "plain" alone (step 3 still in flight when the others arrive); steps 4-9 carry "penalised" (its 6
    # tokens), each read before the next is scheduled; steps 10-11: "plain" alone again.
    assert launched_before_read(log) == [True] * 4 + [False] * 6 + [True]


def test_switching_overlap_off_between_steps_reads_the_step_in_flight():
    engine = make_engine(overlap=True)
    ps = prompts(2)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, greedy(6))
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    engine.overlap = False
    assert run_all(engine) == {str(i): reference_tokens(p, 6) for i, p in enumerate(ps)}
    assert engine._in_flight is None


def test_overlap_needs_a_runner_that_takes_the_previous_tokens():
    runner = FakeRunner(16)
    runner.supports_overlap = False
    with pytest.raises(ValueError, match="overlap=False"):
        LLMEngine(EngineConfig(block_size=4), log=lambda _: None, runner=runner, overlap=True)
    assert not LLMEngine(EngineConfig(block_size=4), log=lambda _: None, runner=runner).overlap
