"""A prepared request's prompts submitted to the engine (admission counts sequences), and its outputs
gathered: merged as they come, or collected whole unless the client goes away first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from fp8cache.server.async_engine import EngineDeadError, RequestStream
from fp8cache.server.protocol.outputs import UsageInfo
from fp8cache.server.protocol.request_error import RequestError
from fp8cache.server.state import AppState


@dataclass
class Prepared:
    prompts: list[list[int]]
    prompt_texts: list[str]
    max_tokens: int
    params: Any


def _admit(state: AppState, num_prompts: int, n: int) -> None:
    """Admission counts sequences (each prompt runs n of them), the unit of engine work and memory."""
    if not state.engine.alive:
        raise RequestError("the engine is not running; the server is shutting down or restarting",
                           status=503, code="engine_unavailable", error_type="service_unavailable")
    limit, wanted = state.settings.max_concurrent_requests, num_prompts * n
    if wanted > limit:
        raise RequestError(
            f"n: this request asks for {wanted} sequences ({num_prompts} prompts x n={n}), more than this server "
            f"runs at once ({limit}, fp8kv run --max-concurrent-requests); send fewer prompts or a smaller n",
            param="n", code="too_many_sequences")
    if state.engine.num_active_sequences + wanted > limit:
        raise RequestError(
            f"the server is at its limit of {limit} concurrent sequences (a request counts its prompts times "
            "n); retry later (fp8kv run --max-concurrent-requests)", status=429, code="overloaded",
            error_type="rate_limit_error")


def submit_all(state: AppState, request_id: str, prepared: Prepared) -> list[RequestStream]:
    _admit(state, len(prepared.prompts), getattr(prepared.params, "n", 1))
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prepared.prompts):
            streams.append(state.engine.submit(f"{request_id}-{i}", prompt, prepared.params))
            state.metrics.prompt_tokens.inc(len(prompt))
    except ValueError as exc:
        close_all(streams)
        raise RequestError(f"prompt: {exc}", param="prompt", code="invalid_value") from None
    except EngineDeadError as exc:
        close_all(streams)
        raise RequestError(str(exc), status=503, code="engine_unavailable") from None
    except BaseException:
        close_all(streams)
        raise
    return streams


def close_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.close()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
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
        close_all(streams)


async def _collect(streams: list[RequestStream]) -> dict[int, Any]:
    finals: dict[int, Any] = {}
    async for i, out in merge_streams(streams):
        finals[i] = out
    return finals


async def collect_finals(request: Request, streams: list[RequestStream]) -> dict[int, Any] | Response:
    """Every prompt's final output, or the response to send if the client went away first; the streams are
    closed either way."""
    try:
        return await until_disconnect(request, _collect(streams))
    finally:
        close_all(streams)


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


def usage_info(prompts: list[list[int]], finals: dict[int, Any]) -> UsageInfo:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)
