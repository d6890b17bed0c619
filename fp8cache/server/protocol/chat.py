"""POST /v1/chat/completions: the request (messages, tools and tool_choice), the response and the chunks
of a streamed response."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from fp8cache.server.protocol.base import MAX_LOGPROBS, MAX_MESSAGES, Strict, only_with
from fp8cache.server.protocol.outputs import PromptLogprobs, UsageInfo
from fp8cache.server.protocol.sampling import SamplingFields
from fp8cache.version import __version__

# OpenAI's system_fingerprint names the backend configuration; TGI's clients require it to be a string.
SYSTEM_FINGERPRINT = f"fp8kv-{__version__}"


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

    _top_logprobs = only_with("top_logprobs", "logprobs", "needs logprobs: true")

    def sampling_kwargs(self) -> dict[str, Any]:
        return super().sampling_kwargs() | ({"logprobs": self.top_logprobs or 0} if self.logprobs else {})

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


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
    system_fingerprint: str = SYSTEM_FINGERPRINT
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
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
