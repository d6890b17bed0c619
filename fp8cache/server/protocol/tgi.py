"""Hugging Face TGI's POST /generate, /generate_stream and /: the request (with TGI's own parameter
ranges and grammar), the response and the events of a streamed response."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from fp8cache.engine.sampling_params import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from fp8cache.engine.structured_output import StructuredOutputsParams
from fp8cache.server.protocol.base import INT64_MAX, MAX_LOGPROBS, Strict, check_stop, refuse_if_set


class TGIGrammar(Strict):
    """TGI's grammar: {"type": "json", "value": schema}, {"type": "json_schema", "value": {"name", "schema"}}
    or {"type": "regex", "value": pattern}."""

    type: Literal["json", "json_schema", "regex"]
    value: Any

    def structured_outputs(self) -> StructuredOutputsParams:
        value = self.value
        if self.type == "json_schema":
            if not isinstance(value, dict) or not isinstance(value.get("schema"), dict):
                raise ValueError('a "json_schema" grammar needs value {"name": ..., "schema": {...}}')
            value = value["schema"]
        if self.type == "regex":
            if not isinstance(value, str):
                raise ValueError('a "regex" grammar needs a string value')
            return StructuredOutputsParams(regex=value)
        if not isinstance(value, (dict, str)):
            raise ValueError("a JSON grammar needs a JSON schema value")  # noqa: TRY004 - pydantic wants ValueError
        return StructuredOutputsParams(json=value)


class GenerateParameters(Strict):
    """TGI's parameters object, with TGI's own ranges (temperature > 0, 0 < top_p < 1, top_k > 0)."""

    best_of: int | None = Field(None, ge=1, le=1)
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    grammar: TGIGrammar | None = None
    max_new_tokens: int | None = Field(None, ge=1)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    return_full_text: bool | None = False
    seed: int | None = Field(None, ge=0, le=INT64_MAX)
    stop: Any = None
    temperature: float | None = Field(None, gt=0.0, le=100.0)
    top_k: int | None = Field(None, gt=0)
    top_n_tokens: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    top_p: float | None = Field(None, gt=0.0, lt=1.0)
    truncate: int | None = Field(None, ge=1)
    typical_p: float | None = Field(None, gt=0.0, lt=1.0)
    watermark: bool = False
    adapter_id: str | None = None

    refuse_tgi = refuse_if_set("adapter_id", "watermark")

    @field_validator("grammar")
    @classmethod
    def _grammar(cls, value: TGIGrammar | None) -> TGIGrammar | None:
        if value is not None:
            value.structured_outputs()  # its shape errors, named here
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> list[str] | None:
        return check_stop(value, allow_str=False)

    def sampling_kwargs(self) -> dict[str, Any]:
        # TGI samples when asked to or when any warper is set; otherwise it is greedy.
        warpers = ("top_k", "top_p", "typical_p")
        sample = self.do_sample or self.temperature is not None or any(getattr(self, w) is not None for w in warpers)
        kwargs: dict[str, Any] = {"temperature": (self.temperature or 1.0) if sample else 0.0}
        if self.grammar is not None:
            kwargs["structured_outputs"] = self.grammar.structured_outputs()
        for name in (*warpers, "repetition_penalty", "frequency_penalty", "seed", "stop"):
            value = getattr(self, name)
            if value is not None and (sample or name not in warpers):
                kwargs[name] = value
        return kwargs


class GenerateRequest(Strict):
    inputs: str = Field(min_length=1)
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False  # only read by the compat route POST /


# The responses as TGI serializes them (its router's GenerateResponse, Details, StreamResponse): what TGI leaves
# out when empty is left out here too, the rest is null when unset.
def _omitted_if_none(default: Any = None) -> Any:
    return Field(default, exclude_if=lambda value: value is None)


class TGIToken(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class TGIPrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None = None  # None for the first token: nothing predicts it


class TGIDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None = None
    prefill: list[TGIPrefillToken] = Field(default_factory=list)
    tokens: list[TGIToken] = Field(default_factory=list)
    top_tokens: list[list[TGIToken]] | None = _omitted_if_none()
    best_of_sequences: list | None = _omitted_if_none()


class TGIGenerateResponse(BaseModel):
    generated_text: str
    details: TGIDetails | None = _omitted_if_none()


class TGIStreamDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None = None
    input_length: int


class TGIStreamResponse(BaseModel):
    index: int
    token: TGIToken
    top_tokens: list[TGIToken] | None = _omitted_if_none()
    generated_text: str | None = None
    details: TGIStreamDetails | None = None
