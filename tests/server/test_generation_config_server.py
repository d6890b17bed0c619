"""`fp8kv run` with a model whose generation_config.json recommends sampling settings and a length: what a
request leaves out comes from there (or from --override-generation-config), `--generation-config vllm` ignores
it, and --default-max-tokens caps requests that do not say how many tokens they want (0: the room left).

The reference for "the default was used" is the same request with the field given explicitly: seeded sampling
is reproducible, so equal outputs mean equal settings, and the test checks that the other candidate settings
give a different output (else it could not tell them apart)."""

from __future__ import annotations

import json

import pytest
from conftest import build_tiny_model
from server_process import ServerProcess

MAX_MODEL_LEN = 64
MODEL_FILE = {"temperature": 0.5, "top_k": 2, "max_new_tokens": 6}
OVERRIDE = {"temperature": 1.5}
CAP = 4
PROMPT = "the city of the river was"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    """A tiny random Llama with peaked logits (temperature matters), a chat template, and MODEL_FILE."""
    from transformers import AutoTokenizer, GenerationConfig

    path = build_tiny_model(str(tmp_path_factory.mktemp("gen-config-model")), initializer_range=0.15)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(path)
    GenerationConfig(do_sample=True, bos_token_id=1, eos_token_id=2, **MODEL_FILE).save_pretrained(path)
    return path


def start(model_folder: str, log_dir, *flags: str) -> ServerProcess:
    return ServerProcess([model_folder, "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
                          "--kv-cache-memory", "4MiB", "--served-model-name", "m", *flags], str(log_dir / "server.log"))


@pytest.fixture(scope="module")
def overridden(model_folder, tmp_path_factory):
    proc = start(model_folder, tmp_path_factory.mktemp("overridden"), "--override-generation-config",
                 json.dumps(OVERRIDE), "--default-max-tokens", str(CAP))
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def neutral(model_folder, tmp_path_factory):
    proc = start(model_folder, tmp_path_factory.mktemp("neutral"), "--generation-config", "vllm",
                 "--default-max-tokens", "0")
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


def client(server: ServerProcess):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def sampled(server: ServerProcess, **fields) -> list[str]:
    """The tokens of a seeded completion of PROMPT with the given sampling fields (and no others)."""
    out = client(server).completions.create(model="m", prompt=PROMPT, max_tokens=12, seed=11, logprobs=0,
                                            extra_body={"ignore_eos": True, **fields})
    return out.choices[0].logprobs.tokens


def chat_tokens(server: ServerProcess, **kwargs) -> tuple[int, int, str]:
    """(prompt tokens, completion tokens, finish reason) of a chat request."""
    out = client(server).chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}],
                                                 extra_body={"ignore_eos": True}, **kwargs)
    return out.usage.prompt_tokens, out.usage.completion_tokens, out.choices[0].finish_reason


@pytest.mark.slow
def test_start_line_names_the_defaults_and_the_cap(overridden, model_folder):
    line = next(line for line in overridden.output().splitlines() if "request defaults:" in line)
    assert "temperature=1.5" in line and "top_k=2" in line and "max_new_tokens=6" in line
    assert f"{model_folder}/generation_config.json" in line and "--override-generation-config" in line
    assert f"at most {CAP} (--default-max-tokens)" in line


@pytest.mark.slow
def test_omitted_fields_come_from_the_file_and_the_override(overridden):
    omitted = sampled(overridden)
    assert omitted == sampled(overridden, temperature=1.5, top_k=2)  # override's temperature, file's top_k
    assert omitted != sampled(overridden, temperature=0.5, top_k=2)  # not the file's temperature: overridden
    assert omitted != sampled(overridden, temperature=1.5, top_k=-1)  # the file's top_k was used


@pytest.mark.slow
def test_vllm_ignores_the_file(neutral):
    omitted = sampled(neutral)
    assert omitted == sampled(neutral, temperature=1.0, top_k=-1)
    assert omitted != sampled(neutral, temperature=0.5, top_k=2)


@pytest.mark.slow
def test_the_cap_applies_to_requests_without_max_tokens(overridden):
    assert chat_tokens(overridden)[1:] == (CAP, "length")
    assert chat_tokens(overridden, max_tokens=10)[1:] == (10, "length")  # a request's own max_tokens wins
    assert chat_tokens(overridden, max_completion_tokens=9, max_tokens=20)[1:] == (9, "length")
    plain = client(overridden).completions.create(model="m", prompt=PROMPT, extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == CAP  # under OpenAI's 16
    with overridden.client() as c:  # TGI's route: the same cap
        tgi = c.post("/generate", json={"inputs": PROMPT, "parameters": {"details": True}}).json()
    assert (tgi["details"]["generated_tokens"], tgi["details"]["finish_reason"]) == (CAP, "length")


@pytest.mark.slow
def test_zero_lifts_the_cap_to_the_room_left(neutral):
    prompt_tokens, completion_tokens, reason = chat_tokens(neutral)
    assert (completion_tokens, reason) == (MAX_MODEL_LEN - prompt_tokens, "length")
    with neutral.client() as c:
        info = c.get("/tokenizer_info").json()
    assert info["chat_template"].startswith("{% for m in messages %}")


@pytest.mark.slow
def test_generate_command_takes_the_models_defaults(model_folder):
    """`fp8kv generate` without sampling flags samples as the model's file says (temperature, top_k) and stops at
    its max_new_tokens; the same flags given explicitly generate the same text."""
    import os
    import subprocess

    from server_process import fp8kv_command

    def generate(*flags: str) -> str:
        cmd = fp8kv_command() + ["generate", model_folder, PROMPT, "--no-chat", "--dtype", "float32",
                                 "--kv-cache-memory", "4MiB", "--max-model-len", str(MAX_MODEL_LEN),
                                 "--sampling-seed", "3", "--ignore-eos", *flags]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    text = generate()
    assert len(text.split()) == MODEL_FILE["max_new_tokens"]  # one word per token; not the command's own 128
    assert text == generate("--temperature", "0.5", "--top-k", "2", "--max-tokens", "6")
    assert text != generate("--temperature", "0", "--max-tokens", "6")  # sampled, not the command's greedy default
