"""Streamed answers: server-sent events, the new text of each choice since its last event, the error event
that ends a stream the server could not finish, and TGI's dialect of the chat chunks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from fp8cache.server.async_engine import RequestStream
from fp8cache.server.errors import (
    ENGINE_GONE,
    TGI_CHAT_PATH,
    error_body,
    internal_error,
    is_openai,
    request_flags,
)
from fp8cache.server.generation import close_all
from fp8cache.server.protocol.request_error import RequestError


class SSEResponse(StreamingResponse):
    """Server-sent events that close their request streams however the response ends."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"]
        events = _ending_in_error_event(self.body_iterator, path)
        if path == TGI_CHAT_PATH and request_flags(scope).get("tgi_dialect"):
            events = tgi_chat_events(events)
        self.body_iterator = events
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_all(self.streams)


async def _ending_in_error_event(events: AsyncIterator[str], path: str) -> AsyncIterator[str]:
    """events, and for a failure while they are made an error event, which clients raise: cut off instead, a
    stream looks to some of them like an answer that ended early (or, before its first event, an empty one)."""
    try:
        async for event in events:
            yield event
    except RequestError as err:  # a refusal that could only be found once the stream was open
        yield sse(error_body(path, err))
    except Exception as exc:  # noqa: BLE001 - a bug: logged with an id the client's error gives
        yield sse(error_body(path, internal_error(exc, f"the stream of {path}")))


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


async def tgi_chat_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Chat chunks as TGI sends them, which text-generation's Client.chat(stream=True) requires: every delta
    with its role and tool_calls, errors in TGI's shape, and no closing [DONE] (it is not JSON, and that client
    fails on it; the OpenAI SDK and huggingface_hub end the stream at its end either way)."""
    async for event in events:
        data = event.removeprefix("data: ").strip()
        if data == "[DONE]":
            continue
        yield sse(tgi_chat_chunk(json.loads(data)))


def tgi_chat_chunk(chunk: dict[str, Any]) -> dict[str, Any]:
    error = chunk.get("error")
    if isinstance(error, dict):
        refused = error.get("type") == "invalid_request_error"
        return {"error": error.get("message"), "error_type": "validation" if refused else "generation"}
    for choice in chunk.get("choices", []):
        choice["delta"] = {"role": "assistant", "content": None, "tool_calls": None} | choice["delta"]
    return chunk
