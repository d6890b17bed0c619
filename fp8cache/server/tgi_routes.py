"""Hugging Face TGI routes: /generate, /generate_stream and the compatibility route POST /."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fp8cache.server import logprobs as LP
from fp8cache.server import protocol as P
from fp8cache.server.app import (
    SHUTTING_DOWN,
    AppState,
    Prepared,
    SSEResponse,
    TextDelta,
    _check_lengths,
    _compile_structure,
    _merge,
    _sampling_params,
    _state,
    _stream_error,
    _submit_all,
    _tokenize,
    collect_finals,
    parse,
    sse,
)
from fp8cache.server.async_engine import EngineDeadError, RequestAborted, RequestStream


def _tgi_finish_reason(completion: Any) -> str:
    if completion.finish_reason == "length":
        return "length"
    stop_reason = getattr(completion, "stop_reason", None)
    if isinstance(stop_reason, str):
        return "stop_sequence"
    return "eos_token"


async def _tgi_prepare(request: Request, body: P.GenerateRequest, stream: bool) -> tuple[Prepared, list[int]]:
    state = _state(request)
    p = body.parameters
    tok = state.info.tokenizer
    prompt = await _tokenize(state, lambda: tok.encode(body.inputs), size=len(body.inputs))
    if p.truncate is not None:
        prompt = prompt[-p.truncate:]
    if not prompt:
        raise P.RequestError("inputs: encodes to zero tokens", param="inputs", code="invalid_value")
    max_tokens = _check_lengths(state, [prompt], p.max_new_tokens, "inputs", "parameters.max_new_tokens")
    kwargs = p.sampling_kwargs() | {"max_tokens": max_tokens}
    if stream or p.details:  # TGI's tokens carry their logprob
        kwargs["logprobs"] = p.top_n_tokens or 0
    if p.details and p.decoder_input_details and not stream:
        kwargs["prompt_logprobs"] = 0
    params = _sampling_params(state, kwargs)
    await _compile_structure(request, state, params, "parameters.grammar")
    return Prepared([prompt], [body.inputs], max_tokens, params), prompt


async def tgi_compat(request: Request) -> Response:
    """POST / : TGI's compatibility route; `stream` in the body picks /generate or /generate_stream."""
    state = _state(request)
    body: P.GenerateRequest = await parse(request, P.GenerateRequest)
    return await (_tgi_stream if body.stream else _tgi_generate)(request, state, body)


async def tgi_generate(request: Request) -> Response:
    body: P.GenerateRequest = await parse(request, P.GenerateRequest)
    return await _tgi_generate(request, _state(request), body)


async def tgi_generate_stream(request: Request) -> Response:
    body: P.GenerateRequest = await parse(request, P.GenerateRequest)
    return await _tgi_stream(request, _state(request), body)


async def _tgi_generate(request: Request, state: AppState, body: P.GenerateRequest) -> Response:
    prepared, prompt = await _tgi_prepare(request, body, stream=False)
    streams = _submit_all(state, f"tgi-{uuid.uuid4().hex}", prepared)
    finals = await collect_finals(request, streams)
    if isinstance(finals, Response):
        return finals
    c = finals[0].outputs[0]
    p = body.parameters
    text = (body.inputs if p.return_full_text else "") + c.text
    details = None
    if p.details:
        tok, special = state.info.tokenizer, state.info.special_ids
        tokens = [P.TGIToken(id=t, text=tok.decode([t]), logprob=LP.token_logprob(entry, t), special=t in special)
                  for t, entry in zip(c.token_ids, c.logprobs)]
        prefill = [P.TGIPrefillToken(id=t, text=tok.decode([t]), logprob=LP.token_logprob(entry, t) if entry else None)
                   for t, entry in zip(prompt, finals[0].prompt_logprobs)] if p.decoder_input_details else []
        top = [LP.tgi_top_tokens(entry, p.top_n_tokens, special) for entry in c.logprobs] if p.top_n_tokens else None
        details = P.TGIDetails(finish_reason=_tgi_finish_reason(c), generated_tokens=len(c.token_ids),
                               seed=p.seed, prefill=prefill, tokens=tokens, top_tokens=top)
    return JSONResponse(P.TGIGenerateResponse(generated_text=text, details=details).model_dump())


async def _tgi_stream(request: Request, state: AppState, body: P.GenerateRequest) -> Response:
    prepared, prompt = await _tgi_prepare(request, body, stream=True)
    streams = _submit_all(state, f"tgi-{uuid.uuid4().hex}", prepared)
    return SSEResponse(_tgi_events(state, body, prompt, streams), streams)


async def _tgi_events(state: AppState, body: P.GenerateRequest, prompt: list[int],
                      streams: list[RequestStream]) -> AsyncIterator[str]:
    special = state.info.special_ids
    delta = TextDelta()
    p = body.parameters
    try:
        async for _, out in _merge(streams):
            c = out.outputs[0]
            text, new_tokens, entries = delta.update(c)
            for k, (token_id, entry) in enumerate(zip(new_tokens, entries)):
                last = k == len(new_tokens) - 1
                token = P.TGIToken(id=token_id, text=text if last else "", special=token_id in special,
                                   logprob=LP.token_logprob(entry, token_id))
                event = P.TGIStreamResponse(index=delta.num_tokens - len(new_tokens) + k + 1, token=token)
                if p.top_n_tokens:
                    event.top_tokens = LP.tgi_top_tokens(entry, p.top_n_tokens, special)
                if last and c.finish_reason is not None:
                    event.generated_text = (body.inputs if p.return_full_text else "") + c.text
                    event.details = P.TGIStreamDetails(
                        finish_reason=_tgi_finish_reason(c), generated_tokens=len(c.token_ids),
                        seed=p.seed, input_length=len(prompt))
                yield sse(event)
    except EngineDeadError:
        yield _stream_error("/generate_stream")
    except RequestAborted:
        # TGI's client raises IncompleteGenerationError for this type: the text so far is all there is.
        yield _stream_error("/generate_stream", SHUTTING_DOWN, tgi_type="incomplete_generation")
