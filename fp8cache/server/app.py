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
import re
import time
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

from fp8cache.server import protocol as P
from fp8cache.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from fp8cache.server.metrics import CONTENT_TYPE, ServerMetrics

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
    max_concurrent_requests: int = 256


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
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="fp8kv-tokenizer"))


def create_app(state: AppState) -> FastAPI:
    app = FastAPI(title="fp8kv", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=_lifespan(state))
    app.state.fp8kv = state
    _add_routes(app)
    app.add_exception_handler(P.RequestError, _request_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(EngineDeadError, _engine_dead_handler)
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

    return lifespan


# -- errors ------------------------------------------------------------------------------------------


def _is_openai(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


_TGI_TYPES = {401: "authentication", 404: "not_found", 413: "validation", 429: "overloaded",
              503: "unavailable", 500: "generation"}
_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                 503: "service_unavailable", 500: "internal_server_error"}


def error_body(path: str, err: P.RequestError) -> dict:
    if _is_openai(path):
        kind = "invalid_request_error" if err.status in (400, 413, 422) else \
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


async def _engine_dead_handler(request: Request, exc: EngineDeadError) -> JSONResponse:
    err = P.RequestError(f"{exc}; the server is restarting, retry later", status=503, code="engine_unavailable",
                         error_type="service_unavailable")
    return error_response(request.url.path, err)


async def _internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    err = P.RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500, code="internal_error",
                         error_type="internal_server_error")
    return error_response(request.url.path, err)


# -- middleware --------------------------------------------------------------------------------------


class _MetricsMiddleware:
    """Counts every HTTP request by route and status and times it until its last byte."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), [499]  # 499: the client left before an answer started

        async def send_and_record(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        except BaseException:
            status[0] = 500 if status[0] == 499 else status[0]
            raise
        finally:
            route = scope["path"] if scope["path"] in _ROUTES else "other"
            self.metrics.observe_request(route, status[0], time.monotonic() - start)


class _GuardMiddleware:
    """API key and body size checks, done before any route reads the body."""

    def __init__(self, app, settings: ServerSettings) -> None:
        self.app, self.settings = app, settings
        self._key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope["headers"])
        if self._key is not None and path not in _PUBLIC_PATHS and not self._authorized(headers):
            await _drain(receive, _DRAIN_LIMIT)
            err = P.RequestError("missing or invalid API key; send the header 'Authorization: Bearer <key>'",
                                 status=401, code="invalid_api_key", error_type="authentication_error")
            return await error_response(path, err, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
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

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        value = headers.get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        # compare_digest keeps the comparison time independent of where the key first differs.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


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
    return body


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


def _check_model(state: AppState, name: str | None) -> None:
    allowed = {state.settings.served_model_name, state.settings.model_path}
    if name is not None and name not in allowed:
        raise P.RequestError(f"model: the model `{name}` does not exist; this server serves "
                             f"`{state.settings.served_model_name}` (see /v1/models)", status=404,
                             param="model", code="model_not_found", error_type="not_found_error")


async def _tokenize(state: AppState, fn: Callable[[], Any]) -> Any:
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, fn)


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


async def _compile_structure(state: AppState, params: Any, param: str) -> None:
    """Compile a structured output pattern on the tokenizer pool (a JSON object pattern takes seconds once,
    then it is cached), so the engine's own compile at submit is a cache hit; a bad one is this 400."""
    structure = getattr(params, "structured_outputs", None)
    factory = getattr(getattr(state.engine, "engine", None), "guide_factory", None)
    if structure is None or factory is None:
        return
    try:
        await _tokenize(state, lambda: factory().compile(structure.to_regex()))
    except ValueError as exc:
        raise P.RequestError(f"{param}: {exc}", param=param, code="invalid_value") from None


def _admit(state: AppState, count: int) -> None:
    if not state.engine.alive:
        raise P.RequestError("the engine is not running; the server is shutting down or restarting",
                             status=503, code="engine_unavailable", error_type="service_unavailable")
    if state.engine.num_active_requests + count > state.settings.max_concurrent_requests:
        raise P.RequestError(
            f"the server is at its limit of {state.settings.max_concurrent_requests} concurrent requests; "
            "retry later (fp8kv run --max-concurrent-requests)", status=429, code="overloaded",
            error_type="rate_limit_error")


def _submit_all(state: AppState, request_id: str, prepared: Prepared) -> list[RequestStream]:
    _admit(state, len(prepared.prompts))
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


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work` unless the client goes away first (then cancel it, which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
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


def _stream_error(path: str, exc: BaseException) -> str:
    err = P.RequestError(f"generation failed: {exc}", status=500, code="generation_error",
                         error_type="internal_server_error")
    body = error_body(path, err)
    if not _is_openai(path):
        body["error_type"] = "generation"
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
    if state.engine.alive:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "engine not running"}, status_code=503)


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
