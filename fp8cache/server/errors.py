"""Refusals and failures as HTTP answers: a RequestError in its API's error shape (OpenAI's
{"error": {"message", "type", "param", "code"}} under /v1, TGI's {"error", "error_type"} elsewhere and for a
refused chat stream in TGI's dialect), and the exception handlers that give every other failure the same shapes."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from fp8cache.server.async_engine import EngineDeadError, RequestAborted
from fp8cache.server.protocol.request_error import RequestError

logger = logging.getLogger("fp8kv.server")


def is_openai(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


# TGI's clients name the model "tgi" on TGI's OpenAI routes (text-generation's Client.chat always does). On the
# chat route such a request is streamed in TGI's dialect, which that client parses (streaming.tgi_chat_events),
# and a refused stream is TGI's error event (error_response). Noted on the request's state by parsing.parse.
TGI_DIALECT_MODEL = "tgi"
TGI_CHAT_PATH = "/v1/chat/completions"


def request_flags(scope: dict[str, Any]) -> dict[str, Any]:
    """What parsing.parse noted of the body (tgi_dialect, streamed); empty before the body is read."""
    return scope.get("state") or {}


_TGI_TYPES = {401: "authentication", 403: "forbidden", 404: "not_found", 413: "validation", 415: "validation",
              429: "overloaded", 503: "unavailable", 500: "generation"}
_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 429: "rate_limit_error", 503: "service_unavailable", 500: "internal_server_error"}


def error_body(path: str, err: RequestError, tgi: bool | None = None) -> dict:
    """err in OpenAI's shape or TGI's (by default: TGI's outside /v1)."""
    if (is_openai(path) if tgi is None else not tgi):
        kind = "invalid_request_error" if err.status in (400, 413, 415, 422) else \
            _OPENAI_TYPES.get(err.status, err.error_type)
        return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}
    return {"error": err.message, "error_type": _TGI_TYPES.get(err.status, "validation")}


def error_response(path: str, err: RequestError, headers: dict | None = None,
                   flags: dict[str, Any] | None = None) -> Response:
    """The answer to a refused request; flags: what parsing.parse noted of its body (see request_flags)."""
    flags = flags or {}
    # TGI answers validation failures with 422; OpenAI with 400.
    status = 422 if err.status == 400 and not is_openai(path) else err.status
    if path == TGI_CHAT_PATH and flags.get("tgi_dialect") and flags.get("streamed"):
        # text-generation's Client.chat(stream=True) reads only the body's "data:" lines, whatever the status:
        # a JSON body would leave it an empty stream. TGI's error event it raises.
        event = json.dumps(error_body(path, err, tgi=True), ensure_ascii=False)
        return Response(f"data: {event}\n\n", status_code=status, headers=headers, media_type="text/event-stream")
    return JSONResponse(error_body(path, err), status_code=status, headers=headers)


def _answer(request: Request, err: RequestError, headers: dict | None = None) -> Response:
    return error_response(request.url.path, err, headers, request_flags(request.scope))


async def request_error_handler(request: Request, exc: RequestError) -> Response:
    return _answer(request, exc)


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
    message = {404: f"no route {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions, "
                    "/generate, /generate_stream, /info, /health, /metrics",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                        str(exc.detail))
    err = RequestError(message, status=exc.status_code, code="not_found" if exc.status_code == 404 else None)
    return _answer(request, err, headers=getattr(exc, "headers", None))


# Error bodies say what happened in the client's terms; what raised, and where, goes to the log only.
ENGINE_GONE = "the engine crashed or stopped; the server is restarting, retry later"
SHUTTING_DOWN = "the server is shutting down and cut this request at its graceful timeout; retry later"


async def engine_dead_handler(request: Request, exc: EngineDeadError) -> Response:
    err = RequestError(ENGINE_GONE, status=503, code="engine_unavailable", error_type="service_unavailable")
    return _answer(request, err)


async def aborted_handler(request: Request, exc: RequestAborted) -> Response:
    err = RequestError(SHUTTING_DOWN, status=503, code="shutting_down", error_type="service_unavailable")
    return _answer(request, err)


async def client_gone_handler(request: Request, exc: ClientDisconnect) -> Response:
    # Nobody reads this answer; it is here for the metrics and the access log (499, nginx's "client closed").
    return Response(status_code=499)


def internal_error(exc: BaseException, where: str) -> RequestError:
    """An unexpected failure: logged under an id, which the client's error gives."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s on %s: %s", error_id, where, type(exc).__name__,
                 exc_info=(type(exc), exc, exc.__traceback__))
    return RequestError(f"internal error (id {error_id}, in the server log); this is a bug in fp8kv, please "
                        "report it", status=500, code="internal_error", error_type="internal_server_error")


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    return _answer(request, internal_error(exc, f"{request.method} {request.url.path}"))
