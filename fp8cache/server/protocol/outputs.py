"""Pieces of the OpenAI responses that /v1/completions and /v1/chat/completions share: token usage and
vLLM's prompt_logprobs."""

from __future__ import annotations

from pydantic import BaseModel


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, None (the first) or {token id: its logprob}
PromptLogprobs = list[dict[str, PromptLogprob] | None]
