"""LLM.stream (what `fp8kv generate` prints): the text grows step by step to generate()'s greedy text, the chat
template is applied when asked, and leaving the stream early aborts the request."""

from __future__ import annotations

import itertools

import pytest
from click.testing import CliRunner

from fp8cache import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    with LLM(model=tiny_llama_path, dtype="float32", kv_cache_dtype="fp8_e4m3", kv_cache_memory="16MiB") as llm:
        yield llm


def test_the_stream_grows_to_generates_text(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = list(llm.stream("the city of the river", params, chat=False))
    texts = [out.outputs[0].text for out in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert outs[-1].finished and not any(out.finished for out in outs[:-1])
    assert texts[-1] == llm.generate("the city of the river", params)[0].outputs[0].text
    assert not llm.engine.has_unfinished_requests()


def test_leaving_early_aborts_the_request(llm):
    stream = llm.stream("the city", SamplingParams(max_tokens=50, ignore_eos=True), chat=False)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished_requests()


def test_chat_wraps_the_prompt_in_the_template(llm):
    tok = llm.get_tokenizer()
    if getattr(tok, "chat_template", None) is None:
        tok.chat_template = "{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}{{ ' the' }}"
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    streamed = list(llm.stream("the river", params))[-1]
    chatted = llm.chat([{"role": "user", "content": "the river"}], params)[0]
    assert streamed.prompt_token_ids == chatted.prompt_token_ids
    assert streamed.outputs[0].text == chatted.outputs[0].text


def test_fp8kv_generate_prints_the_stream(tiny_llama_path):
    from launcher.cli import main

    with LLM(model=tiny_llama_path, dtype="float32", kv_cache_memory="16MiB") as llm:
        want = llm.generate("the city", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0].text
    done = CliRunner().invoke(main, ["generate", tiny_llama_path, "the city", "--max-tokens", "4", "--ignore-eos",
                                     "--no-chat", "--dtype", "float32", "--kv-cache-memory", "16MiB",
                                     "--device", "cpu"])
    assert done.exit_code == 0, done.output
    assert want in done.output
