"""The sampling fields both OpenAI request bodies carry (OpenAI's names plus vLLM's extensions), with the
structured output they may ask for, and their translation into SamplingParams keyword arguments."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from fp8cache.engine.sampling_params import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from fp8cache.engine.structured_output import StructuredOutputsParams
from fp8cache.server.protocol.base import (
    INT64_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_LENGTH,
    MAX_STOP_SEQUENCES,
    Strict,
    check_stop,
    check_token_ids,
    only_with,
)
from fp8cache.server.protocol.request_error import RequestError

_TOKEN_ID_DIGITS = 10
_TOKEN_ID_KEY = re.compile(rf"[0-9]{{1,{_TOKEN_ID_DIGITS}}}")


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Strict):
    name: str = Field(max_length=256)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema goes with type "json_schema" (and only with it)')
        return self


class SamplingFields(Strict):
    """Sampling knobs shared by both OpenAI routes (OpenAI names, plus vLLM's extensions)."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Any] | None = None
    user: str | None = Field(None, max_length=256)
    seed: int | None = Field(None, ge=0, le=INT64_MAX)
    best_of: int | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    min_tokens: int | None = Field(None, ge=0)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, max_length=MAX_STOP_LENGTH * 8)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=1024)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> list[str] | None:
        return check_stop(value, allow_str=True)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for token, bias in (value or {}).items():
            # ASCII digits only: str.isdigit() also passes "²", which int() refuses.
            if not _TOKEN_ID_KEY.fullmatch(token):
                shown = token if len(token) <= 32 else token[:32] + "..."
                raise ValueError(f"key {shown!r} is not a token id; keys are token ids as strings of at most "
                                 f"{_TOKEN_ID_DIGITS} digits, e.g. \"50256\"")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {token} must be a number in [-100, 100]")
        if value is not None and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        return None if value is None else check_token_ids(value, "stop_token_ids")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of different from n is not supported by fp8kv; remove best_of")
        return value

    _stream_options = only_with("stream_options", "stream", "is only allowed with stream: true")

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("is not available with stream: true (as in vLLM)")
        return value

    @model_validator(mode="after")
    def _one_structure(self) -> SamplingFields:
        given = [name for name in ("guided_json", "guided_regex", "guided_choice") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} each constrain the output; give one")
        return self

    def structure_field(self) -> str:
        """The field that asked for structured output (for error messages)."""
        return next((n for n in ("guided_json", "guided_regex", "guided_choice") if getattr(self, n) is not None),
                    "response_format")

    def structured_outputs(self) -> StructuredOutputsParams | None:
        try:
            if self.guided_json is not None:
                return StructuredOutputsParams(json=self.guided_json)
            if self.guided_regex is not None:
                return StructuredOutputsParams(regex=self.guided_regex)
            if self.guided_choice is not None:
                return StructuredOutputsParams(choice=self.guided_choice)
        except ValueError as exc:
            raise RequestError(str(exc), param=self.structure_field(), code="invalid_value") from None
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object" or fmt.json_schema.json_schema is None:
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for SamplingParams, leaving out what the client did not set."""
        kwargs = {"n": self.n, "ignore_eos": self.ignore_eos}
        structure = self.structured_outputs()
        if structure is not None:
            kwargs["structured_outputs"] = structure
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "skip_special_tokens",
                     "include_stop_str_in_output", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.logit_bias:
            kwargs["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
        return kwargs
