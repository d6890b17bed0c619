"""The OpenAI API as vLLM answers it, driven by the clients people point at it: the `openai` SDK (chat,
max_completion_tokens, stream_options.include_usage, n > 1 streamed, seed, completions with logprobs and echo),
GET /tokenizer_info, and lm-evaluation-harness' `local-completions` on a small task written here.

The reference is Hugging Face transformers running the same model in float32 (the server runs float32 with an
auto cache, so its logprobs agree to float32 rounding): its greedy continuations, its log-softmax, its tokenizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from server_process import ServerProcess

MODEL = "smol"
MAX_MODEL_LEN = 256
LOGPROB_TOLERANCE = 1e-3  # float32 through fp8kv's kernels vs transformers' own attention
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    proc = ServerProcess([default_model_path, "--dtype", "float32", "--kv-cache-memory", "24MiB", "--max-model-len",
                          str(MAX_MODEL_LEN), "--served-model-name", MODEL],
                         str(tmp_path_factory.mktemp("openai-clients") / "server.log"))
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_ids(tokenizer, messages=MESSAGES) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@torch.inference_mode()
def greedy_text(model, tokenizer, ids: list[int], max_new_tokens: int) -> str:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


@torch.inference_mode()
def token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the log-distribution of the token after ids[:i + 1]."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.slow
def test_chat_answers_as_the_model(client, default_model, default_tokenizer):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)
    ids = chat_ids(default_tokenizer)
    assert out.choices[0].message.content == greedy_text(default_model, default_tokenizer, ids, 8)
    assert out.usage.prompt_tokens == len(ids)


@pytest.mark.slow
def test_max_completion_tokens_wins_over_max_tokens(client):
    def length(**kwargs) -> int:
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"ignore_eos": True},
                                             **kwargs)
        assert out.choices[0].finish_reason == "length"
        return out.usage.completion_tokens

    assert length(max_completion_tokens=5, max_tokens=50) == 5  # vLLM: max_completion_tokens first
    assert length(max_tokens=7) == 7


@pytest.mark.slow
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_include_usage_sends_a_final_usage_chunk(client, route):
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 12}
    create = client.chat.completions.create if route == "chat" else client.completions.create
    request = {"messages": MESSAGES} if route == "chat" else {"prompt": "The capital of France is"}
    whole = create(**kwargs, **request)
    chunks = list(create(**kwargs, **request, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage == whole.usage  # OpenAI's shape: after every choice, before [DONE]
    assert all(c.usage is None for c in body)
    text = "".join((c.choices[0].delta.content or "") if route == "chat" else c.choices[0].text for c in body)
    assert text == (whole.choices[0].message.content if route == "chat" else whole.choices[0].text)


@pytest.mark.slow
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_n_choices_stream_with_their_index(client, route):
    kwargs = {"model": MODEL, "temperature": 1.0, "max_tokens": 10, "n": 2, "seed": 5}
    if route == "chat":
        whole = client.chat.completions.create(messages=MESSAGES, **kwargs)
        want = {c.index: c.message.content for c in whole.choices}
        chunks = client.chat.completions.create(messages=MESSAGES, stream=True, **kwargs)
        pieces = [(c.choices[0].index, c.choices[0].delta.content or "") for c in chunks]
    else:
        whole = client.completions.create(prompt="Once upon a time", **kwargs)
        want = {c.index: c.text for c in whole.choices}
        chunks = client.completions.create(prompt="Once upon a time", stream=True, **kwargs)
        pieces = [(c.choices[0].index, c.choices[0].text) for c in chunks]
    streamed = {i: "".join(text for index, text in pieces if index == i) for i in (0, 1)}
    assert {index for index, _ in pieces} == {0, 1}
    assert streamed == want  # each index's chunks add up to that choice, as sampled without streaming
    assert want[0] != want[1]  # two samples, not one sent twice


@pytest.mark.slow
def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=12,
                                             seed=seed, extra_body={"ignore_eos": True})
        return out.choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (1, 2, 3, 4)}) > 1


@pytest.mark.slow
def test_completion_logprobs_with_echo_score_the_prompt_as_the_model(client, default_model, default_tokenizer):
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    ids = default_tokenizer.encode(prompt, add_special_tokens=False)
    logprobs = out.choices[0].logprobs
    reference = token_logprobs(default_model, ids)
    assert logprobs.token_logprobs[0] is None  # nothing predicts the first token
    want = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))] + [reference[-1].max().item()]
    assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=LOGPROB_TOLERANCE)
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert out.choices[0].text.startswith(prompt)


@pytest.mark.slow
def test_tokenizer_info_is_the_tokenizers_config(server, default_tokenizer):
    with server.client() as c:
        info = c.get("/tokenizer_info").json()
    tok = default_tokenizer
    assert info["tokenizer_class"] == type(tok).__name__
    for name in ("eos_token", "bos_token", "pad_token", "unk_token", "model_max_length"):
        assert info[name] == getattr(tok, name), name
    assert info["chat_template"] == tok.chat_template
    assert "vocab_file" not in info and "merges_file" not in info


LM_EVAL_DOCS = [{"question": "The capital of France is", "answer": "Paris"},
                {"question": "Two plus two equals", "answer": "four"},
                {"question": "The color of the sky is", "answer": "blue"}]

LM_EVAL_SCRIPT = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager

folder, base_url, out_path = sys.argv[1:]
results = lm_eval.simple_evaluate(
    model="local-completions", model_args=f"base_url={base_url},model=smol,num_concurrent=1,max_retries=1",
    tasks=["fp8kv_ll", "fp8kv_gen"], task_manager=TaskManager(include_path=folder), log_samples=True)
samples = {task: [{"arguments": s["arguments"], "resps": s["filtered_resps"]} for s in rows]
           for task, rows in results["samples"].items()}
json.dump(samples, open(out_path, "w"))
"""


def write_lm_eval_tasks(folder) -> None:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in LM_EVAL_DOCS))
    common = f"""
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        doc_to_text: "{{{{question}}}}"
        doc_to_target: "{{{{answer}}}}"
    """
    (folder / "fp8kv_ll.yaml").write_text(textwrap.dedent(common) + textwrap.dedent("""
        task: fp8kv_ll
        output_type: loglikelihood
        metric_list:
          - metric: acc
    """))
    (folder / "fp8kv_gen.yaml").write_text(textwrap.dedent(common) + textwrap.dedent("""
        task: fp8kv_gen
        output_type: generate_until
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 8
        metric_list:
          - metric: exact_match
    """))


@pytest.mark.slow
def test_lm_eval_local_completions_scores_as_the_model(server, default_model, default_tokenizer, tmp_path):
    """lm-evaluation-harness finds /tokenizer_info (so it tokenizes through the server) and its loglikelihoods
    and greedy generations are the model's own."""
    pytest.importorskip("lm_eval")
    write_lm_eval_tasks(tmp_path)
    out_path = tmp_path / "samples.json"
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", LM_EVAL_SCRIPT, str(tmp_path), server.url + "/v1/completions",
                           str(out_path)], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = json.loads(out_path.read_text())
    assert '"GET /tokenizer_info HTTP/1.1" 200' in server.output()  # the harness chose the server's tokenizer
    tok = default_tokenizer

    scored = samples["fp8kv_ll"]
    assert len(scored) == len(LM_EVAL_DOCS)
    for sample in scored:
        [(context, continuation)] = sample["arguments"]  # one request per document
        ctx = tok.encode(context, add_special_tokens=False)
        whole = tok.encode(context + continuation, add_special_tokens=False)
        reference = token_logprobs(default_model, whole)
        rows = range(len(ctx) - 1, len(whole) - 1)
        [[loglikelihood, greedy]] = sample["resps"]
        assert loglikelihood == pytest.approx(sum(reference[i, whole[i + 1]].item() for i in rows),
                                              abs=LOGPROB_TOLERANCE)
        assert greedy == all(reference[i].argmax().item() == whole[i + 1] for i in rows)

    generated = samples["fp8kv_gen"]
    assert len(generated) == len(LM_EVAL_DOCS)
    for sample in generated:
        [(context, kwargs)] = sample["arguments"]
        [text] = sample["resps"]
        want = greedy_text(default_model, tok, tok.encode(context, add_special_tokens=False), kwargs["max_gen_toks"])
        assert text == want.split("\n")[0]
