"""Request and response bodies of the HTTP API: OpenAI (/v1/...) and Hugging Face TGI (/generate, ...).

Requests are parsed strictly: JSON types must match (no "0.5" for a float), unknown fields are refused,
ranges are checked here, and fields fp8kv cannot honour (tool_choice "auto", LoRA adapters, ...) are
refused with a message instead of being silently ignored. Checks that need the model (prompt length against
max-model-len, token ids against the vocabulary, the model name) live in app.py.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fp8cache.engine.structured_output import StructuredOutputsParams

MAX_N = 16
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI allows 300)
MAX_LOGPROBS = 20  # top logprobs per token (SamplingParams allows as many)
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 512
MAX_MESSAGES = 4096
INT64_MAX = 2**63 - 1
_TOKEN_ID_DIGITS = 10
_TOKEN_ID_KEY = re.compile(rf"[0-9]{{1,{_TOKEN_ID_DIGITS}}}")


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def _is_unset(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (str, list, dict)) and not value)


def _refuse_if_set(*names: str):
    """A validator for fields fp8kv cannot honour: absent, null, false or empty passes; anything else fails."""

    def check(cls, value: Any, info: ValidationInfo) -> Any:
        if not _is_unset(value):
            raise ValueError(f"{info.field_name} is not supported by fp8kv; remove it from the request")
        return value

    return field_validator(*names)(classmethod(check))


def _check_stop(value: Any, *, allow_str: bool) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str) and allow_str:
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError("must be " + ("a string or " if allow_str else "") + "a list of strings")
    if len(value) > MAX_STOP_SEQUENCES:
        raise ValueError(f"has {len(value)} sequences; at most {MAX_STOP_SEQUENCES} are allowed")
    for s in value:
        if not s:
            raise ValueError("stop sequences must not be empty strings")
        if len(s) > MAX_STOP_LENGTH:
            raise ValueError(f"a stop sequence has {len(s)} characters; at most {MAX_STOP_LENGTH} are allowed")
    return value


def _check_token_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise ValueError(f"{what} must be a list of integer token ids")
    if any(t < 0 for t in value):
        raise ValueError(f"{what} must not contain negative token ids")
    return value


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
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
        return _check_stop(value, allow_str=True)

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
        return None if value is None else _check_token_ids(value, "stop_token_ids")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of different from n is not supported by fp8kv; remove best_of")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("is only allowed with stream: true")
        return value

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


class CompletionRequest(SamplingFields):
    prompt: Any
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    refuse_completion = _refuse_if_set("suffix")

    def sampling_kwargs(self) -> dict[str, Any]:
        if self.logprobs is None:
            return super().sampling_kwargs()
        # echo returns the prompt's tokens too, and so their logprobs
        return super().sampling_kwargs() | {"logprobs": self.logprobs} | (
            {"prompt_logprobs": max(self.logprobs, self.prompt_logprobs or 0)} if self.echo else {})

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> list[str | list[int]]:
        """Normalise to a list of prompts, each text or token ids (OpenAI allows all four shapes)."""
        if isinstance(value, str) or (isinstance(value, list) and value and all(type(t) is int for t in value)):
            prompts = [value]
        elif isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
            prompts = value
        else:
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists "
                             "of token ids, and not empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"has {len(prompts)} prompts; at most {MAX_PROMPTS} per request")
        for p in prompts:
            if isinstance(p, list):
                _check_token_ids(p, "a token-id prompt")
            if not p:
                raise ValueError("must not be empty")
        return prompts



class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Any] | None = None
    name: str | None = Field(None, max_length=256)
    refusal: str | None = None  # echoed back by clients that resend our own assistant messages
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls, for the chat template
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if isinstance(value, list):
            parts = []
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are "
                                     "supported")
                parts.append(TextPart.model_validate(part, strict=True).text)
            return "".join(parts)
        return value

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


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


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools")
        if value in (None, "none"):
            return value
        if not tools:
            raise ValueError("needs tools")
        if value == "auto":
            raise ValueError('"auto" needs a model-specific tool-call parser, which fp8kv does not have; use '
                             '"required" or name a function')
        names = [t.function.name for t in tools]
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"names function {value.function.name!r}, which is not among the tools "
                             f"({', '.join(names)})")
        return value

    @property
    def calls_tools(self) -> bool:
        """Whether the output is constrained to tool calls ("required" or a named function)."""
        return bool(self.tools) and self.tool_choice not in (None, "none")

    @model_validator(mode="after")
    def _tools_or_structure(self) -> ChatCompletionRequest:
        if self.calls_tools and self.structured_outputs() is not None:
            raise ValueError(f"tool_choice and {self.structure_field()} each constrain the output; give one")
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    def sampling_kwargs(self) -> dict[str, Any]:
        return super().sampling_kwargs() | ({"logprobs": self.top_logprobs or 0} if self.logprobs else {})

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(Strict):
    """vLLM's POST /tokenize: a completion prompt or chat messages (rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as the routes do)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)

    @field_validator("tokens")
    @classmethod
    def _tokens(cls, value: list[int]) -> list[int]:
        return _check_token_ids(value, "tokens")


# -- TGI ----------------------------------------------------------------------------------------------


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
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
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

    refuse_tgi = _refuse_if_set("adapter_id", "watermark")

    @field_validator("grammar")
    @classmethod
    def _grammar(cls, value: TGIGrammar | None) -> TGIGrammar | None:
        if value is not None:
            value.structured_outputs()  # its shape errors, named here
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> list[str] | None:
        return _check_stop(value, allow_str=False)

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


class TGITokenizeRequest(Strict):
    inputs: str = Field(min_length=1)
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)  # accepted, as TGI does


# -- responses ----------------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions shape: parallel lists, one entry per generated token."""

    text_offset: list[int]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token: nothing predicts it
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, None (the first) or {token id: its logprob}
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaToolCall(ToolCall):
    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fp8kv"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TGIToken(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class TGIPrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None = None


class TGIDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None = None
    prefill: list[TGIPrefillToken] = Field(default_factory=list)
    tokens: list[TGIToken] = Field(default_factory=list)
    top_tokens: list[list[TGIToken]] | None = None
    best_of_sequences: list | None = None


class TGIGenerateResponse(BaseModel):
    generated_text: str
    details: TGIDetails | None = None


class TGIStreamDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None = None
    input_length: int | None = None


class TGIStreamResponse(BaseModel):
    index: int
    token: TGIToken
    top_tokens: list[TGIToken] | None = None
    generated_text: str | None = None
    details: TGIStreamDetails | None = None


# -- errors -------------------------------------------------------------------------------------------


class RequestError(Exception):
    """A request the server refuses; rendered in the OpenAI or the TGI error shape by app.py."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.error_type = error_type


def _loc_name(loc: tuple) -> str:
    return ".".join(str(part) for part in loc if not (isinstance(part, str) and part.startswith("function-")))


def validation_error(exc: ValidationError, status: int = 400) -> RequestError:
    """One RequestError for a pydantic failure; names the first bad field and lists the others."""
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if p not in ("str", "list[any]", "int", "float", "bool"))
        name = _loc_name(loc) or "body"
        if err["type"] == "extra_forbidden":
            problems.append((name, "unknown field; remove it"))
        elif err["type"] == "missing":
            problems.append((name, "is required"))
        else:
            msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
            problems.append((name, msg))
    problems = _merge_same_field(problems)
    first = problems[0][0] if problems else None
    message = "; ".join(f"{name}: {msg}" for name, msg in problems[:5])
    if len(problems) > 5:
        message += f"; and {len(problems) - 5} more problems"
    return RequestError(message, status=status, param=first, code="invalid_value")


def _merge_same_field(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    # A union field reports one failure per member ("valid string", "valid list"): say them as one.
    merged: dict[str, list[str]] = {}
    for name, msg in problems:
        if msg not in merged.setdefault(name, []):
            merged[name].append(msg)
    return [(name, " or ".join(msgs)) for name, msgs in merged.items()]
