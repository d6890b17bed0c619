"""Structured outputs: the tokenizer's byte vocabulary, the token mask against outlines' own guide, and
generations that must match a regex, a choice or a JSON schema, offline and through the server."""

from __future__ import annotations

import json
import re

import pytest
import torch

from fp8cache import StructuredOutputsParams
from fp8cache.engine.sampler import apply_guides
from fp8cache.engine.sampling_params import SamplingParams
from fp8cache.engine.sequence import Sequence
from fp8cache.engine.structured_output import factory_for, token_bytes

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
}


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer


@pytest.fixture(scope="module")
def llm(default_model_path):
    from fp8cache import LLM

    return LLM(model=default_model_path, kv_cache_dtype="fp8", kv_cache_memory="32MiB", log=lambda _: None)


def test_token_bytes_spell_out_the_text(tokenizer):
    text = "Grüße aus Köln: naïve café, 3.14 ≈ π\n\ttabs and  spaces"
    pieces = token_bytes(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(pieces[i] for i in ids) == text.encode("utf-8")
    assert not set(tokenizer.all_special_ids) & set(pieces)


@pytest.mark.parametrize(
    "kwargs,problem",
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"choice": []}, "non-empty"),
        ({"choice": ["a", ""]}, "non-empty"),
        ({"json": 5}, "JSON schema"),
    ],
)
def test_params_need_exactly_one_valid_constraint(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        StructuredOutputsParams(**kwargs)


def test_mask_is_the_guides_own_token_set(tokenizer):
    guide = factory_for(tokenizer).guide(StructuredOutputsParams(regex=r"(yes|no)[.!]"))
    seq = Sequence("r", 0, [1, 2], SamplingParams())
    seq.guide = guide
    logits = torch.zeros(2, len(tokenizer))
    apply_guides(logits, [seq, Sequence("s", 0, [1], SamplingParams())])
    assert set(torch.nonzero(logits[0] == 0).flatten().tolist()) == set(guide.automaton.get_tokens())
    assert torch.equal(logits[1], torch.zeros(len(tokenizer)))  # unguided rows untouched


def test_min_tokens_does_not_break_a_finished_match(llm):
    params = SamplingParams(
        temperature=0,
        max_tokens=8,
        min_tokens=4,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    out = llm.generate("Is water wet?", params)[0].outputs[0]
    assert out.text in ("yes", "no") and len(out.token_ids) >= 4 and out.finish_reason == "stop"


def test_bad_patterns_fail_the_request(llm):
    with pytest.raises(ValueError, match="cannot be compiled"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    assert llm.llm_engine.stats.blocks_used == 0


@pytest.mark.slow
def test_outputs_match_regex_choice_and_schema(llm):
    choices = ["Paris", "London", "Rome", "Berlin"]
    cases = [
        ("My phone number is", StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")),
        ("The capital of Italy is", StructuredOutputsParams(choice=choices)),
        ("A person, as JSON:", StructuredOutputsParams(json=SCHEMA)),
        ('The JSON object {"city": "Paris"} again:', StructuredOutputsParams(json_object=True)),
    ]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=c) for _, c in cases]
    outs = [o.outputs[0] for o in llm.generate([p for p, _ in cases], params)]
    assert all(o.finish_reason == "stop" for o in outs), [(o.text, o.finish_reason) for o in outs]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outs[0].text)
    assert outs[1].text in choices
    person = json.loads(outs[2].text)
    assert set(person) == {"name", "age", "pets"} and isinstance(person["name"], str)
    assert isinstance(person["age"], int) and all(isinstance(p, str) for p in person["pets"])
    assert isinstance(json.loads(outs[3].text), dict)
    free = llm.generate("The capital of Italy is", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert free.text not in choices  # without the constraint the model rambles on


@pytest.mark.slow
def test_server_structured_outputs(default_model_path, tmp_path):
    import httpx
    import openai
    from server_process import ServerProcess

    proc = ServerProcess(
        [default_model_path, "--kv-cache-memory", "24MiB", "--max-model-len", "256"],
        str(tmp_path / "server.log"),
    )
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Describe a person."}]
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        chat = client.chat.completions.create(
            model=default_model_path, messages=messages, max_tokens=120, temperature=0, response_format=fmt
        )
        assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
        assert set(json.loads(chat.choices[0].message.content)) == {"name", "age", "pets"}
        picked = client.completions.create(
            model=default_model_path,
            prompt="Yes or no?",
            max_tokens=5,
            extra_body={"guided_choice": ["yes", "no"]},
        )
        assert picked.choices[0].text in ("yes", "no")
        body = {
            "inputs": "Call me at",
            "parameters": {"max_new_tokens": 12, "grammar": {"type": "regex", "value": "[0-9]{3}-[0-9]{4}"}},
        }
        tgi = httpx.post(proc.url + "/generate", json=body, timeout=120).json()
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", tgi["generated_text"])
        _check_tool_calls(client, default_model_path)
        bad = httpx.post(proc.url + "/v1/completions", json={"prompt": "x", "guided_regex": "(unclosed"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
        assert "cannot be compiled" in bad.json()["error"]["message"]
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_accept_several_calls_unless_parallel_is_off(tokenizer, parallel):
    from fp8cache.server import protocol as P
    from fp8cache.server import tools

    offered = [P.Tool.model_validate(t) for t in (WEATHER, TIME)]
    guide = factory_for(tokenizer).guide(tools.structured_outputs(offered, "required", parallel=parallel))
    one = '[{"name": "get_time", "parameters": {"zone": "UTC"}}]'
    two = one[:-1] + ', {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}]'
    bad = '[{"name": "get_time", "parameters": {"city": "Oslo"}}]'  # get_weather's arguments under get_time
    accepts = {
        text: guide.automaton.accepts_tokens(tokenizer.encode(text, add_special_tokens=False))
        for text in (one, two, bad)
    }
    assert accepts == {one: True, two: parallel, bad: False}


def _check_tool_calls(client, model: str) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER, TIME], tool_choice=named, max_tokens=60, temperature=0
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "unit"}
    assert args["unit"] in ("celsius", "fahrenheit") and call.id and call.type == "function"
    required = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    assert required.choices[0].finish_reason == "tool_calls"
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
    single = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER, TIME],
        max_tokens=80,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    assert len(single.choices[0].message.tool_calls) == 1
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER],
        tool_choice=named,
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    deltas = [d for chunk in stream for d in (chunk.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        ("get_weather", call.function.arguments)
    ]
    # a second turn: the assistant's call and the tool's answer go back through the chat template
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]
    again = client.chat.completions.create(
        model=model, messages=follow, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert again.choices[0].message.content and not again.choices[0].message.tool_calls
