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
    def __init__(self, num_blocks: int, block_size: int = 4, max_model_len: int = 512) -> None:
        self.tokenizer = FakeTokenizer()
        self.hf_config = types.SimpleNamespace(vocab_size=VOCAB)
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.eos_token_ids = {EOS}
        self.cache_fingerprint = "fake"
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)  # (token, position)
        self.batches: list[StepBatch] = []

    def execute(self, batch: StepBatch, all_logits: bool = False) -> torch.Tensor:
        self.batches.append(batch)
        bs, offset, rows = self.block_size, 0, []
        for chunk in batch.seqs:
            start = chunk.context_len - chunk.query_len
            assert batch.positions[offset:offset + chunk.query_len] == list(range(start, chunk.context_len))
            for i in range(offset, offset + chunk.query_len):
                slot, pos = batch.slot_mapping[i], batch.positions[i]
                assert slot == chunk.block_table[pos // bs] * bs + pos % bs, "slot outside the block table"
                self.slots[slot] = (batch.token_ids[i], pos)
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


def make_engine(num_blocks: int = 64, block_size: int = 4, **config) -> LLMEngine:
    runner = FakeRunner(num_blocks, block_size, config.pop("max_model_len", 512))
    return LLMEngine(EngineConfig(block_size=block_size, **config), log=lambda _: None, runner=runner)


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

def test_outputs_match_cache_free_reference_with_chunking():
    engine = make_engine(max_num_batched_tokens=7, max_num_seqs=3)
    ps = prompts(5)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, greedy(6))
    results = run_all(engine)
    assert results == {str(i): reference_tokens(p, 6) for i, p in enumerate(ps)}
    assert any(not c.want_logits for b in engine.runner.batches for c in b.seqs), "nothing was chunked"


def test_preemption_keeps_outputs_identical():
    ps = prompts(6, base_len=6)
    roomy = make_engine(num_blocks=200)
    tight = make_engine(num_blocks=12)  # 48 tokens of cache for ~6 sequences of ~30
    for engine in (roomy, tight):
        for i, p in enumerate(ps):
            engine.add_request(str(i), p, greedy(12))
    expected = {str(i): reference_tokens(p, 12) for i, p in enumerate(ps)}
    assert run_all(roomy) == expected
    assert run_all(tight) == expected
    assert tight.stats.num_preemptions > 0 and roomy.stats.num_preemptions == 0


def test_preemption_keeps_seeded_sampling_identical():
    ps = prompts(5, base_len=6)
    params = [SamplingParams(temperature=1.0, top_k=20, seed=100 + i, max_tokens=12) for i in range(5)]
    runs = []
    for num_blocks in (200, 12):
        engine = make_engine(num_blocks=num_blocks)
        for i, (p, sp) in enumerate(zip(ps, params)):
            engine.add_request(str(i), p, sp)
        runs.append(run_all(engine))
        if num_blocks == 12:
            assert engine.stats.num_preemptions > 0
    assert runs[0] == runs[1]


def test_prefix_cache_computes_fewer_tokens_with_same_output():
    shared = list(range(1, 21))
    results, computed = [], []
    for caching in (True, False):
        engine = make_engine(enable_prefix_caching=caching)
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


def test_n_siblings_share_the_prompt_blocks():
    engine = make_engine()
    prompt = list(range(1, 18))
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs) == 1 and [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert engine.stats.num_cached_prompt_tokens == 2 * 16  # siblings took 4 full blocks each
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1, "seeded siblings must differ"
    assert engine.stats.blocks_used == 0


def test_engine_abort_mid_generation_frees_blocks_and_others_finish():
    engine = make_engine()
    ps = prompts(3)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, greedy(10))
    engine.step()
    engine.step()
    engine.abort_request("1")
    results = run_all(engine)
    assert set(results) == {"0", "2"}
    assert results["0"] == reference_tokens(ps[0], 10)


def test_stop_string_eos_and_length_reasons():
    engine = make_engine()
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


def test_too_long_prompts_are_refused_and_cache_limit_finishes_with_length():
    engine = make_engine(num_blocks=4, max_model_len=64)  # the cache holds 16 tokens
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


def test_duplicate_request_id_is_refused():
    engine = make_engine()
    engine.add_request("x", [1, 2, 3], greedy(2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [1, 2, 3], greedy(2))
    run_all(engine)
    engine.add_request("x", [1, 2, 3], greedy(2))  # free again once finished
    run_all(engine)


def test_abort_before_the_first_step_and_unknown_ids():
    engine = make_engine()
    engine.add_request("gone", [1, 2, 3], greedy(4))
    engine.add_request("kept", [4, 5, 6], greedy(4))
    engine.abort_request(["gone", "never-added"])
    results = run_all(engine)
    assert results == {"kept": reference_tokens([4, 5, 6], 4)}


def test_requests_added_from_another_thread_while_stepping():
    import threading

    engine = make_engine(max_num_batched_tokens=16)
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
