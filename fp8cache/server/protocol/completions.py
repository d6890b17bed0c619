"""POST /v1/completions: the request and the response bodies."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from fp8cache.server.protocol.base import MAX_LOGPROBS, MAX_PROMPTS, check_token_ids, refuse_if_set
from fp8cache.server.protocol.outputs import PromptLogprobs, UsageInfo
from fp8cache.server.protocol.sampling import SamplingFields


class CompletionRequest(SamplingFields):
    prompt: Any
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    refuse_completion = refuse_if_set("suffix")

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
            raise ValueError("must be a string, an array of strings, an array of token ids or an array of "
                             "arrays of token ids, and not empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"has {len(prompts)} prompts; at most {MAX_PROMPTS} per request")
        for p in prompts:
            if isinstance(p, list):
                check_token_ids(p, "a token-id prompt")
            if not p:
                raise ValueError("must not be empty")
        return prompts


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions shape: parallel lists, one entry per generated token."""

    text_offset: list[int]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token: nothing predicts it
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


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
