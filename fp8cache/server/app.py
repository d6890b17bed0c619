"""The HTTP app: the routes wired to their paths, the exception handlers that give every failure its API's
error shape, the middleware, and the engine's start and stop with the app's life.

Where the rest lives: openai_routes.py (/v1), tgi_routes.py (TGI's /generate, /generate_stream and /),
tokenizer_routes.py (/tokenize, /detokenize), status_routes.py (/health, /info, /metrics); what the routes
share: parsing.py (bodies), validation.py (checks that need the model), generation.py (submission to the
engine), streaming.py (server-sent events), errors.py (error shapes), state.py (AppState); the bodies
themselves are in protocol/.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from fp8cache.server import openai_routes, status_routes, tgi_routes, tokenizer_routes
from fp8cache.server.async_engine import EngineDeadError, RequestAborted
from fp8cache.server.errors import (
    aborted_handler,
    client_gone_handler,
    engine_dead_handler,
    http_error_handler,
    internal_error_handler,
    request_error_handler,
)
from fp8cache.server.middleware import GuardMiddleware, MetricsMiddleware
from fp8cache.server.protocol.request_error import RequestError
from fp8cache.server.state import AppState, ModelInfo

# ModelInfo too: tests/model/test_recent_window.py imports it from here, where it was defined.
__all__ = ["ModelInfo", "create_app"]


def create_app(state: AppState) -> FastAPI:
    app = FastAPI(title="fp8kv", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=_lifespan(state))
    app.state.fp8kv = state
    _add_routes(app)
    app.add_exception_handler(RequestError, request_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(EngineDeadError, engine_dead_handler)
    app.add_exception_handler(RequestAborted, aborted_handler)
    app.add_exception_handler(ClientDisconnect, client_gone_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    # The middleware added last runs first: metrics sees every request, the guard runs before any route.
    app.add_middleware(GuardMiddleware, settings=state.settings)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    return app


def _lifespan(state: AppState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not state.engine.alive and state.engine.error is None:
            state.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.engine.stop(stall_timeout=state.settings.stall_timeout)
            state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            state.large_tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            if state.grammar is not None:
                state.grammar.close()

    return lifespan


def _add_routes(app: FastAPI) -> None:
    app.add_api_route("/health", status_routes.health, methods=["GET", "HEAD"])
    app.add_api_route("/info", status_routes.info, methods=["GET"])
    app.add_api_route("/metrics", status_routes.metrics, methods=["GET"])
    app.add_api_route("/v1/models", openai_routes.list_models, methods=["GET"])
    app.add_api_route("/v1/completions", openai_routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", openai_routes.chat_completions, methods=["POST"])
    app.add_api_route("/generate", tgi_routes.tgi_generate, methods=["POST"])
    app.add_api_route("/generate_stream", tgi_routes.tgi_generate_stream, methods=["POST"])
    app.add_api_route("/", tgi_routes.tgi_compat, methods=["POST"])
    app.add_api_route("/tokenize", tokenizer_routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokenizer_routes.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", tokenizer_routes.tokenizer_info, methods=["GET"])
