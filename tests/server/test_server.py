"""`fp8kv run` end to end: real OpenAI and Hugging Face clients against a real server process.

The reference for every generated text is fp8cache's offline LLM with the same model and cache settings:
the server must return exactly what the engine generates, however the request arrives (OpenAI or TGI,
streamed or not), and `fp8kv generate` must print it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import machines_auto_dtype
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess, fp8kv_command, wait_idle

MAX_MODEL_LEN = 256
KV_CACHE_MEMORY = "24MiB"
# `fp8kv generate` steps on its main thread, which OpenMP spin-waiting slows badly on a busy machine (see
# ThreadedLLM); passive waiting changes only the speed.
QUIET_OMP = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    # kv-cache dtype and max-model-len come from the environment, as in a systemd EnvironmentFile.
    env = {"FP8KV_KV_CACHE_DTYPE": "fp8", "FP8KV_MAX_MODEL_LEN": str(MAX_MODEL_LEN)}
    proc = ServerProcess([default_model_path, "--kv-cache-memory", KV_CACHE_MEMORY, "--served-model-name",
                          "smol", "--max-num-seqs", "48"],
                         str(tmp_path_factory.mktemp("server") / "server.log"), env=env)
    yield proc
    code = proc.stop()
    assert code == 0, proc.output()[-3000:]


class ThreadedLLM:
    """The offline LLM, its generation run on a worker thread.

    On a busy machine OpenMP's spin-waiting makes torch ops on the main thread of this process many times
    slower than on a fresh thread (seen: 20 s vs 1 s for 8 tokens at load 8 on 2 cores); results are the same.
    """

    def __init__(self, llm) -> None:
        self.llm = llm
        self.pool = ThreadPoolExecutor(1)

    def generate(self, *args, **kwargs):
        return self.pool.submit(self.llm.generate, *args, **kwargs).result()

    def chat(self, *args, **kwargs):
        return self.pool.submit(self.llm.chat, *args, **kwargs).result()


@pytest.fixture(scope="module")
def reference(default_model_path):
    from fp8cache import LLM

    # the server (a child process) runs --dtype auto as this machine picks it; so does its reference
    llm = ThreadedLLM(LLM(model=default_model_path, kv_cache_dtype="fp8", kv_cache_memory=KV_CACHE_MEMORY,
                          max_model_len=MAX_MODEL_LEN, dtype=machines_auto_dtype(), log=lambda msg: None))
    yield llm
    llm.pool.shutdown()


@pytest.fixture(scope="module")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(max_tokens: int, **kwargs):
    from fp8cache import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


@pytest.mark.slow
def test_startup_reports_cache_and_env_flags(server):
    out = server.output()
    assert "fp8_e4m3" in out and "capacity" in out and server.url in out
    with server.client() as c:
        info = c.get("/info").json()
    assert info["kv_cache"]["dtype"] == "fp8_e4m3"  # from FP8KV_KV_CACHE_DTYPE=fp8
    assert info["max_total_tokens"] == MAX_MODEL_LEN  # from FP8KV_MAX_MODEL_LEN
    assert info["kv_cache"]["capacity_tokens"] == info["kv_cache"]["num_blocks"] * info["kv_cache"]["block_size"]
    window = info["kv_cache"]
    assert window["recent_window_sinks"] == 1  # the default attention sink beside the window
    assert (window["scales"], window["rotation"], window["skip_layers"]) == ("static", "none", [])
    assert f"recent window: {window['recent_window']} tokens + 1 sink in {window['recent_window_dtype']}" in out


@pytest.mark.slow
def test_models_lists_served_name(openai_client):
    assert [m.id for m in openai_client.models.list().data] == ["smol"]


@pytest.mark.slow
def test_completion_matches_engine(openai_client, reference):
    prompt = "The three primary colors are"
    out = openai_client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0)
    want = reference.generate(prompt, greedy(8))[0]
    assert out.choices[0].text == want.outputs[0].text
    assert out.choices[0].finish_reason == want.outputs[0].finish_reason
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)
    assert out.usage.completion_tokens == len(want.outputs[0].token_ids)


@pytest.mark.slow
def test_completion_stream_equals_engine(openai_client, reference):
    prompt = "A recipe for pancakes needs"
    chunks = list(openai_client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0,
                                                   stream=True))
    want = reference.generate(prompt, greedy(8))[0].outputs[0]
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


@pytest.mark.slow
def test_completion_stop_string_and_batch(openai_client, reference):
    prompts = ["Water boils at", "The largest planet is"]
    out = openai_client.completions.create(model="smol", prompt=prompts, max_tokens=10, temperature=0,
                                           stop=["."])
    want = reference.generate(prompts, greedy(10, stop=["."]))
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [w.outputs[0].text for w in want]
    assert [c.finish_reason for c in sorted(out.choices, key=lambda c: c.index)] == \
        [w.outputs[0].finish_reason for w in want]


@pytest.mark.slow
def test_chat_matches_engine(openai_client, reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = openai_client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0)
    want = reference.chat(messages, greedy(12))[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want.outputs[0].text
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)


@pytest.mark.slow
def test_chat_stream_equals_engine(openai_client, reference):
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Name a fruit that is yellow."}]
    stream = openai_client.chat.completions.create(model="smol", messages=messages, max_tokens=10,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True})
    chunks = list(stream)
    want = reference.chat(messages, greedy(10))[0]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.outputs[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [want.outputs[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


@pytest.mark.slow
def test_continuous_usage_stats_count_up_on_every_chunk(server):
    body = {"prompt": "Count to ten:", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chat = {"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"continuous_usage_stats": True}}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for path, payload in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            lines = client.post(path, json=payload).text.splitlines()
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            counts = [c["usage"]["completion_tokens"] for c in chunks]
            assert all("usage" in c for c in chunks) and counts == sorted(counts) and counts[-1] == 6
            assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n for c, n in zip(chunks, counts))


@pytest.mark.slow
def test_chat_n_choices_seeded(openai_client):
    messages = [{"role": "user", "content": "Say a random word."}]
    kwargs = {"model": "smol", "messages": messages, "max_tokens": 6, "temperature": 1.0, "n": 3, "seed": 7}
    first = openai_client.chat.completions.create(**kwargs)
    again = openai_client.chat.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]


def _chosen(output) -> list[float]:
    return [entry[token].logprob for entry, token in zip(output.logprobs, output.token_ids)]


@pytest.mark.slow
def test_completion_logprobs_match_engine_streamed_or_not(openai_client, reference):
    prompt = "The three primary colors are"
    kwargs = {"model": "smol", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    lp = openai_client.completions.create(**kwargs).choices[0].logprobs
    want = reference.generate(prompt, greedy(8, logprobs=3))[0].outputs[0]
    assert lp.tokens == [entry[t].decoded_token for entry, t in zip(want.logprobs, want.token_ids)]
    assert lp.token_logprobs == pytest.approx(_chosen(want), abs=1e-4)
    for top, chosen, entry in zip(lp.top_logprobs, lp.token_logprobs, want.logprobs):
        assert len(top) == len({e.decoded_token for e in entry.values()})  # the top 3 and the sampled token
        assert max(top.values()) == pytest.approx(chosen)  # greedy: the sampled token is the most likely
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = [c.choices[0] for c in openai_client.completions.create(**kwargs, stream=True)]
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


@pytest.mark.slow
def test_completion_echo_with_logprobs_scores_the_prompt(openai_client, reference):
    prompt = "Water boils at one hundred degrees"
    kwargs = {"model": "smol", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    choice = openai_client.completions.create(**kwargs).choices[0]
    want = reference.generate(prompt, greedy(4, logprobs=2, prompt_logprobs=2))[0]
    n = len(want.prompt_token_ids)
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == n + len(want.outputs[0].token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    prompt_chosen = [e[t].logprob for e, t in zip(want.prompt_logprobs[1:], want.prompt_token_ids[1:])]
    assert lp.token_logprobs[1:n] == pytest.approx(prompt_chosen, abs=1e-4)
    assert lp.token_logprobs[n:] == pytest.approx(_chosen(want.outputs[0]), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = [c.choices[0] for c in openai_client.completions.create(**kwargs, stream=True)]
    assert "".join(c.text for c in chunks) == choice.text
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(lp.token_logprobs)


@pytest.mark.slow
def test_vllm_sampling_extensions_match_engine(openai_client, reference):
    prompt = "Paris is the capital of"  # greedy: " the United States" then "." at the 5th token
    extra = {"min_tokens": 10, "include_stop_str_in_output": True, "skip_special_tokens": False}
    out = openai_client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0, stop=["."],
                                           extra_body=extra)
    want = reference.generate(prompt, greedy(12, stop=["."], **extra))[0].outputs[0]
    plain = reference.generate(prompt, greedy(12, stop=["."]))[0].outputs[0]
    assert out.choices[0].text == want.text != plain.text
    assert out.usage.completion_tokens == len(want.token_ids) >= 10


@pytest.mark.slow
def test_logit_bias_matches_engine(openai_client, reference):
    prompt = "The three primary colors are"
    out = openai_client.completions.create(model="smol", prompt=prompt, max_tokens=6, temperature=0,
                                           logit_bias={"504": 8, "260": -100})
    want = reference.generate(prompt, greedy(6, logit_bias={504: 8, 260: -100}))[0].outputs[0]
    plain = reference.generate(prompt, greedy(6))[0].outputs[0]
    assert out.choices[0].text == want.text != plain.text


@pytest.mark.slow
def test_prompt_logprobs_field_matches_engine(server, reference):
    prompt = "Water boils at one hundred degrees"
    want = reference.generate(prompt, greedy(2, prompt_logprobs=2))[0]
    with httpx.Client(base_url=server.url, timeout=120) as client:
        got = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                   "prompt_logprobs": 2}).json()["choices"][0]["prompt_logprobs"]
        messages = [{"role": "user", "content": prompt}]
        chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0,
                                                         "prompt_logprobs": 0}).json()
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
    for entry, engine_entry in zip(got[1:], want.prompt_logprobs[1:]):
        assert {int(t) for t in entry} == set(engine_entry)
        assert [entry[str(t)]["logprob"] for t in engine_entry] == pytest.approx(
            [lp.logprob for lp in engine_entry.values()], abs=1e-4)
    chat_prompt = reference.chat(messages, greedy(1))[0].prompt_token_ids
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(chat_prompt)
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # k = 0: the prompt token itself


@pytest.mark.slow
def test_chat_logprobs_match_engine_streamed_or_not(openai_client, reference):
    messages = [{"role": "user", "content": "Name a fruit that is yellow."}]
    kwargs = {"model": "smol", "messages": messages, "max_tokens": 10, "temperature": 0, "logprobs": True,
              "top_logprobs": 2}
    content = openai_client.chat.completions.create(**kwargs).choices[0].logprobs.content
    want = reference.chat(messages, greedy(10, logprobs=2))[0].outputs[0]
    assert [c.logprob for c in content] == pytest.approx(_chosen(want), abs=1e-4)
    for c in content:
        assert c.bytes == list(c.token.encode("utf-8"))
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert (c.top_logprobs[0].token, c.top_logprobs[0].logprob) == (c.token, pytest.approx(c.logprob))
    chunks = [c.choices[0] for c in openai_client.chat.completions.create(**kwargs, stream=True) if c.choices]
    streamed = [item for c in chunks if c.logprobs is not None for item in c.logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, pytest.approx(c.logprob)) for c in content]
    plain = openai_client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


@pytest.mark.slow
def test_tokenize_and_detokenize_routes(server, reference):
    tok = reference.llm.get_tokenizer()
    text = "Tokenize me, please: naïve café."
    with httpx.Client(base_url=server.url, timeout=60) as client:
        got = client.post("/tokenize", json={"model": "smol", "prompt": text}).json()
        assert got["tokens"] == tok.encode(text) and got["count"] == len(got["tokens"])
        assert got["max_model_len"] == MAX_MODEL_LEN
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.post("/tokenize", json={"messages": messages}).json()
        assert chat["tokens"] == reference.chat(messages, greedy(1))[0].prompt_token_ids
        back = client.post("/detokenize", json={"model": "smol", "tokens": got["tokens"]}).json()
        assert back == {"prompt": tok.decode(got["tokens"])}
        spans = client.post("/tokenize", json={"inputs": text}).json()  # TGI's shape
        assert [s["id"] for s in spans] == got["tokens"]
        assert "".join(s["text"] for s in spans) == text
        assert all(text[s["start"]:s["stop"]] == s["text"] for s in spans)
        bad = client.post("/detokenize", json={"tokens": [10**7]})
        assert bad.status_code == 422 and "tokens" in bad.json()["error"]
        both = client.post("/tokenize", json={"prompt": "x", "messages": messages})
        assert both.status_code == 422 and "either prompt or messages" in both.json()["error"]


def _tgi(server):
    from huggingface_hub import InferenceClient

    return InferenceClient(model=server.url, timeout=120)


@pytest.mark.slow
def test_huggingface_chat_completion_with_a_base_url(server, reference):
    # InferenceClient(base_url=...) sends model "dummy", as TGI's own examples send "tgi": TGI ignores it.
    from huggingface_hub import InferenceClient

    messages = [{"role": "user", "content": "What is the capital of Spain?"}]
    out = InferenceClient(base_url=server.url, timeout=120).chat_completion(messages, max_tokens=8, temperature=0)
    assert out.choices[0].message.content == reference.chat(messages, greedy(8))[0].outputs[0].text
    with server.client() as c:
        for placeholder in ("tgi", "dummy"):
            ok = c.post("/v1/chat/completions", json={"model": placeholder, "messages": messages, "max_tokens": 1})
            assert ok.status_code == 200, ok.text
        other = c.post("/v1/chat/completions", json={"model": "gpt-4", "messages": messages, "max_tokens": 1})
    assert other.status_code == 404  # a real other name is still a misconfigured client (vLLM's answer)


@pytest.mark.slow
def test_tgi_generate_matches_engine(server, reference):
    prompt = "The sun rises in the"
    client = _tgi(server)
    text = client.text_generation(prompt, max_new_tokens=8)  # TGI default: greedy
    detailed = client.text_generation(prompt, max_new_tokens=8, details=True, decoder_input_details=True)
    want = reference.generate(prompt, greedy(8))[0]
    assert text == want.outputs[0].text == detailed.generated_text
    assert detailed.details.generated_tokens == len(want.outputs[0].token_ids)
    assert [t.id for t in detailed.details.tokens] == want.outputs[0].token_ids
    assert [t.id for t in detailed.details.prefill] == want.prompt_token_ids
    assert detailed.details.finish_reason == ("length" if want.outputs[0].finish_reason == "length"
                                              else "eos_token")


@pytest.mark.slow
def test_tgi_stream_matches_engine(server, reference):
    prompt = "My favourite season is"
    client = _tgi(server)  # keep it alive: it owns the open streams
    events = list(client.text_generation(prompt, max_new_tokens=8, stream=True, details=True))
    want = reference.generate(prompt, greedy(8))[0].outputs[0]
    assert [e.token.id for e in events] == want.token_ids
    assert "".join(e.token.text for e in events) == want.text
    assert events[-1].generated_text == want.text
    assert events[-1].details.generated_tokens == len(want.token_ids)
    assert all(e.details is None for e in events[:-1])
    plain = list(client.text_generation(prompt, max_new_tokens=8, stream=True))
    assert "".join(plain) == want.text


@pytest.mark.slow
def test_tgi_token_logprobs_and_top_tokens(server, reference):
    prompt = "The sun rises in the"
    client = _tgi(server)
    detailed = client.text_generation(prompt, max_new_tokens=8, details=True, top_n_tokens=2)
    want = reference.generate(prompt, greedy(8, logprobs=2))[0].outputs[0]
    assert [t.logprob for t in detailed.details.tokens] == pytest.approx(_chosen(want), abs=1e-4)
    assert len(detailed.details.top_tokens) == len(want.token_ids)
    # huggingface_hub leaves the nested top_tokens lists as dicts
    tops = [[(t["id"], t["logprob"]) for t in top] for top in detailed.details.top_tokens]
    for token, top in zip(detailed.details.tokens, tops):
        assert len(top) == 2 and top[0] == (token.id, pytest.approx(token.logprob)) and top[0][1] >= top[1][1]
    prefill = client.text_generation(prompt, max_new_tokens=2, details=True, decoder_input_details=True).details.prefill
    scored = reference.generate(prompt, greedy(2, prompt_logprobs=0))[0]
    assert [t.id for t in prefill] == scored.prompt_token_ids and prefill[0].logprob is None
    assert [t.logprob for t in prefill[1:]] == pytest.approx(
        [e[t].logprob for e, t in zip(scored.prompt_logprobs[1:], scored.prompt_token_ids[1:])], abs=1e-4)
    events = list(client.text_generation(prompt, max_new_tokens=8, stream=True, details=True, top_n_tokens=2))
    assert [e.token.logprob for e in events] == pytest.approx(_chosen(want), abs=1e-4)
    assert [[t.id for t in e.top_tokens] for e in events] == [[i for i, _ in top] for top in tops]


@pytest.mark.slow
def test_tgi_typical_p_sampling_matches_engine(server, reference):
    from fp8cache import SamplingParams

    prompt = "Once upon a time"
    text = _tgi(server).text_generation(prompt, max_new_tokens=8, typical_p=0.4, seed=11)
    want = reference.generate(prompt, SamplingParams(temperature=1.0, typical_p=0.4, seed=11, max_tokens=8))
    assert text == want[0].outputs[0].text


@pytest.mark.slow
def test_tgi_stop_sequence_and_full_text(server, reference):
    prompt = "Count: one, two,"
    out = _tgi(server).text_generation(prompt, max_new_tokens=12, stop=[" four"], details=True,
                                       return_full_text=True)
    want = reference.generate(prompt, greedy(12, stop=[" four"]))[0].outputs[0]
    assert out.generated_text == prompt + want.text
    if want.stop_reason == " four":
        assert out.details.finish_reason == "stop_sequence"


def _metrics(server) -> dict[str, dict[tuple, float]]:
    with server.client() as c:
        text = c.get("/metrics").text
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def _one(samples: dict[str, dict[tuple, float]], name: str, **labels) -> float:
    matches = [v for k, v in samples.get(name, {}).items() if all((key, val) in k for key, val in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


def _so_far(samples: dict[str, dict[tuple, float]], name: str, **labels) -> float:
    """A labelled counter's value, 0 before its first count (prometheus shows a label set once it is used)."""
    matches = [v for k, v in samples.get(name, {}).items() if all((key, val) in k for key, val in labels.items())]
    return _one(samples, name, **labels) if matches else 0.0


@pytest.mark.slow
def test_metrics_count_requests_and_tokens(server, openai_client):
    before = _metrics(server)
    out = openai_client.completions.create(model="smol", prompt="Metrics are", max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    wait_idle(server)
    after = _metrics(server)
    route = {"route": "/v1/completions", "status": "200", "kv_cache_dtype": "fp8_e4m3"}
    assert _one(after, "fp8kv_requests_total", **route) == _so_far(before, "fp8kv_requests_total", **route) + 1
    generated = _one(after, "fp8kv_generation_tokens_total") - _one(before, "fp8kv_generation_tokens_total")
    assert generated == out.usage.completion_tokens == 5
    assert _one(after, "fp8kv_time_to_first_token_seconds_count") > \
        _one(before, "fp8kv_time_to_first_token_seconds_count")
    assert _one(after, "fp8kv_inter_token_latency_seconds_count") - \
        _one(before, "fp8kv_inter_token_latency_seconds_count") == 4
    with server.client() as c:
        kv = c.get("/info").json()["kv_cache"]
    assert _one(after, "fp8kv_kv_cache_blocks_used") == 0
    assert _one(after, "fp8kv_kv_cache_blocks_free") == kv["num_blocks"]
    assert _one(after, "fp8kv_kv_cache_info", kv_cache_dtype="fp8_e4m3") == 1
    for name in ("fp8kv_num_requests_waiting", "fp8kv_batch_size_count", "fp8kv_prefix_cache_hit_rate",
                 "fp8kv_request_duration_seconds_count"):
        assert name in after


async def _stream_client(url: str, i: int, disconnect_after: int | None) -> dict:
    body = {"model": "smol", "prompt": f"Story number {i}: once upon a time", "max_tokens": 6,
            "temperature": 0.8, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
    result = {"status": None, "chunks": 0, "done": False, "finish": None, "text": "", "usage": None}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client, \
            client.stream("POST", "/v1/completions", json=body) as response:
        result["status"] = response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            event = json.loads(line[6:])
            if event.get("usage"):
                result["usage"] = event["usage"]
            for choice in event["choices"]:
                result["chunks"] += 1
                result["text"] += choice["text"]
                result["finish"] = choice["finish_reason"] or result["finish"]
            if disconnect_after is not None and result["chunks"] >= disconnect_after:
                return result  # leaving the block closes the connection mid-stream
    return result


@pytest.mark.slow
def test_concurrent_streams_with_disconnects(server):
    num_clients, quitters = 36, range(0, 36, 3)

    async def run_all():
        return await asyncio.gather(*[_stream_client(server.url, i, 2 if i in quitters else None)
                                      for i in range(num_clients)])

    results = asyncio.run(run_all())
    assert all(r["status"] == 200 for r in results), [r["status"] for r in results]
    for i, r in enumerate(results):
        if i in quitters:
            continue
        assert r["done"] and r["finish"] in ("stop", "length"), r
        tokens = r["usage"]["completion_tokens"]
        assert tokens == 6 if r["finish"] == "length" else 1 <= tokens < 6, r
    stats = wait_idle(server)
    assert stats["blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    # The server still answers after the storm.
    with server.client() as c:
        ok = c.post("/v1/completions", json={"model": "smol", "prompt": "Still alive?", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.slow
def test_generate_command_streams_engine_output(default_model_path, reference):
    prompt = "What is the capital of France?"
    cmd = fp8kv_command() + ["generate", default_model_path, prompt, "--max-tokens", "10", "--kv-cache-dtype",
                             "fp8", "--kv-cache-memory", KV_CACHE_MEMORY, "--max-model-len", str(MAX_MODEL_LEN)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, env=QUIET_OMP)
    assert done.returncode == 0, done.stderr[-3000:]
    want = reference.chat([{"role": "user", "content": prompt}], greedy(10))[0].outputs[0].text
    assert done.stdout == want + "\n"


@pytest.mark.slow
def test_generate_command_raw_prompt_from_stdin(default_model_path, reference):
    prompt = "Rivers flow into the"
    cmd = fp8kv_command() + ["generate", "-", "--model", default_model_path, "--no-chat", "--max-tokens", "6",
                             "--kv-cache-memory", KV_CACHE_MEMORY, "--max-model-len", str(MAX_MODEL_LEN)]
    done = subprocess.run(cmd, check=False, input=prompt, capture_output=True, text=True, timeout=600,
                          env={**QUIET_OMP, "FP8KV_KV_CACHE_DTYPE": "fp8"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == reference.generate(prompt, greedy(6))[0].outputs[0].text + "\n"


def test_cli_lists_server_commands():
    done = subprocess.run(fp8kv_command() + ["--help"], check=False, capture_output=True, text=True)
    assert done.returncode == 0
    for command in ("run", "generate", "systemd-unit"):
        assert command in done.stdout


def test_metrics_registries_are_per_app():
    from fp8cache.server.metrics import ServerMetrics

    # A second app in the same process must not collide with the first one's series.
    first, second = ServerMetrics("a", "auto"), ServerMetrics("b", "fp8_e4m3")
    first.generation_tokens.inc(3)
    assert 'fp8kv_generation_tokens_total{kv_cache_dtype="auto",model_name="a"} 3.0' in first.render().decode()
    assert 'model_name="a"' not in second.render().decode()
