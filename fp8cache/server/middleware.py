"""ASGI middleware: request metrics, and the guard that checks Host, API key, content type and body size
before any route reads the body."""

from __future__ import annotations

import hmac
import logging
import time

from fp8cache.server.errors import error_response
from fp8cache.server.metrics import ServerMetrics
from fp8cache.server.parsing import DRAIN_LIMIT, body_too_large, drain
from fp8cache.server.protocol.request_error import RequestError
from fp8cache.server.state import ServerSettings

logger = logging.getLogger("fp8kv.server")

_PUBLIC_PATHS = ("/health",)
# The paths app.py serves. Metrics label any other path "other" (a scan of random paths must not grow the
# label set), and the guard requires JSON only of POSTs to these.
_ROUTES = ("/", "/v1/completions", "/v1/chat/completions", "/v1/models", "/generate", "/generate_stream",
           "/info", "/health", "/metrics", "/tokenize", "/detokenize")


class MetricsMiddleware:
    """Counts every HTTP request by route and status and times it until its last byte."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, complete = time.monotonic(), [499], [False]

        async def send_and_record(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete[0] = True
            await send(message)

        failed = False
        try:
            await self.app(scope, receive, send_and_record)
        except BaseException:
            failed = True
            raise
        finally:
            route = scope["path"] if scope["path"] in _ROUTES else "other"
            if failed:
                code = 500 if status[0] == 499 else status[0]
            else:
                # 499 (nginx's "client closed request"): the client left before the whole answer was sent.
                code = status[0] if complete[0] and status[0] != 499 else 499
            if code == 499:
                logger.info("%s %s: the client went away before the answer was complete", scope["method"], route)
            self.metrics.observe_request(route, code, time.monotonic() - start)


class GuardMiddleware:
    """Host, API key, content type and body size checks, done before any route reads the body."""

    def __init__(self, app, settings: ServerSettings) -> None:
        self.app, self.settings = app, settings
        self._key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope["headers"])
        refusal = self._host_refusal(headers)
        if refusal is None and self._key is not None and path not in _PUBLIC_PATHS and not self._authorized(headers):
            refusal = RequestError("missing or invalid API key; send the header 'Authorization: Bearer <key>'",
                                   status=401, code="invalid_api_key", error_type="authentication_error")
        if refusal is None and scope["method"] == "POST" and path in _ROUTES:
            refusal = _content_type_refusal(headers)
        if refusal is not None:
            await drain(receive, DRAIN_LIMIT)
            extra = {"WWW-Authenticate": "Bearer"} if refusal.status == 401 else None
            return await error_response(path, refusal, extra)(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.settings.max_request_bytes
            except ValueError:
                too_big = False  # h11 refuses malformed lengths before we get here
            if too_big:
                await drain(receive, DRAIN_LIMIT if int(declared) <= DRAIN_LIMIT else 0)
                return await error_response(path, body_too_large(self.settings.max_request_bytes),
                                            {"Connection": "close"})(scope, receive, send)
        await self.app(scope, receive, send)

    def _host_refusal(self, headers: dict[bytes, bytes]) -> RequestError | None:
        allowed = self.settings.allowed_hosts
        if allowed is None:
            return None
        raw = headers.get(b"host", b"").decode("latin-1")
        if host_name(raw) in allowed:
            return None
        return RequestError(
            f"the Host header {raw!r} is not a name of this server: it listens on a loopback address and answers "
            f"only requests addressed to {', '.join(sorted(allowed))} (this stops web pages from reaching it "
            "through DNS rebinding); use one of those names, or serve other names with --host and --api-key",
            status=403, code="host_not_allowed", error_type="permission_error")

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        value = headers.get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        # compare_digest keeps the comparison time independent of where the key first differs.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def host_name(header: str) -> str:
    """The name in a Host header, without port, brackets, case or a trailing dot."""
    header = header.strip().lower()
    if header.startswith("["):
        name = header[1:].partition("]")[0]
    else:
        name = header.rpartition(":")[0] if header.count(":") == 1 else header
    return name.rstrip(".")


def _content_type_refusal(headers: dict[bytes, bytes]) -> RequestError | None:
    # A web page may POST text/plain or a form to any address without asking (no CORS preflight); only
    # application/json needs the preflight this server never grants.
    value = headers.get(b"content-type", b"").decode("latin-1")
    if value.partition(";")[0].strip().lower() == "application/json":
        return None
    given = f"Content-Type {value!r}" if value else "no Content-Type"
    return RequestError(f"request body must be JSON sent with 'Content-Type: application/json' (got {given}); "
                        "with curl, add -H 'Content-Type: application/json'", status=415, param="body",
                        code="unsupported_media_type")
