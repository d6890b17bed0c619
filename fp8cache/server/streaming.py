"""Streamed answers: server-sent events, the new text of each choice since its last event, and the error
event that ends a stream the server could not finish."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from fp8cache.server.async_engine import RequestStream
from fp8cache.server.errors import ENGINE_GONE, error_body, is_openai
from fp8cache.server.generation import close_all
from fp8cache.server.protocol.request_error import RequestError


class SSEResponse(StreamingResponse):
    """Server-sent events that close their request streams however the response ends."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_all(self.streams)


def sse(data: BaseModel | dict | str) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump_json(exclude_none=False)
    elif isinstance(data, dict):
        data = json.dumps(data, ensure_ascii=False)
    return f"data: {data}\n\n"


class TextDelta:
    """New text and tokens of one choice since the last event (the engine reports cumulative ones).

    The engine's text only ever grows: it holds back partial UTF-8 characters and anything that could
    still become a stop string, so a suffix is always the new part.
    """

    def __init__(self) -> None:
        self.text = ""
        self.num_tokens = 0
        self.finish_reason: str | None = None

    def update(self, completion: Any, hold_empty: bool = False) -> tuple[str, list[int], list | None]:
        """New text, tokens and the tokens' logprob dicts (None unless requested). hold_empty: when there is
        no new text, return nothing and keep the new tokens for the next call (their logprobs then go out
        with the text they make)."""
        delta = completion.text[len(self.text):]
        if hold_empty and not delta:
            end = self.num_tokens
        else:
            end = len(completion.token_ids)
            self.text = completion.text
        start, self.num_tokens = self.num_tokens, end
        entries = None if completion.logprobs is None else completion.logprobs[start:end]
        return delta, list(completion.token_ids[start:end]), entries


def stream_error(path: str, message: str = ENGINE_GONE, tgi_type: str = "generation") -> str:
    """The error event that ends a stream the server could not finish."""
    err = RequestError(f"generation failed: {message}", status=500, code="generation_error",
                       error_type="internal_server_error")
    body = error_body(path, err)
    if not is_openai(path):
        body["error_type"] = tgi_type
    return sse(body)
