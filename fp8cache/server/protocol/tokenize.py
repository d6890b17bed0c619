"""POST /tokenize (vLLM's body and TGI's) and POST /detokenize."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from fp8cache.server.protocol.base import MAX_MESSAGES, Strict, check_token_ids
from fp8cache.server.protocol.chat import ChatMessage
from fp8cache.server.protocol.tgi import GenerateParameters


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
        return check_token_ids(value, "tokens")


class TGITokenizeRequest(Strict):
    inputs: str = Field(min_length=1)
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)  # accepted, as TGI does
