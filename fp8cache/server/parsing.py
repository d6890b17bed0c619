"""Request bodies read and parsed here (not by FastAPI's body binding) so that every refusal, from a body
that is too big or not UTF-8 down to a bad field, is a RequestError and gets the error shape of its API."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from fp8cache.jsonkind import json_kind
from fp8cache.server.errors import TGI_DIALECT_MODEL, is_openai
from fp8cache.server.protocol.request_error import RequestError, validation_error
from fp8cache.server.state import app_state

# Past this much we stop reading a refused body and just close the connection.
DRAIN_LIMIT = 64 * 2**20


async def drain(receive, limit: int) -> None:
    """Read and drop the body so the client can read our answer (closing on unread data resets it)."""
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def body_too_large(limit: int) -> RequestError:
    return RequestError(f"request body is larger than the server's limit of {limit} bytes "
                        "(fp8kv run --max-request-bytes)", status=413, code="request_too_large")


async def _read_body(request: Request, limit: int) -> bytes:
    # ASGI messages rather than request.stream(): we must know whether the message that crossed the limit was
    # the last one. Draining after the last one would wait for a disconnect the client never sends (it waits
    # for our answer): a whole oversized body arriving in one read used to hang until the client timed out.
    chunks, size, more = [], 0, True
    while more:
        message = await request.receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        body, more = message.get("body", b""), message.get("more_body", False)
        size += len(body)
        if size > limit:
            if more:
                await drain(request.receive, DRAIN_LIMIT)
            raise body_too_large(limit)
        chunks.append(body)
    return b"".join(chunks)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> Any:
    raw = await _read_body(request, limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"request body is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset "
                           f"{exc.start}); send JSON encoded as UTF-8", param="body", code="invalid_utf8")
    if not text.strip():
        raise RequestError("request body is empty; send a JSON object", param="body", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column "
                           f"{exc.colno}", param="body", code="invalid_json")
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise RequestError(f"request body is not valid JSON: {reason}", param="body", code="invalid_json")
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object ({{...}}), not {json_kind(body)}", param="body",
                           code="invalid_json")
    if _SURROGATE_ESCAPE.search(text):
        _refuse_lone_surrogates(body)
    return body


# JSON may escape a UTF-16 surrogate on its own ("\ud800"): Python keeps it as a str that no tokenizer or
# encoder accepts. Pairs are joined into one character by the parser, so what is left is alone.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(body: dict) -> None:
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                name = f"{path}.{key}" if path else str(key)
                _check_text(path or "body", key)
                stack.append((name, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(path, value)


def _check_text(path: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise RequestError(f"{path}: has a lone UTF-16 surrogate (\\u{code:04x}) at character {exc.start}, which "
                           "is not a character; send valid Unicode (a surrogate escape needs its pair)",
                           param=path, code="invalid_unicode") from None


async def parse(request: Request, model: type[BaseModel]) -> Any:
    state = app_state(request)
    body = await read_json(request, state.settings.max_request_bytes)
    note_flags(request, body)
    return validated(model, body)


def note_flags(request: Request, body: dict) -> None:
    """What the answer's shape depends on, noted before the body is validated so that its refusal has that
    shape too (errors.request_flags): a streamed request, and a /v1 request in TGI's dialect."""
    request.state.streamed = body.get("stream") is True
    request.state.tgi_dialect = is_openai(request.url.path) and body.get("model") == TGI_DIALECT_MODEL


def validated(model: type[BaseModel], body: dict) -> Any:
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise RequestError("request body is nested too deeply", param="body", code="invalid_json")
