"""Engine: SamplingParams checks, incremental detokenization, the LLM class, and the full engine on the
default model against transformers' own greedy generation."""

from __future__ import annotations

import pytest
import torch

from fp8cache.config import EngineConfig
from fp8cache.engine.detokenizer import (
    REPLACEMENT_CHAR,
    _batch_decoder,
    check_stop,
    check_stops,
    decode_new_text,
)
from fp8cache.engine.llm_engine import LLMEngine
from fp8cache.engine.sampling_params import SamplingParams
from fp8cache.engine.sequence import Sequence, SequenceStatus

PROMPTS = [
    "London is the capital of",
    "The quick brown fox jumps over the lazy dog. Then the fox",
    "In 1905, Albert Einstein published four papers in the journal Annalen der Physik. The first one",
    "Water boils at",
]
MAX_TOKENS = 16


# --- SamplingParams ------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.2),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("max_tokens", 0), ("min_tokens", -1), ("stop", 5), ("stop_token_ids", [-1]), ("seed", 1.5),
    ("temperature", float("nan")), ("logprobs", -1), ("logprobs", 21), ("logprobs", True),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21), ("typical_p", 0.0), ("typical_p", 1.5),
])
def test_bad_sampling_params_name_field_and_range(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}=") as err:
        SamplingParams(**{field: value})
    assert "must be" in str(err.value)


def test_min_tokens_above_max_tokens_is_refused_and_stop_is_normalized():
    with pytest.raises(ValueError, match="min_tokens=5.*max_tokens=3"):
        SamplingParams(max_tokens=3, min_tokens=5)
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=["a", ""]).stop_strings == ["a"]


# --- incremental detokenization ------------------------------------------------------------------

class ByteTokenizer:
    """One token per UTF-8 byte: multi-byte characters always arrive split across tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def stream_text(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> list[str]:
    seq = Sequence("r", 0, prompt_ids, SamplingParams(max_tokens=len(output_ids)))
    pieces = []
    for t in output_ids:
        seq.append_token(t)
        pieces.append(decode_new_text(tokenizer, seq))
    return pieces


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🙂🚀 mixed ascii", "ok"])
def test_split_utf8_never_emits_replacement_chars(text):
    tok = ByteTokenizer()
    pieces = stream_text(tok, tok.encode("prompt: "), tok.encode(text))
    assert all(REPLACEMENT_CHAR not in p for p in pieces)
    assert "".join(pieces) == text


def test_real_tokenizer_stream_equals_full_decode(default_tokenizer):
    tok = default_tokenizer
    text = " Paris, 東京 and Zürich 🙂 — “quoted” text\nnew line"
    prompt, output = tok.encode("Cities:"), tok.encode(text)
    pieces = stream_text(tok, prompt, output)
    assert all(REPLACEMENT_CHAR not in p for p in pieces)
    assert "".join(pieces) == tok.decode(output)


def run_stop_check(tokenizer, text: str, **params) -> Sequence:
    seq = Sequence("r", 0, tokenizer.encode(">"), SamplingParams(**params))
    for t in tokenizer.encode(text):
        seq.append_token(t)
        check_stop(tokenizer, seq, eos_token_ids=set(), max_model_len=10_000)
        if seq.finish_reason:
            seq.status = SequenceStatus.FINISHED
            break
    return seq


def test_stop_strings_truncate_or_keep():
    tok = ByteTokenizer()
    cut = run_stop_check(tok, "one two STOP three", stop=["STOP", "zzz"], max_tokens=100)
    assert (cut.output_text, cut.finish_reason, cut.stop_reason) == ("one two ", "stop", "STOP")
    kept = run_stop_check(tok, "one two STOP three", stop="STOP", include_stop_str_in_output=True,
                          max_tokens=100)
    assert kept.output_text == "one two STOP"
    early = run_stop_check(tok, "ab ab ab", stop="ab", min_tokens=4, max_tokens=100)
    assert early.output_text == "ab " and early.num_output_tokens == 5  # the first "ab" is before min_tokens
    length = run_stop_check(tok, "abcdefgh", stop="xyz", max_tokens=5)
    assert (length.output_text, length.finish_reason) == ("abcde", "length")


def test_a_step_decoded_in_one_call_is_tokenizer_decode_sequence_by_sequence(default_tokenizer):
    """check_stops decodes a whole step's windows in one call to the Rust tokenizer (the default model's takes that
    path): text, stops and finish reasons are those of check_stop with tokenizer.decode, one sequence at a time,
    with and without skipping special tokens."""
    tok = default_tokenizer
    assert _batch_decoder(tok) is not None
    texts = [" Paris, 東京 and Zürich 🙂 — “quoted”", "one two STOP three four", "<|im_end|>a<|im_start|> b 🚀 c"]
    params = [SamplingParams(max_tokens=100), SamplingParams(max_tokens=100, stop="STOP"),
              SamplingParams(max_tokens=7, skip_special_tokens=False)]
    runs = []
    for batched in (False, True):
        seqs = [Sequence(str(i), 0, tok.encode("Say:"), p) for i, p in enumerate(params)]
        outputs = [tok.encode(t, add_special_tokens=False) for t in texts]
        for step in range(max(len(o) for o in outputs)):
            live = [s for s, o in zip(seqs, outputs) if step < len(o) and s.finish_reason is None]
            for seq in live:
                seq.append_token(outputs[seqs.index(seq)][step])
            if batched:
                check_stops(tok, live, set(), 10_000)
            else:
                for seq in live:
                    check_stop(tok, seq, set(), 10_000)
        runs.append([(s.output_text, s.finish_reason, s.stop_reason, s.num_output_tokens) for s in seqs])
    assert runs[1] == runs[0]
    assert runs[0][0][0] == texts[0] and runs[0][1][:3] == ("one two ", "stop", "STOP")
    assert runs[0][2][1] == "length" and "<|im_end|>" in runs[0][2][0]


def test_visible_text_holds_back_a_possible_stop_string_prefix():
    tok = ByteTokenizer()
    seq = Sequence("r", 0, tok.encode(">"), SamplingParams(stop=["END", "STOP"], max_tokens=100))
    seen = []
    for t in tok.encode("abc EN"):
        seq.append_token(t)
        check_stop(tok, seq, set(), 10_000)
        seen.append(seq.visible_text())
    # "STOP" is the longest stop string: its length minus one characters stay back.
    assert seen == ["", "", "", "a", "ab", "abc"]
    seq.append_token(tok.encode("D")[0])
    check_stop(tok, seq, set(), 10_000)
    seq.status = SequenceStatus.FINISHED
    assert seq.finish_reason == "stop" and seq.visible_text() == "abc "


# --- the LLM class surface -----------------------------------------------------------------------

def test_llm_rejects_unknown_arguments():
    from fp8cache import LLM

    with pytest.raises(TypeError, match="unknown argument.*gpu_memory_utilisation"):
        LLM(gpu_memory_utilisation=0.9)


# --- the engine on the default model -------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(default_loaded):
    return default_loaded  # the session's, shared with the other modules' runners


@pytest.fixture(scope="module")
def hf_greedy(default_model, default_tokenizer) -> list[list[int]]:
    """transformers' own generate(do_sample=False), one prompt at a time, on an independently loaded model."""
    tok, model = default_tokenizer, default_model
    outs = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, do_sample=False, max_new_tokens=MAX_TOKENS)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


def make_engine(loaded, **overrides) -> LLMEngine:
    from fp8cache.model.runner import ModelRunner

    config = EngineConfig(model=loaded.model_path, kv_cache_memory=overrides.pop("kv_cache_memory", "16MiB"),
                          **overrides)
    return LLMEngine(config, log=lambda _: None, runner=ModelRunner(config, log=lambda _: None, loaded=loaded))


def generate(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    """Submit all prompts at once and step until done; returns each one's output token ids in order."""
    for i, p in enumerate(prompts):
        engine.add_request(f"req-{engine.stats.num_steps}-{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.block_manager.check_invariants()
    assert engine.stats.blocks_used == 0, "KV blocks leaked"
    return [done[k] for k in sorted(done, key=lambda k: int(k.rsplit("-", 1)[1]))]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def auto_run(loaded) -> tuple[LLMEngine, list[list[int]]]:
    engine = make_engine(loaded)
    return engine, generate(engine, PROMPTS, GREEDY)


def test_auto_cache_greedy_equals_transformers_generate(auto_run, hf_greedy):
    assert auto_run[1] == hf_greedy


# Teacher-forced top-1 agreement of each FP8 cache with the auto cache's greedy tokens over these 64
# positions, with the default scales of 1.0: measured 0.92 (fp8), 0.91 (fp8_e4m3fnuz), 0.86 (fp8_e5m2).
FP8_AGREEMENT_FLOOR = {"fp8": 0.85, "fp8_e5m2": 0.75, "fp8_e4m3fnuz": 0.85}


@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8_AGREEMENT_FLOOR))
def test_fp8_cache_greedy_tokens_mostly_agree_with_auto(loaded, auto_run, kv_cache_dtype):
    """For every prompt and every k, the FP8 engine's greedy token after prompt + auto[:k] vs auto[k].

    Free-running greedy outputs part for good at the first different token, so they say little about
    the other positions; feeding auto's own tokens asks the question at each position. The longest
    context of each prompt goes first: the rest then read their prefix from its FP8 cache blocks.
    """
    auto_tokens = auto_run[1]
    # Plain FP8 (no recent-token window): these short contexts would otherwise sit wholly in the window and
    # never read a cached prefix from FP8 (tests/model/test_recent_window.py covers the window).
    engine = make_engine(loaded, kv_cache_dtype=kv_cache_dtype, kv_recent_window=0)
    tok = engine.tokenizer
    longest = [(tok.encode(p) + out[:-1], out[-1]) for p, out in zip(PROMPTS, auto_tokens)]
    rest = [(tok.encode(p) + out[:k], out[k]) for p, out in zip(PROMPTS, auto_tokens)
            for k in range(len(out) - 1)]
    contexts = longest + rest
    got = [t[0] for part in (longest, rest) for t in generate(engine, [c[0] for c in part], greedy(1))]
    share = sum(g == want for g, (_, want) in zip(got, contexts)) / len(contexts)
    print(f"{kv_cache_dtype}: teacher-forced greedy agreement with auto {share:.3f} over {len(contexts)}")
    assert engine.stats.prefix_cache_hits > 0
    assert share >= FP8_AGREEMENT_FLOOR[kv_cache_dtype]


def test_prefix_caching_same_tokens_and_fewer_prefill_tokens(loaded, auto_run):
    """The auto engine already ran PROMPTS; a prompt extending one of them finds its blocks cached."""
    engine = auto_run[0]
    extended = [PROMPTS[2] + " was about the photoelectric effect"]
    before = engine.stats
    with_cache = generate(engine, extended, greedy(6))
    after = engine.stats
    fresh = make_engine(loaded, enable_prefix_caching=False)
    without_cache = generate(fresh, extended, greedy(6))
    assert with_cache == without_cache
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 16
    computed = after.num_prefill_tokens_computed - before.num_prefill_tokens_computed
    assert computed < fresh.stats.num_prefill_tokens_computed
    assert fresh.stats.prefix_cache_hits == 0


def test_preemption_with_a_tiny_cache_gives_the_same_tokens(loaded, auto_run):
    from fp8cache.kvcache.sizing import bytes_per_token

    per_token = bytes_per_token(30, 3, 64, "auto", torch.float32, "cpu")
    engine = make_engine(loaded, kv_cache_memory=4 * 16 * per_token)  # 64 tokens of cache
    tokens = generate(engine, PROMPTS[:3], greedy(12))
    assert engine.stats.num_preemptions > 0
    assert tokens == [t[:12] for t in auto_run[1][:3]]


def test_llm_generate_and_chat_run_as_documented(default_model_path):
    from fp8cache import LLM

    llm = LLM(model=default_model_path, kv_cache_dtype="fp8", kv_cache_memory="8MiB", log=lambda _: None)
    outs = llm.generate(["London is the capital of", [504, 3458]],
                        [SamplingParams(temperature=0.7, top_p=0.8, seed=1, max_tokens=4), greedy(3)])
    assert [o.request_id for o in outs] == ["0", "1"] and outs[0].prompt == "London is the capital of"
    assert outs[0].outputs[0].text and len(outs[1].outputs[0].token_ids) == 3
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [504, 3458]
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy(10))
    assert "Paris" in chat[0].outputs[0].text
    assert llm.llm_engine.stats.blocks_used == 0


# --- logprobs ------------------------------------------------------------------------------------

def _final_outputs(engine: LLMEngine, prompts: list[str], params: SamplingParams):
    for i, p in enumerate(prompts):
        engine.add_request(f"lp-{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return [done[f"lp-{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def hf_model(default_model):
    return default_model


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=8, logprobs=4),
    # sampled, penalised: the reported logprobs are still the model's own distribution
    SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.5, seed=3, max_tokens=8, logprobs=2),
], ids=["greedy", "sampled"])
def test_logprobs_are_transformers_log_softmax(loaded, hf_model, params):
    outs = _final_outputs(make_engine(loaded), PROMPTS[:2], params)
    for out in outs:
        c = out.outputs[0]
        ids = torch.tensor([out.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            want = hf_model(ids).logits[0, len(out.prompt_token_ids) - 1:-1].log_softmax(-1)
        assert len(c.logprobs) == len(c.token_ids)
        for step, (entry, token) in enumerate(zip(c.logprobs, c.token_ids)):
            row = want[step]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-3)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= params.logprobs)
            assert [t for _, t in top] == row.topk(params.logprobs).indices.tolist()
            assert len(entry) in (params.logprobs, params.logprobs + 1)
            assert entry[token].decoded_token == loaded.tokenizer.decode([token])
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids)))
        if params.greedy:
            assert all(e[t].rank == 1 for e, t in zip(c.logprobs, c.token_ids))


def test_no_logprobs_unless_asked(loaded):
    out = _final_outputs(make_engine(loaded), PROMPTS[:1], greedy(3))[0].outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None


def test_prompt_logprobs_are_transformers_log_softmax_chunked_and_past_the_prefix_cache(loaded, hf_model):
    # 7-token chunks split each prompt over several steps; the second request finds the first's blocks in
    # the prefix cache, which it must not use (cached tokens get no logits); n=2 siblings share one scoring.
    engine = make_engine(loaded, max_num_batched_tokens=7, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=2)
    first, again = (_final_outputs(engine, PROMPTS[2:3], params)[0] for _ in range(2))
    assert engine.stats.num_cached_prompt_tokens > 0  # the siblings did use the cache
    prompt = first.prompt_token_ids
    with torch.no_grad():
        want = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for out in (first, again):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert entry[prompt[i]].logprob == pytest.approx(want[i - 1, prompt[i]].item(), abs=1e-3)
            top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= 3)
            assert [t for _, t in top] == want[i - 1].topk(3).indices.tolist()
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]


def test_logit_bias_steers_generation_and_ids_past_the_vocabulary_are_refused(loaded, auto_run):
    engine = make_engine(loaded)
    first_greedy = auto_run[1][0][0]
    banned = generate(engine, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3,
                                                          logit_bias={first_greedy: -100}))[0]
    forced = generate(engine, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, logit_bias={504: 100}))[0]
    assert banned[0] != first_greedy and forced == [504] * 3
    with pytest.raises(ValueError, match="logit_bias token id 1000000 is outside the vocabulary"):
        engine.add_request("bad", PROMPTS[0], SamplingParams(logit_bias={10**6: 1.0}))
