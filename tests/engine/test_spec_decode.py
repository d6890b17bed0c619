"""Speculative decoding (n-gram prompt lookup): its config, the proposer against a brute-force search, the
acceptance rules against the target distribution, and the engine: greedy output token-identical with and
without speculation, rejected drafts leaving no trace (cache contents, blocks, prefix cache, recent-window
ring), stops, max_tokens, structured output, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from fp8cache.config import EngineConfig
from fp8cache.engine import spec_accept
from fp8cache.engine.llm_engine import LLMEngine
from fp8cache.engine.ngram_proposer import MAX_SKIP, NgramProposer, lookup
from fp8cache.engine.sampling_params import SamplingParams
from fp8cache.engine.sequence import Sequence
from fp8cache.engine.spec_decode import VERIFY_ROWS_CPU
from fp8cache.engine.speculative_config import SpeculativeConfig
from fp8cache.engine.structured_output import StructuredOutputsParams
from fp8cache.model.loader import load_model
from fp8cache.model.runner import ModelRunner

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
REPEAT = ("The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on the log. "
          "The cat sat on the mat. The dog")
STORY = "Once upon a time there was a little fox who lived in the forest. Every day the little fox"


# --- config --------------------------------------------------------------------------------------

def test_config_takes_vllms_shape_and_fills_the_lookup_bounds():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (5, 2, 3)
    c = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_min": 6})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 6, 6)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse({}) is None
    assert c.disable_by_batch_size == 8
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "disable_by_batch_size": 64}).disable_by_batch_size == 64


@pytest.mark.parametrize("value,message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a whole number >= 1"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be a whole number >= 1"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "is above prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown key"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_config_is_refused_naming_the_fix(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


# --- proposer ------------------------------------------------------------------------------------

def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_lookup_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    for trial in range(300):
        tokens = rng.integers(0, 4 if trial % 2 else 12, size=int(rng.integers(1, 40))).tolist()
        min_n, max_n, k = int(rng.integers(1, 3)), int(rng.integers(3, 6)), int(rng.integers(1, 6))
        assert lookup(np.asarray(tokens), min_n, max_n, k) == brute_force(tokens, min_n, max_n, k), tokens


def test_proposer_backs_off_after_misses_and_resets_on_an_accept():
    proposer = NgramProposer(SpeculativeConfig.parse(NGRAM))
    seq = Sequence("r", 0, [1, 2, 3, 1, 2], SamplingParams())
    assert proposer.propose(seq, 4) == [3, 1, 2]
    assert proposer.propose(seq, 2) == [3, 1]
    skipped = []
    for _ in range(8):
        NgramProposer.observe(seq, 0)
        skipped.append(seq.spec_skip)
        while seq.spec_skip:
            assert proposer.propose(seq, 4) == []
    assert skipped == [1, 2, 4, 8, 16, 32, MAX_SKIP, MAX_SKIP]
    NgramProposer.observe(seq, 1)
    NgramProposer.observe(seq, 0)
    assert seq.spec_skip == 1


# --- acceptance ----------------------------------------------------------------------------------

def test_greedy_acceptance_keeps_the_matching_drafts_and_one_more():
    assert spec_accept.accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert spec_accept.accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert spec_accept.accept_greedy([5], [4, 1]) == [4]


def expected(observed: np.ndarray, probs: torch.Tensor) -> np.ndarray:
    p = probs.double().numpy()
    return observed.sum() * p / p.sum()


def test_rejection_sampling_emits_the_target_distribution():
    """Chi-square (fixed seed): the first emitted token follows row 0's distribution and, after an accepted
    first draft, the second follows row 1's, whatever was proposed."""
    probs = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.3, 0.1, 0.4], [0.2, 0.2, 0.2, 0.2, 0.2]])
    generator = torch.Generator().manual_seed(1)
    drafts = [1, 4]
    runs = [spec_accept.accept_sampled(drafts, probs, generator) for _ in range(6000)]
    first = np.bincount([r[0] for r in runs], minlength=5)
    assert first[4] == 0
    assert stats.chisquare(first[:4], expected(first[:4], probs[0, :4])).pvalue > 1e-3
    second = np.bincount([r[1] for r in runs if r[0] == 1], minlength=5)
    assert stats.chisquare(second, expected(second, probs[1])).pvalue > 1e-3
    assert all(len(r) == 3 for r in runs if r[:2] == drafts)  # all accepted: the bonus follows


# --- the engine on the default model --------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded_bf16(default_model_path):
    return load_model(EngineConfig(model=default_model_path, dtype="bfloat16"), progress=False)


def make_engine(loaded, spec=None, **overrides) -> LLMEngine:
    config = EngineConfig(model=loaded.model_path, speculative_config=spec,
                          **{"max_model_len": 256, "max_num_seqs": 8, "kv_cache_memory": "24MiB", **overrides})
    return LLMEngine(config, log=lambda _: None, runner=ModelRunner(config, log=lambda _: None, loaded=loaded))


def generate(engine: LLMEngine, prompts: list, params: SamplingParams, check=None, whole: bool = False) -> list:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out if whole else out.outputs[0]
        engine.block_manager.check_invariants()
        if check is not None:
            check(engine)
    return [done[str(i)] for i in range(len(prompts))]


def same_outputs(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert (x.text, x.finish_reason, x.stop_reason) == (y.text, y.finish_reason, y.stop_reason)


@pytest.mark.parametrize("model_dtype,kv_cache_dtype", [
    ("float32", "fp8"), *[pytest.param(*case, marks=pytest.mark.slow)
                          for case in (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8"))]])
def test_greedy_output_is_token_identical_with_speculation(default_loaded, loaded_bf16, model_dtype, kv_cache_dtype):
    """Plain FP8 cache (kv_recent_window 0) and auto; with a recent window see the ring tests below."""
    loaded = default_loaded if model_dtype == "float32" else loaded_bf16
    params = SamplingParams(temperature=0, max_tokens=28)
    prompts = [REPEAT, STORY, "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"]
    plain = generate(make_engine(loaded, kv_cache_dtype=kv_cache_dtype, kv_recent_window=0), prompts, params)
    engine = make_engine(loaded, NGRAM, kv_cache_dtype=kv_cache_dtype, kv_recent_window=0)
    same_outputs(generate(engine, prompts, params), plain)
    stats_ = engine.stats
    assert 0 < stats_.spec_decode_num_accepted_tokens <= stats_.spec_decode_num_draft_tokens
    assert engine.num_steps < sum(len(o.token_ids) for o in plain)  # a step emitted several tokens


def test_no_proposals_while_more_sequences_run_than_disable_by_batch_size(default_loaded):
    engine = make_engine(default_loaded, {**NGRAM, "disable_by_batch_size": 2})
    drafted = []
    propose = engine.speculation.propose

    def watching(running, eos):
        propose(running, eos)
        drafted.append((len(running), sum(len(s.draft_token_ids) for s in running)))

    engine.speculation.propose = watching
    for i, (prompt, n) in enumerate([(STORY, 3), (STORY + " ran", 3), (REPEAT, 16)]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n))
    while engine.has_unfinished_requests():
        engine.step()
    assert all(count == 0 for running, count in drafted if running > 2)
    assert any(count for running, count in drafted if running <= 2)


def test_a_cpu_verify_step_stays_within_the_rows_a_step_costs_anyway(default_loaded):
    """On a CPU each sequence's drafts are cut so that a step of verify chunks stays within VERIFY_ROWS_CPU rows
    (none at 16 sequences), so speculation never makes a batch's steps compute-bound."""
    engine = make_engine(default_loaded, {**NGRAM, "disable_by_batch_size": 64}, max_num_seqs=16)
    engine.speculation.proposer.propose = lambda seq, limit: [seq.token_ids[-1]] * limit  # as many as allowed
    verify_steps = []
    execute = engine.runner.execute

    def watching(batch, **kw):
        if batch.num_draft_tokens:
            verify_steps.append((len(batch.seqs), [s.query_len for s in batch.seqs]))
        return execute(batch, **kw)

    engine.runner.execute = watching
    for n in (3, 6, 12):
        verify_steps.clear()
        generate(engine, [f"{STORY} {i}" for i in range(n)], SamplingParams(temperature=0, max_tokens=4))
        decoding = [(count, lens) for count, lens in verify_steps if max(lens) <= 1 + NGRAM["num_speculative_tokens"]]
        if n == 12:
            assert not verify_steps  # 12 sequences fill the 16 rows with their own tokens
            continue
        assert decoding and all(sum(lens) <= VERIFY_ROWS_CPU for _, lens in decoding)
        assert any(sum(lens) > n for _, lens in decoding)  # drafts were verified


MIXED = [f"{REPEAT[:30 + 5 * i]} {STORY[:8 + 3 * i]} {REPEAT[:30 + 5 * i]}" for i in range(16)]


@pytest.mark.parametrize("kv_cache_dtype,kv_scales,window", [
    ("fp8_e4m3", "static", 16),  # whole-block ring: verify rows read a copy of their ring blocks
    pytest.param("fp8_e5m2", "dynamic", 8, marks=pytest.mark.slow),  # rows fill a scratch ring position by position
    pytest.param("fp8_e4m3", "dynamic", 32, marks=pytest.mark.slow),
    pytest.param("fp8_e5m2", "static", 0, marks=pytest.mark.slow)])
def test_sixteen_sequences_verify_together_token_identical(default_loaded, kv_cache_dtype, kv_scales, window):
    """16 prompts of different lengths, prefill chunks (a small token budget) mixed with verify chunks and plain
    decodes in one step: every sequence verifies its drafts in the same attention call, and the greedy output
    is token-identical to plain decoding."""
    settings = {"kv_cache_dtype": kv_cache_dtype, "kv_scales": kv_scales, "kv_recent_window": window,
                "max_num_seqs": 16, "max_num_batched_tokens": 64, "kv_cache_memory": "48MiB"}
    params = SamplingParams(temperature=0, max_tokens=8)
    plain = generate(make_engine(default_loaded, **settings), MIXED, params)
    engine = make_engine(default_loaded, {**NGRAM, "disable_by_batch_size": 64}, **settings)
    engine.speculation.verify_rows = None  # every running sequence proposes, however many rows the step takes
    mixed_steps = []
    execute = engine.runner.execute

    def watching(batch, **kw):
        lens = [s.query_len for s in batch.seqs]
        verify = sum(1 for s in batch.seqs if s.num_draft_tokens)
        if verify > 1 and any(n == 1 for n in lens) and any(s.query_len > 1 and not s.num_draft_tokens
                                                            for s in batch.seqs):
            mixed_steps.append(verify)
        return execute(batch, **kw)

    engine.runner.execute = watching
    same_outputs(generate(engine, MIXED, params), plain)
    assert mixed_steps  # a step held verify chunks, plain decodes and a prefill chunk
    assert engine.stats.spec_decode_num_accepted_tokens > 0
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.slow
def test_stops_and_max_tokens_mid_draft_end_as_without_speculation(default_loaded):
    cases = [SamplingParams(temperature=0, max_tokens=30, stop=["on the log"]),
             SamplingParams(temperature=0, max_tokens=30, stop=["log"], include_stop_str_in_output=True),
             SamplingParams(temperature=0, max_tokens=7),
             SamplingParams(temperature=0, max_tokens=30, min_tokens=9, stop_token_ids=[13])]
    for params in cases:
        plain = generate(make_engine(default_loaded), [REPEAT, STORY], params)
        spec = make_engine(default_loaded, NGRAM)
        same_outputs(generate(spec, [REPEAT, STORY], params), plain)
        assert spec.stats.spec_decode_num_draft_tokens > 0
        assert spec.block_manager.num_used_blocks == 0


@pytest.mark.slow
def test_logprobs_and_a_json_schema_see_only_accepted_tokens(default_loaded):
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=2)
    plain = generate(make_engine(default_loaded), [REPEAT], params)
    spec = make_engine(default_loaded, NGRAM)
    got = generate(spec, [REPEAT], params)
    same_outputs(got, plain)
    assert spec.stats.spec_decode_num_accepted_tokens > 0
    assert [list(e) for e in got[0].logprobs] == [list(e) for e in plain[0].logprobs]
    for mine, theirs in zip(got[0].logprobs, plain[0].logprobs):
        for token in mine:
            assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    params = SamplingParams(temperature=0, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(json=schema))
    prompt = 'Give {"name": "Ann", "age": 3} and then again as JSON: '
    same_outputs(generate(make_engine(default_loaded, NGRAM), [prompt], params),
                 generate(make_engine(default_loaded), [prompt], params))


# --- rollback: rejected drafts leave no trace ----------------------------------------------------

def forced(engine: LLMEngine, truth: list[int] | None = None, wrong_from: int = 0,
           k: int = 4) -> dict[int, torch.Tensor]:
    """Make engine's proposer propose K tokens every step: the true continuation (from `truth`) made wrong
    from draft `wrong_from` on (no truth: all wrong), so every step is a verify step. Returns the logits of
    every position the engine computes, filled as it runs."""
    def propose(seq, limit):
        n = len(seq.token_ids)
        count = min(k, limit)
        drafts = truth[n:n + count] if truth is not None else [seq.token_ids[-1]] * count
        return drafts[:wrong_from] + [(t + 1) % 1000 for t in drafts[wrong_from:]]

    engine.speculation.proposer.propose = propose
    rows: dict[int, torch.Tensor] = {}
    execute = engine.runner.execute

    def recording(batch, **kw):
        out = execute(batch, **kw)
        chunk = batch.seqs[0]
        first = chunk.context_len - 1 - chunk.num_draft_tokens
        for j in range(out.shape[0]):
            # The last computation wins (rejected drafts are fed again); a plain decode (no room left for
            # drafts) runs another path, compared elsewhere: None.
            rows[first + j] = out[j].clone() if chunk.query_len > 1 else None
        return out

    engine.runner.execute = recording
    return rows


def block_state_is_trimmed(engine: LLMEngine) -> None:
    """A running sequence holds blocks for its computed tokens and the next one, no more; the prefix cache
    holds only blocks whose tokens it really has."""
    bm = engine.block_manager
    for seq in engine.scheduler.running:
        if seq.num_uncomputed_tokens == 1:
            assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens + 1)
        for i in range(seq.num_registered_blocks):
            block = bm.blocks[seq.block_table[i]]
            if block.hash is not None:
                assert block.token_ids == tuple(seq.token_ids[i * bm.block_size:(i + 1) * bm.block_size])


@pytest.mark.parametrize("kv_cache_dtype,window,wrong_from,sinks", [
    ("fp8", 8, 2, 1),  # drafts cross the ring's edge (window 8), rejected mid-draft: their slots restored
    pytest.param("fp8", 8, 0, 1, marks=pytest.mark.slow),  # every draft rejected
    pytest.param("fp8", 32, 1, 0, marks=pytest.mark.slow),
    # more attention sinks than the prompt's 37 tokens: drafts at positions below 48 land on sink seats
    ("fp8", 8, 2, 48),
    # drafts ending mid-block and across block edges (block_size 16), blocks given back
    pytest.param("auto", 0, 3, 0, marks=pytest.mark.slow),
])
def test_rejected_drafts_leave_no_trace(default_loaded, kv_cache_dtype, window, wrong_from, sinks):
    """The same continuation computed with all drafts rejected, all accepted, and rejected from `wrong_from` on:
    every position's logits (of verify steps) are bit-identical, so no rejected token's K/V (FP8 slots, ring
    slots) was ever read, and the blocks and prefix cache hold only verified tokens."""
    params = SamplingParams(temperature=0, max_tokens=26)  # positions 37-62: across the block edge at 48
    cache = {"kv_cache_dtype": kv_cache_dtype, "kv_recent_window": window, "kv_recent_window_sinks": sinks}
    garbage = make_engine(default_loaded, NGRAM, **cache)
    garbage_rows = forced(garbage)  # every draft rejected, every step
    reference = generate(garbage, [REPEAT], params)[0]
    truth = garbage.tokenizer.encode(REPEAT) + reference.token_ids
    right = make_engine(default_loaded, NGRAM, **cache)
    right_rows = forced(right, truth, wrong_from=4)  # every draft accepted
    same_outputs(generate(right, [REPEAT], params), [reference])
    assert right.stats.spec_decode_num_accepted_tokens == right.stats.spec_decode_num_draft_tokens > 0
    wrong = make_engine(default_loaded, NGRAM, **cache)
    wrong_rows = forced(wrong, truth, wrong_from)
    same_outputs(generate(wrong, [REPEAT], params, check=block_state_is_trimmed), [reference])
    assert 0 < wrong.stats.spec_decode_num_accepted_tokens or wrong_from == 0
    assert wrong.stats.spec_decode_num_accepted_tokens < wrong.stats.spec_decode_num_draft_tokens
    for rows in (garbage_rows, wrong_rows):
        compared = [p for p in sorted(set(right_rows) & set(rows)) if right_rows[p] is not None and rows[p] is not None]
        assert len(compared) > 20
        for position in compared:
            assert torch.equal(right_rows[position], rows[position]), position
    assert wrong.block_manager.num_used_blocks == 0


@pytest.mark.slow
def test_verify_steps_read_the_window_like_one_prefill(default_loaded):
    """With a recent window, each verified row's logits equal those of a one-shot prefill of the same tokens
    (the reference the runner's tests hold decode and chunked prefill to)."""
    params = SamplingParams(temperature=0, max_tokens=24)
    engine = make_engine(default_loaded, NGRAM, kv_cache_dtype="fp8", kv_recent_window=8)
    rows = forced(engine, wrong_from=1)  # every step verifies; the first draft (the last token again) may pass
    out = generate(engine, [REPEAT], params)[0]
    tokens = engine.tokenizer.encode(REPEAT) + out.token_ids
    verified = [p for p in sorted(rows) if rows[p] is not None and p < len(tokens) - 1]
    for position in (verified[-8], verified[-1]):
        torch.testing.assert_close(rows[position], one_prefill_last_row(default_loaded, tokens[:position + 1]),
                                   atol=1e-4, rtol=1e-4)


def one_prefill_last_row(loaded, tokens: list[int]) -> torch.Tensor:
    engine = make_engine(loaded, kv_cache_dtype="fp8", kv_recent_window=8, enable_prefix_caching=False)
    execute, got = engine.runner.execute, []
    engine.runner.execute = lambda batch, **kw: got.append(execute(batch, **kw)) or got[-1]
    generate(engine, [tokens], SamplingParams(temperature=0, max_tokens=1))
    return got[0][-1]


@pytest.mark.slow
def test_prefix_cache_after_speculation_serves_the_right_tokens(default_loaded):
    """A second request whose prompt is the first one's prompt and output takes its blocks from the prefix
    cache (registered only for verified tokens) and continues exactly as a cold engine does."""
    params = SamplingParams(temperature=0, max_tokens=40)
    engine = make_engine(default_loaded, NGRAM)
    first = generate(engine, [REPEAT], params)[0]
    follow_up = engine.tokenizer.encode(REPEAT) + first.token_ids
    hits = engine.block_manager.prefix_cache_hits
    again = generate(engine, [follow_up], SamplingParams(temperature=0, max_tokens=12))
    assert engine.block_manager.prefix_cache_hits > hits
    same_outputs(again, generate(make_engine(default_loaded), [follow_up], SamplingParams(temperature=0, max_tokens=12)))


# --- sampling through the engine -----------------------------------------------------------------

def test_sampled_tokens_follow_the_same_distribution_with_speculation(tiny_llama_path):
    """A tiny random model: the tokens at output positions 1-3 (where verified drafts land) have the same
    distribution with and without speculation (chi-square, fixed seeds). The drafts are the greedy
    continuation, so that the sampled sequences accept some and reject others."""
    loaded = load_model(EngineConfig(model=tiny_llama_path), progress=False)
    prompt = "the city of the river the city of the river the city of the"
    counts, vocab = [], loaded.hf_config.vocab_size
    greedy = None
    for spec in (None, None, {**NGRAM, "num_speculative_tokens": 3, "disable_by_batch_size": 600}):
        config = EngineConfig(model=tiny_llama_path, max_model_len=64, max_num_seqs=600, kv_cache_memory="64MiB",
                              speculative_config=spec, enable_prefix_caching=False)
        engine = LLMEngine(config, log=lambda _: None, runner=ModelRunner(config, log=lambda _: None, loaded=loaded))
        if greedy is None:  # first the greedy continuation
            out = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
            greedy = engine.tokenizer.encode(prompt) + out.token_ids
            continue
        if spec:
            engine.speculation.proposer.propose = lambda seq, limit, g=greedy: g[len(seq.token_ids):][:limit]
            engine.speculation.verify_rows = None  # all 600 sequences verify drafts, however many rows that is
        params = SamplingParams(temperature=0.05, max_tokens=4, n=600, seed=7, ignore_eos=True)  # a random model is flat
        out = generate(engine, [prompt], params, whole=True)[0]
        tokens = np.array([o.token_ids for o in out.outputs])
        counts.append([np.bincount(tokens[:, j], minlength=vocab) for j in (1, 2, 3)])
        if spec:
            drafted, accepted = engine.stats.spec_decode_num_draft_tokens, engine.stats.spec_decode_num_accepted_tokens
            assert 0.1 * drafted < accepted < 0.9 * drafted  # both branches of the rule are exercised
    for plain, spec in zip(*counts):
        seen = (plain + spec) > 0
        assert stats.chi2_contingency(np.stack([plain[seen], spec[seen]])).pvalue > 1e-3
