"""Every numeric sampling field, fed random finite JSON numbers through the server's request parsing into the
engine: each value is refused (a 4xx) or gives exactly the tokens of the value it stands for (issue 39 item 4).

The ranges and meanings below are this test's own statement of the contract (README, "Sampling numbers"), not
read from the code: a value finite in JSON but under- or overflowing in float32 used to be read one way by
the host and another by the kernel (temperature 1e-300 sampled at temperature 1, top_p 1e-300 dropped every
token, repetition_penalty 1e-300 tied every seen token at inf).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fp8cache.engine.llm import LLM
from fp8cache.engine.sampling_params import SamplingParams
from fp8cache.server.parsing import validated
from fp8cache.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, RequestError

EPS = 1e-5
MAX_TOKENS = 4


@dataclass(frozen=True)
class Number:
    """A float field: accepted in [low, high] (open ends where said); `means` maps an accepted value to the one it
    must behave as."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    means: Any = None  # None: itself

    def accepts(self, v: float) -> bool:
        above = v > self.low if self.low_open else v >= self.low
        below = v < self.high if self.high_open else v <= self.high
        return above and below

    def meaning(self, v: float) -> float:
        return v if self.means is None else self.means(v)


def greedy_below_eps(v: float) -> float:
    return 0.0 if v < EPS else v


def at_least_eps(v: float) -> float:
    return max(v, EPS)


INTEGER = None  # an integer field: a JSON float is refused (strict parsing)

OPENAI = {
    "temperature": Number(0, 2, means=greedy_below_eps),
    "top_p": Number(0, 1, low_open=True, means=at_least_eps),
    "min_p": Number(0, 1),
    "repetition_penalty": Number(0.01, 100),
    "presence_penalty": Number(-2, 2),
    "frequency_penalty": Number(-2, 2),
    "logit_bias": Number(-100, 100),
    "top_k": INTEGER, "seed": INTEGER, "n": INTEGER, "max_tokens": INTEGER, "min_tokens": INTEGER,
    "prompt_logprobs": INTEGER,
}
COMPLETION_ONLY = {"logprobs": INTEGER}
CHAT_ONLY = {"top_logprobs": INTEGER, "max_completion_tokens": INTEGER}
TGI = {
    "temperature": Number(0, 100, low_open=True, means=greedy_below_eps),
    "top_p": Number(0, 1, low_open=True, high_open=True, means=at_least_eps),
    "typical_p": Number(0, 1, low_open=True, high_open=True, means=at_least_eps),
    "repetition_penalty": Number(0.01, 100),
    "frequency_penalty": Number(-2, 2),
    "top_k": INTEGER, "seed": INTEGER, "max_new_tokens": INTEGER, "top_n_tokens": INTEGER, "truncate": INTEGER,
    "best_of": INTEGER,
}
ROUTES = {"completions": {**OPENAI, **COMPLETION_ONLY}, "chat": {**OPENAI, **CHAT_ONLY}, "tgi": TGI}
FIELDS = [(route, field) for route, fields in ROUTES.items() for field in fields]

# Where float32 and the ranges have their edges.
EDGES = [0.0, -0.0, 5e-324, 1e-300, 1e-45, 1.4e-45, 1e-40, 1.1754943508222875e-38, 1e-38, 1e-10, 9.99999e-6, EPS,
         1.0000001e-5, 0.0099999, 0.01, 0.5, 0.9999999999999999, 1.0, 1.0000000000000002, 2.0, 2.0000000000000004,
         100.0, 100.00000000000001, 1e4, 3.4028234663852886e38, 3.5e38, 1e300, 1.7976931348623157e308]
FLOATS = st.one_of(st.sampled_from(EDGES), st.sampled_from(EDGES).map(lambda v: -v),
                   st.floats(allow_nan=False, allow_infinity=False), st.floats(min_value=-3, max_value=3),
                   st.floats(min_value=0, max_value=1e-4))


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    with LLM(model=tiny_llama_path, dtype="float32", kv_cache_memory="16MiB") as engine:
        yield engine


def body(route: str, field: str | None, value: float | None) -> dict:
    """A request that samples (temperature 1, a seed) with `field` set to `value`."""
    if route == "tgi":
        parameters: dict[str, Any] = {"do_sample": True, "seed": 7, "max_new_tokens": MAX_TOKENS}
        if field is not None:
            parameters[field] = value
        return {"inputs": "the city of the world", "parameters": parameters}
    request: dict[str, Any] = {"seed": 7, "max_tokens": MAX_TOKENS, "temperature": 1.0}
    if route == "chat":
        request["messages"] = [{"role": "user", "content": "the city of the world"}]
    else:
        request["prompt"] = "the city of the world"
    if field == "logit_bias":
        request["logit_bias"] = {"5": value}
    elif field is not None:
        request[field] = value
    return request


def sampling_kwargs(route: str, field: str | None, value: float | None) -> dict | str:
    """SamplingParams' keyword arguments for the request, or "refused" (the server's 4xx: a RequestError from
    parsing, or SamplingParams' ValueError, which make_sampling_params turns into one)."""
    model = {"completions": CompletionRequest, "chat": ChatCompletionRequest, "tgi": GenerateRequest}[route]
    try:
        request = validated(model, json.loads(json.dumps(body(route, field, value))))
        kwargs = (request.parameters if route == "tgi" else request).sampling_kwargs()
        kwargs.setdefault("max_tokens", MAX_TOKENS)
        kwargs.pop("n", None)
        SamplingParams(**kwargs)
    except (RequestError, ValueError, TypeError):
        return "refused"
    return kwargs


def run(llm: LLM, kwargs: dict) -> list[int]:
    return list(llm.generate("the city of the world", SamplingParams(**kwargs))[0].outputs[0].token_ids)


def tokens(llm: LLM, route: str, field: str | None, value: float | None) -> list[int] | str:
    kwargs = sampling_kwargs(route, field, value)
    return kwargs if kwargs == "refused" else run(llm, kwargs)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(case=st.sampled_from(FIELDS), value=FLOATS)
@example(case=("completions", "temperature"), value=1e-300)
@example(case=("completions", "temperature"), value=1e-45)
@example(case=("completions", "top_p"), value=1e-300)
@example(case=("completions", "repetition_penalty"), value=1e-300)
@example(case=("chat", "temperature"), value=1e-300)
@example(case=("tgi", "temperature"), value=1e-300)
@example(case=("tgi", "typical_p"), value=1e-300)
@example(case=("tgi", "repetition_penalty"), value=1e-300)
@example(case=("completions", "logit_bias"), value=1e-300)
def test_every_numeric_field_is_refused_or_means_its_stated_value(llm, case, value):
    route, field = case
    spec = ROUTES[route][field]
    kwargs = sampling_kwargs(route, field, value)
    if spec is INTEGER or not spec.accepts(value):
        assert kwargs == "refused", f"{route} {field}={value!r} was accepted"
        return
    assert kwargs != "refused", f"{route} {field}={value!r} was refused"
    got = run(llm, kwargs)
    assert got, f"{route} {field}={value!r} made no tokens"
    # The same request with the value it stands for put straight into SamplingParams (TGI has no temperature 0 to
    # send, for one).
    meant = spec.meaning(value)
    reference = dict(kwargs, **{field: {5: meant} if field == "logit_bias" else meant})
    assert got == run(llm, reference), f"{route} {field}={value!r} did not behave as {meant!r}"


def test_a_tiny_temperature_is_greedy_and_samples_differ_from_greedy(llm):
    """The reference the test above leans on: temperature 1 with this seed does not give the greedy tokens, so a
    tiny temperature read as 1 (the old bug) is told apart from greedy."""
    greedy = tokens(llm, "completions", "temperature", 0.0)
    assert tokens(llm, "completions", "temperature", 1.0) != greedy
    assert tokens(llm, "completions", "temperature", 1e-300) == greedy


def test_sampling_params_refuse_what_float32_cannot_hold():
    for kwargs in ({"temperature": float("inf")}, {"temperature": 1e5}, {"repetition_penalty": 1e-300},
                   {"repetition_penalty": 1e300}, {"logit_bias": {1: float("inf")}}, {"top_p": float("nan")},
                   {"temperature": 10**400}):
        with pytest.raises(ValueError, match="is invalid: it must be"):
            SamplingParams(**kwargs)
    params = SamplingParams(temperature=1e-300, top_p=1e-300, typical_p=5e-324)
    assert (params.temperature, params.top_p, params.typical_p, params.greedy) == (0.0, EPS, EPS, True)
    with pytest.raises(ValueError) as refused:
        SamplingParams(temperature=10**400)
    assert len(str(refused.value)) < 200  # a 400-digit number is not repeated back whole
