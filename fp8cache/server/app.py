"""The HTTP app: OpenAI routes under /v1 (openai_routes.py), Hugging Face TGI routes at the root
(tgi_routes.py), /tokenize and /detokenize (tokenizer_routes.py), /health, /info and /metrics; and what the
routes share: body parsing, request checks, submission to the engine, streaming.

Bodies are read and parsed here (not by FastAPI's body binding) so that every refusal, from a body that is
too big or not UTF-8 down to a bad field, gets the error shape of its API: OpenAI's
{"error": {"message", "type", "param", "code"}} under /v1, TGI's {"error", "error_type"} elsewhere.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from fp8cache.server import grammar as G
from fp8cache.server import protocol as P
from fp8cache.server.async_engine import AsyncEngine, EngineDeadError, RequestAborted, RequestStream
from fp8cache.server.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger("fp8kv.server")

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
# Past this much we stop reading a refused body and just close the connection.
_DRAIN_LIMIT = 64 * 2**20
_PUBLIC_PATHS = ("/health",)
_ROUTES = ("/", "/v1/completions", "/v1/chat/completions", "/v1/models", "/generate", "/generate_stream",
           "/info", "/health", "/metrics", "/tokenize", "/detokenize")


@dataclass
class ServerSettings:
    served_model_name: str
    model_path: str | None = None
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_concurrent_requests: int = 256  # counted in sequences: a request's prompts times its n
    # Only these Host names are served (None: any). A server bound to loopback answers only to loopback names,
    # so that a web page cannot reach it through DNS rebinding.
    allowed_hosts: frozenset[str] | None = None
    structured_output_timeout: float = G.DEFAULT_TIMEOUT_S
    structured_output_memory: int = G.DEFAULT_MEMORY_BYTES
    stall_timeout: float = 60.0  # /health answers 503 when the engine had work but finished no step this long


@dataclass
class ModelInfo:
    """What the routes need to know about the loaded model and its cache."""

    tokenizer: Any
    max_model_len: int
    capacity_tokens: int
    kv_cache_dtype: str
    scales_source: str
    block_size: int
    num_blocks: int
    vocab_size: int
    model_dtype: str = "float32"
    device: str = "cpu"
    special_ids: frozenset[int] = field(default_factory=frozenset)
    kv_recent_window: int = 0  # newest tokens per sequence also kept in full precision
    window_dtype: str = "float32"  # the dtype of that window (the model dtype unless chosen)

    @classmethod
    def from_runner(cls, runner: Any) -> ModelInfo:
        tokenizer = runner.tokenizer
        vocab = len(tokenizer)
        model_vocab = getattr(getattr(runner, "hf_config", None), "vocab_size", None)
        return cls(
            tokenizer=tokenizer, max_model_len=int(runner.max_model_len),
            capacity_tokens=int(runner.capacity_tokens), kv_cache_dtype=str(runner.kv_cache_dtype),
            scales_source=str(getattr(runner, "scales_source", "none")), block_size=int(runner.block_size),
            num_blocks=int(runner.num_blocks), vocab_size=min(vocab, model_vocab) if model_vocab else vocab,
            model_dtype=str(getattr(runner, "dtype", "float32")).removeprefix("torch."),
            device=str(getattr(runner, "device", "cpu")),
            special_ids=frozenset(getattr(tokenizer, "all_special_ids", ()) or ()),
            kv_recent_window=int(getattr(runner, "kv_recent_window", 0)),
            window_dtype=str(getattr(runner, "window_dtype", getattr(runner, "dtype", "float32"))).removeprefix("torch."))


@dataclass
class AppState:
    settings: ServerSettings
    info: ModelInfo
    engine: AsyncEngine
    metrics: ServerMetrics
    sampling_params: Callable[..., Any]  # SamplingParams class (injected so tests may swap engines)
    # Two pools so that a short prompt never waits behind a megabyte one (tokenizers release the GIL, so the
    # work itself runs beside the event loop and the engine).
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="fp8kv-tokenizer"))
    large_tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="fp8kv-tokenizer-large"))
    grammar: G.GrammarCompiler | None = None  # made at the first structured output request

    def grammar_compiler(self) -> G.GrammarCompiler:
        if self.grammar is None:
            self.grammar = G.GrammarCompiler(self.info.tokenizer, self.settings.structured_output_timeout,
                                             self.settings.structured_output_memory,
                                             observe=self.metrics.observe_compile)
        return self.grammar


def create_app(state: AppState) -> FastAPI:
    app = FastAPI(title="fp8kv", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=_lifespan(state))
    app.state.fp8kv = state
    _add_routes(app)
    app.add_exception_handler(P.RequestError, _request_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(EngineDeadError, _engine_dead_handler)
    app.add_exception_handler(RequestAborted, _aborted_handler)
    app.add_exception_handler(ClientDisconnect, _client_gone_handler)
    app.add_exception_handler(Exception, _internal_error_handler)
    # The middleware added last runs first: metrics sees every request, the guard runs before any route.
    app.add_middleware(_GuardMiddleware, settings=state.settings)
    app.add_middleware(_MetricsMiddleware, metrics=state.metrics)
    return app


def _lifespan(state: AppState):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.engine.alive and state.engine.error is None:
            state.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.engine.stop()
            state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            state.large_tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            if state.grammar is not None:
                state.grammar.close()

    return lifespan


# -- errors ------------------------------------------------------------------------------------------


def _is_openai(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


_TGI_TYPES = {401: "authentication", 403: "forbidden", 404: "not_found", 413: "validation", 415: "validation",
              429: "overloaded", 503: "unavailable", 500: "generation"}
_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 429: "rate_limit_error", 503: "service_unavailable", 500: "internal_server_error"}


def error_body(path: str, err: P.RequestError) -> dict:
    if _is_openai(path):
        kind = "invalid_request_error" if err.status in (400, 413, 415, 422) else \
            _OPENAI_TYPES.get(err.status, err.error_type)
        return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}
    return {"error": err.message, "error_type": _TGI_TYPES.get(err.status, "validation")}


def error_response(path: str, err: P.RequestError, headers: dict | None = None) -> JSONResponse:
    # TGI answers validation failures with 422; OpenAI with 400.
    status = 422 if err.status == 400 and not _is_openai(path) else err.status
    return JSONResponse(error_body(path, err), status_code=status, headers=headers)


async def _request_error_handler(request: Request, exc: P.RequestError) -> JSONResponse:
    return error_response(request.url.path, exc)


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = {404: f"no route {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions, "
                    "/generate, /generate_stream, /info, /health, /metrics",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                        str(exc.detail))
    err = P.RequestError(message, status=exc.status_code, code="not_found" if exc.status_code == 404 else None)
    return error_response(request.url.path, err, headers=getattr(exc, "headers", None))


# Error bodies say what happened in the client's terms; what raised, and where, goes to the log only.
ENGINE_GONE = "the engine crashed or stopped; the server is restarting, retry later"
SHUTTING_DOWN = "the server is shutting down and cut this request at its graceful timeout; retry later"


async def _engine_dead_handler(request: Request, exc: EngineDeadError) -> JSONResponse:
    err = P.RequestError(ENGINE_GONE, status=503, code="engine_unavailable", error_type="service_unavailable")
    return error_response(request.url.path, err)


async def _aborted_handler(request: Request, exc: RequestAborted) -> JSONResponse:
    err = P.RequestError(SHUTTING_DOWN, status=503, code="shutting_down", error_type="service_unavailable")
    return error_response(request.url.path, err)


async def _client_gone_handler(request: Request, exc: ClientDisconnect) -> Response:
    # Nobody reads this answer; it is here for the metrics and the access log (499, nginx's "client closed").
    return Response(status_code=499)


async def _internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s on %s %s: %s", error_id, request.method, request.url.path, type(exc).__name__)
    err = P.RequestError(f"internal error (id {error_id}, in the server log); this is a bug in fp8kv, please "
                         "report it", status=500, code="internal_error", error_type="internal_server_error")
    return error_response(request.url.path, err)


# -- middleware --------------------------------------------------------------------------------------


class _MetricsMiddleware:
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


class _GuardMiddleware:
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
            refusal = P.RequestError("missing or invalid API key; send the header 'Authorization: Bearer <key>'",
                                     status=401, code="invalid_api_key", error_type="authentication_error")
        if refusal is None and scope["method"] == "POST" and path in _ROUTES:
            refusal = _content_type_refusal(headers)
        if refusal is not None:
            await _drain(receive, _DRAIN_LIMIT)
            extra = {"WWW-Authenticate": "Bearer"} if refusal.status == 401 else None
            return await error_response(path, refusal, extra)(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.settings.max_request_bytes
            except ValueError:
                too_big = False  # h11 refuses malformed lengths before we get here
            if too_big:
                await _drain(receive, _DRAIN_LIMIT if int(declared) <= _DRAIN_LIMIT else 0)
                return await error_response(path, _too_big(self.settings.max_request_bytes),
                                            {"Connection": "close"})(scope, receive, send)
        await self.app(scope, receive, send)

    def _host_refusal(self, headers: dict[bytes, bytes]) -> P.RequestError | None:
        allowed = self.settings.allowed_hosts
        if allowed is None:
            return None
        raw = headers.get(b"host", b"").decode("latin-1")
        if host_name(raw) in allowed:
            return None
        return P.RequestError(
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


def _content_type_refusal(headers: dict[bytes, bytes]) -> P.RequestError | None:
    # A web page may POST text/plain or a form to any address without asking (no CORS preflight); only
    # application/json needs the preflight this server never grants.
    value = headers.get(b"content-type", b"").decode("latin-1")
    if value.partition(";")[0].strip().lower() == "application/json":
        return None
    given = f"Content-Type {value!r}" if value else "no Content-Type"
    return P.RequestError(f"request body must be JSON sent with 'Content-Type: application/json' (got {given}); "
                          "with curl, add -H 'Content-Type: application/json'", status=415, param="body",
                          code="unsupported_media_type")


async def _drain(receive, limit: int) -> None:
    """Read and drop the body so the client can read our answer (closing on unread data resets it)."""
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _too_big(limit: int) -> P.RequestError:
    return P.RequestError(f"request body is larger than the server's limit of {limit} bytes "
                          "(fp8kv run --max-request-bytes)", status=413, code="request_too_large")


# -- body parsing ------------------------------------------------------------------------------------


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
                await _drain(request.receive, _DRAIN_LIMIT)
            raise _too_big(limit)
        chunks.append(body)
    return b"".join(chunks)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> Any:
    raw = await _read_body(request, limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise P.RequestError(f"request body is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset "
                             f"{exc.start}); send JSON encoded as UTF-8", param="body", code="invalid_utf8")
    if not text.strip():
        raise P.RequestError("request body is empty; send a JSON object", param="body", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise P.RequestError(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column "
                             f"{exc.colno}", param="body", code="invalid_json")
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise P.RequestError(f"request body is not valid JSON: {reason}", param="body", code="invalid_json")
    if not isinstance(body, dict):
        raise P.RequestError(f"request body must be a JSON object, not {type(body).__name__}", param="body",
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
        raise P.RequestError(f"{path}: has a lone UTF-16 surrogate (\\u{code:04x}) at character {exc.start}, which "
                             "is not a character; send valid Unicode (a surrogate escape needs its pair)",
                             param=path, code="invalid_unicode") from None


async def parse(request: Request, model: type[BaseModel]) -> Any:
    state: AppState = request.app.state.fp8kv
    return validated(model, await read_json(request, state.settings.max_request_bytes))


def validated(model: type[BaseModel], body: dict) -> Any:
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as exc:
        raise P.validation_error(exc) from None
    except RecursionError:
        raise P.RequestError("request body is nested too deeply", param="body", code="invalid_json")


# -- shared request preparation ----------------------------------------------------------------------


@dataclass
class Prepared:
    prompts: list[list[int]]
    prompt_texts: list[str]
    max_tokens: int
    params: Any


# TGI serves one model and ignores the name (its docs send "tgi"; huggingface_hub's InferenceClient with a
# base_url sends "dummy"). Other names still get vLLM's 404, which tells an OpenAI client it is misconfigured.
TGI_MODEL_NAMES = frozenset({"tgi", "dummy"})


def _check_model(state: AppState, name: str | None) -> None:
    allowed = {state.settings.served_model_name, state.settings.model_path, *TGI_MODEL_NAMES}
    if name is not None and name not in allowed:
        raise P.RequestError(f"model: the model `{name}` does not exist; this server serves "
                             f"`{state.settings.served_model_name}` (see /v1/models)", status=404,
                             param="model", code="model_not_found", error_type="not_found_error")


LARGE_TEXT = 65536  # characters (or tokens) from which tokenizer work goes to the pool for large inputs


async def _tokenize(state: AppState, fn: Callable[[], Any], size: int = 0) -> Any:
    """fn() on a tokenizer thread; size: characters or tokens it works on (a large input has its own pool)."""
    pool = state.large_tokenizer_pool if size >= LARGE_TEXT else state.tokenizer_pool
    return await asyncio.get_running_loop().run_in_executor(pool, fn)


def _check_lengths(state: AppState, prompts: list[list[int]], max_tokens: int | None, prompt_param: str,
                   tokens_param: str) -> int:
    """max_tokens to use: checked against max-model-len and the cache, or the room left if unset."""
    info = state.info
    longest = max(len(p) for p in prompts)
    limit = min(info.max_model_len, info.capacity_tokens)
    for p in prompts:
        bad = [t for t in p if t >= info.vocab_size]
        if bad:
            raise P.RequestError(f"{prompt_param}: token id {bad[0]} is outside the vocabulary "
                                 f"(0..{info.vocab_size - 1})", param=prompt_param, code="invalid_value")
    if longest >= limit:
        raise P.RequestError(
            f"{prompt_param}: the prompt has {longest} tokens, but this server's limit is {limit} tokens for "
            f"prompt plus completion ({_limit_reason(state)}); shorten the prompt", param=prompt_param,
            code="context_length_exceeded")
    if max_tokens is None:
        return limit - longest
    if longest + max_tokens > limit:
        raise P.RequestError(
            f"{tokens_param}: the prompt ({longest} tokens) plus {tokens_param} ({max_tokens}) is "
            f"{longest + max_tokens} tokens, more than this server's limit of {limit} ({_limit_reason(state)}); "
            f"lower {tokens_param} to at most {limit - longest} or shorten the prompt", param=tokens_param,
            code="context_length_exceeded")
    return max_tokens


def _limit_reason(state: AppState) -> str:
    info = state.info
    if info.capacity_tokens < info.max_model_len:
        return f"the KV cache holds {info.capacity_tokens} tokens; raise --kv-cache-memory"
    return f"--max-model-len {info.max_model_len}"


def _sampling_params(state: AppState, kwargs: dict[str, Any]) -> Any:
    """SamplingParams for kwargs (a 400 naming the field if it refuses them)."""
    bad = [t for t in kwargs.get("logit_bias", {}) if t >= state.info.vocab_size]
    if bad:
        raise P.RequestError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                             f"(0..{state.info.vocab_size - 1})", param="logit_bias", code="invalid_value")
    try:
        return state.sampling_params(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        param = next((k for k in kwargs if re.search(rf"\b{re.escape(k)}\b", message)), None)
        raise P.RequestError(message, param=param, code="invalid_value") from None


async def _compile_structure(request: Request, state: AppState, params: Any, param: str) -> None:
    """Compile params' structured output grammar in the compile workers (within their time and memory budget,
    abandoned if the client goes) and attach it, so the engine only makes guides from it; a grammar that is
    too big, too costly or invalid is a 400 naming param."""
    structure = getattr(params, "structured_outputs", None)
    if structure is None:
        return
    try:
        params.structured_outputs = await until_disconnect(request, state.grammar_compiler().compile(structure),
                                                           gone=ClientDisconnect)
    except G.GrammarError as exc:
        raise P.RequestError(f"{param}: {exc}", param=param, code="invalid_value") from None


def _admit(state: AppState, num_prompts: int, n: int) -> None:
    """Admission counts sequences (each prompt runs n of them), the unit of engine work and memory."""
    if not state.engine.alive:
        raise P.RequestError("the engine is not running; the server is shutting down or restarting",
                             status=503, code="engine_unavailable", error_type="service_unavailable")
    limit, wanted = state.settings.max_concurrent_requests, num_prompts * n
    if wanted > limit:
        raise P.RequestError(
            f"n: this request asks for {wanted} sequences ({num_prompts} prompts x n={n}), more than this server "
            f"runs at once ({limit}, fp8kv run --max-concurrent-requests); send fewer prompts or a smaller n",
            param="n", code="too_many_sequences")
    if state.engine.num_active_sequences + wanted > limit:
        raise P.RequestError(
            f"the server is at its limit of {limit} concurrent sequences (a request counts its prompts times "
            "n); retry later (fp8kv run --max-concurrent-requests)", status=429, code="overloaded",
            error_type="rate_limit_error")


def _submit_all(state: AppState, request_id: str, prepared: Prepared) -> list[RequestStream]:
    _admit(state, len(prepared.prompts), getattr(prepared.params, "n", 1))
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prepared.prompts):
            streams.append(state.engine.submit(f"{request_id}-{i}", prompt, prepared.params))
            state.metrics.prompt_tokens.inc(len(prompt))
    except ValueError as exc:
        _close_all(streams)
        raise P.RequestError(f"prompt: {exc}", param="prompt", code="invalid_value") from None
    except EngineDeadError as exc:
        _close_all(streams)
        raise P.RequestError(str(exc), status=503, code="engine_unavailable") from None
    except BaseException:
        _close_all(streams)
        raise
    return streams


def _close_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.close()


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, output) from several request streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        _close_all(streams)


async def _collect(streams: list[RequestStream]) -> dict[int, Any]:
    finals: dict[int, Any] = {}
    async for i, out in _merge(streams):
        finals[i] = out
    return finals


async def collect_finals(request: Request, streams: list[RequestStream]) -> dict[int, Any] | Response:
    """Every prompt's final output, or the response to send if the client went away first; the streams are
    closed either way."""
    try:
        return await until_disconnect(request, _collect(streams))
    finally:
        _close_all(streams)


async def until_disconnect(request: Request, work: Awaitable[Any], gone: type[Exception] | None = None) -> Any:
    """Run `work` unless the client goes away first: then cancel it (which aborts its requests) and return a
    499 response, or raise `gone` if given."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        if gone is not None:
            raise gone()
        return Response(status_code=499)
    finally:
        task.cancel()
        watcher.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
            _close_all(self.streams)


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


def _usage(prompts: list[list[int]], finals: dict[int, Any]) -> P.UsageInfo:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    return P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       total_tokens=prompt_tokens + completion_tokens)


def _stream_error(path: str, message: str = ENGINE_GONE, tgi_type: str = "generation") -> str:
    """The error event that ends a stream the server could not finish."""
    err = P.RequestError(f"generation failed: {message}", status=500, code="generation_error",
                         error_type="internal_server_error")
    body = error_body(path, err)
    if not _is_openai(path):
        body["error_type"] = tgi_type
    return sse(body)


# -- routes ------------------------------------------------------------------------------------------


def _add_routes(app: FastAPI) -> None:
    # The API modules import this one's request helpers, so they are imported here, not at the top.
    from fp8cache.server import openai_routes, tgi_routes, tokenizer_routes

    app.add_api_route("/health", health, methods=["GET", "HEAD"])
    app.add_api_route("/info", info, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/completions", openai_routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", openai_routes.chat_completions, methods=["POST"])
    app.add_api_route("/generate", tgi_routes.tgi_generate, methods=["POST"])
    app.add_api_route("/generate_stream", tgi_routes.tgi_generate_stream, methods=["POST"])
    app.add_api_route("/", tgi_routes.tgi_compat, methods=["POST"])
    app.add_api_route("/tokenize", tokenizer_routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokenizer_routes.detokenize, methods=["POST"])


def _state(request: Request) -> AppState:
    return request.app.state.fp8kv


async def health(request: Request) -> Response:
    state = _state(request)
    if not state.engine.alive:
        return JSONResponse({"status": "engine not running"}, status_code=503)
    stalled = state.engine.stalled_seconds()
    if stalled > state.settings.stall_timeout:
        return JSONResponse({"status": f"engine stalled: requests are waiting and no engine step has finished for "
                                       f"{stalled:.0f} s (fp8kv run --stall-timeout {state.settings.stall_timeout:g})"},
                            status_code=503)
    return JSONResponse({"status": "ok"})


def engine_snapshot(state: AppState) -> dict[str, Any]:
    stats = state.engine.stats()
    state.metrics.observe_engine(stats)
    return stats


async def info(request: Request) -> Response:
    state = _state(request)
    i, stats = state.info, engine_snapshot(state)
    from fp8cache import __version__

    return JSONResponse({
        "model_id": state.settings.served_model_name, "model_sha": None, "model_dtype": i.model_dtype,
        "model_device_type": i.device, "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": state.settings.max_concurrent_requests, "max_best_of": 1,
        "max_stop_sequences": P.MAX_STOP_SEQUENCES, "max_input_tokens": i.max_model_len - 1,
        "max_input_length": i.max_model_len - 1, "max_total_tokens": i.max_model_len,
        "validation_workers": 1, "max_client_batch_size": 1, "router": "fp8kv", "version": __version__,
        "sha": None, "docker_label": None,
        "kv_cache": {"dtype": i.kv_cache_dtype, "scales_source": i.scales_source, "block_size": i.block_size,
                     "num_blocks": i.num_blocks, "capacity_tokens": i.capacity_tokens,
                     "recent_window": i.kv_recent_window, "recent_window_dtype": i.window_dtype,
                     "blocks_used": stats.get("blocks_used"), "blocks_free": stats.get("blocks_free")},
        "engine": stats,
    })


async def metrics(request: Request) -> Response:
    state = _state(request)
    engine_snapshot(state)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def list_models(request: Request) -> Response:
    state = _state(request)
    card = P.ModelCard(id=state.settings.served_model_name, root=state.settings.model_path,
                       max_model_len=state.info.max_model_len)
    return JSONResponse(P.ModelList(data=[card]).model_dump())
