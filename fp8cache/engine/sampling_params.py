"""Per-request sampling knobs, with vLLM's names and defaults.

Every bad value raises ValueError naming the field, the value and the allowed range: the HTTP server
turns these into 400 responses as they are.

Numbers are checked for the dtype they are used in (the sampler works in float32, whose smallest normal is
1.2e-38 and largest 3.4e38): a value that is finite in Python but under- or overflows there would be read one
way by the host (0 < temperature: sample) and another by the kernel (0.0 in float32: divide by 1). So every
float must be finite, ranges keep the float32 arithmetic finite, and values too small to mean anything are
given the meaning they have in the limit, as vLLM does: a temperature below SAMPLING_EPS is greedy (stored as
0), a top_p or typical_p below it is SAMPLING_EPS (the most likely token alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fp8cache.engine.structured_output import StructuredOutputsParams

MAX_LOGPROBS = 20  # top logprobs per token, as vLLM's default max_logprobs and OpenAI's top_logprobs
SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy
# Beyond this every token the other settings keep is equally likely, to float32's precision, for any logits a
# model makes; a larger number is a mistake, not a setting.
MAX_TEMPERATURE = 1e4
# A penalty divides (or multiplies) logits: 1/100 .. 100 keeps float32 logits finite and ordered; a penalty of
# 1e-300 made every seen token's logit inf (all tied: the first one in the vocabulary won, every time).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # 0 or -1: off
    min_p: float = 0.0
    typical_p: float = 1.0  # locally typical sampling (TGI's typical_p); 1: off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16  # None: up to the model's length limit
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # k: each output token's logprob and the k most likely tokens' (0: its own only)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100 bans, 100 forces)
    structured_outputs: StructuredOutputsParams | None = None  # output must match a JSON schema / regex / choice
    prompt_logprobs: int | None = None  # k: each prompt token's logprob (the first has none) and the top k
    stop_strings: list[str] = field(init=False, repr=False)  # `stop` as a list, "" dropped

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1, None, "an integer >= 1")
        _check_number("temperature", self.temperature, lambda v: 0 <= v <= MAX_TEMPERATURE,
                      f"a number in [0, {MAX_TEMPERATURE:g}] (0 means greedy, and so does anything below "
                      f"{SAMPLING_EPS:g})")
        _check_number("top_p", self.top_p, lambda v: 0 < v <= 1, "a number in (0, 1]")
        _check_int("top_k", self.top_k, -1, None, "-1 or 0 (off) or an integer >= 1")
        _check_number("min_p", self.min_p, lambda v: 0 <= v <= 1, "a number in [0, 1]")
        _check_number("typical_p", self.typical_p, lambda v: 0 < v <= 1, "a number in (0, 1] (1 means off)")
        _check_number("repetition_penalty", self.repetition_penalty,
                      lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
                      f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 means off)")
        _check_number("presence_penalty", self.presence_penalty, lambda v: -2 <= v <= 2,
                      "a number in [-2, 2]")
        _check_number("frequency_penalty", self.frequency_penalty, lambda v: -2 <= v <= 2,
                      "a number in [-2, 2]")
        if self.seed is not None:
            _check_int("seed", self.seed, None, None, "an integer or None")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None, "an integer >= 1 or None")
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens,
                   f"an integer in [0, max_tokens={self.max_tokens}]")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS,
                       f"an integer in [0, {MAX_LOGPROBS}] or None")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            _fail("structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")
        self.stop_strings = _stop_list(self.stop)
        self.stop_token_ids = _token_id_list(self.stop_token_ids)
        # The values the sampler works with (see the module's docstring).
        self.temperature = 0.0 if self.temperature < SAMPLING_EPS else float(self.temperature)
        self.top_p = max(float(self.top_p), SAMPLING_EPS)
        self.typical_p = max(float(self.typical_p), SAMPLING_EPS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _fail(name: str, value: object, allowed: str) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 64 else shown[:60] + "..."
    raise ValueError(f"SamplingParams.{name}={shown} is invalid: it must be {allowed}.")


def _check_int(name: str, value: object, low: int | None, high: int | None, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, allowed)
    if (low is not None and value < low) or (high is not None and value > high):
        _fail(name, value, allowed)


def _check_number(name: str, value: object, ok, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, value, allowed)
    try:
        finite = math.isfinite(value)  # an int too big for a float overflows here
    except OverflowError:
        finite = False
    if not finite or not ok(value):
        _fail(name, value, allowed)


def _logit_bias(bias: dict[int, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    allowed = "a dict of token id (integer >= 0) to a number in [-100, 100], or None"
    if not isinstance(bias, dict):
        _fail("logit_bias", bias, allowed)
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            _fail("logit_bias", bias, allowed)
        _check_number("logit_bias", value, lambda v: -100 <= v <= 100, allowed)
    return {token: float(value) for token, value in bias.items()}


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        _fail("stop", stop, "a string, a list of strings, or None")
    return [s for s in stop if s]


def _token_id_list(ids: list[int] | None) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple, set)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        _fail("stop_token_ids", ids, "a list of token ids (integers >= 0) or None")
    return list(ids)
