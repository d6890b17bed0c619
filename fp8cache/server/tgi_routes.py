"""Hugging Face TGI routes: /generate, /generate_stream and the compatibility route POST /, answered as TGI's
router answers them (TGI's own clients and huggingface_hub's InferenceClient read these shapes)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fp8cache.server import logprobs as LP
from fp8cache.server.async_engine import EngineDeadError, RequestAborted, RequestStream
from fp8cache.server.errors import SHUTTING_DOWN
from fp8cache.server.generation import Prepared, collect_finals, merge_streams, submit_all
from fp8cache.server.parsing import parse
from fp8cache.server.protocol.request_error import RequestError
from fp8cache.server.protocol.tgi import (
    GenerateRequest,
    TGIDetails,
    TGIGenerateResponse,
    TGIPrefillToken,
    TGIStreamDetails,
    TGIStreamResponse,
    TGIToken,
)
from fp8cache.server.state import AppState, app_state, run_tokenizer
from fp8cache.server.streaming import SSEResponse, TextDelta, sse, stream_error
from fp8cache.server.validation import check_lengths, compile_structure, make_sampling_params


def _tgi_finish_reason(completion: Any) -> str:
    if completion.finish_reason == "length":
        return "length"
    stop_reason = getattr(completion, "stop_reason", None)
    if isinstance(stop_reason, str):
        return "stop_sequence"
    return "eos_token"


async def _tgi_prepare(request: Request, body: GenerateRequest, stream: bool) -> tuple[Prepared, list[int]]:
    state = app_state(request)
    p = body.parameters
    tok = state.info.tokenizer
    prompt = await run_tokenizer(state, lambda: tok.encode(body.inputs), size=len(body.inputs))
    if p.truncate is not None:
        prompt = prompt[-p.truncate:]
    if not prompt:
        raise RequestError("inputs: encodes to zero tokens", param="inputs", code="invalid_value")
    if stream and p.decoder_input_details:  # TGI's refusal, word for word
        raise RequestError("parameters.decoder_input_details: `decoder_input_details` == true is not supported "
                           "when streaming tokens", param="parameters.decoder_input_details", code="invalid_value")
    max_tokens = check_lengths(state, [prompt], p.max_new_tokens, "inputs", "parameters.max_new_tokens")
    kwargs = p.sampling_kwargs() | {"max_tokens": max_tokens}
    if stream or _details(body):  # TGI's tokens carry their logprob
        kwargs["logprobs"] = p.top_n_tokens or 0
    if p.decoder_input_details and not stream:
        kwargs["prompt_logprobs"] = 0
    params = make_sampling_params(state, kwargs)
    await compile_structure(request, state, params, "parameters.grammar")
    return Prepared([prompt], [body.inputs], max_tokens, params), prompt


def _details(body: GenerateRequest) -> bool:
    # TGI: decoder_input_details asks for the details too (their prefill is where those go)
    return body.parameters.details or body.parameters.decoder_input_details


async def tgi_compat(request: Request) -> Response:
    """POST / : TGI's compatibility route; `stream` in the body picks /generate or /generate_stream. Not streamed,
    the answer is a list of the one response (TGI's, for the Inference API's clients: text-generation's
    Client.generate reads payload[0])."""
    state = app_state(request)
    body: GenerateRequest = await parse(request, GenerateRequest)
    if body.stream:
        return await _tgi_stream(request, state, body)
    response = await _tgi_generate(request, state, body)
    return JSONResponse([response.model_dump()]) if isinstance(response, TGIGenerateResponse) else response


async def tgi_generate(request: Request) -> Response:
    body: GenerateRequest = await parse(request, GenerateRequest)
    response = await _tgi_generate(request, app_state(request), body)
    return JSONResponse(response.model_dump()) if isinstance(response, TGIGenerateResponse) else response


async def tgi_generate_stream(request: Request) -> Response:
    body: GenerateRequest = await parse(request, GenerateRequest)
    return await _tgi_stream(request, app_state(request), body)


async def _tgi_generate(request: Request, state: AppState, body: GenerateRequest) -> TGIGenerateResponse | Response:
    """The response, or the answer to send instead if the client went away."""
    prepared, prompt = await _tgi_prepare(request, body, stream=False)
    streams = submit_all(state, f"tgi-{uuid.uuid4().hex}", prepared)
    finals = await collect_finals(request, streams)
    if isinstance(finals, Response):
        return finals
    c = finals[0].outputs[0]
    p = body.parameters
    text = (body.inputs if p.return_full_text else "") + c.text
    details = None
    if _details(body):
        tok, special = state.info.tokenizer, state.info.special_ids
        tokens = [TGIToken(id=t, text=tok.decode([t]), logprob=LP.token_logprob(entry, t), special=t in special)
                  for t, entry in zip(c.token_ids, c.logprobs)]
        prefill = [TGIPrefillToken(id=t, text=tok.decode([t]), logprob=LP.token_logprob(entry, t) if entry else None)
                   for t, entry in zip(prompt, finals[0].prompt_logprobs)] if p.decoder_input_details else []
        top = [LP.tgi_top_tokens(entry, p.top_n_tokens, special) for entry in c.logprobs] if p.top_n_tokens else None
        details = TGIDetails(finish_reason=_tgi_finish_reason(c), generated_tokens=len(c.token_ids),
                             seed=p.seed, prefill=prefill, tokens=tokens, top_tokens=top)
    return TGIGenerateResponse(generated_text=text, details=details)


async def _tgi_stream(request: Request, state: AppState, body: GenerateRequest) -> Response:
    prepared, prompt = await _tgi_prepare(request, body, stream=True)
    streams = submit_all(state, f"tgi-{uuid.uuid4().hex}", prepared)
    return SSEResponse(_tgi_events(state, body, prompt, streams), streams)


async def _tgi_events(state: AppState, body: GenerateRequest, prompt: list[int],
                      streams: list[RequestStream]) -> AsyncIterator[str]:
    special = state.info.special_ids
    delta = TextDelta()
    p = body.parameters
    try:
        async for _, out in merge_streams(streams):
            c = out.outputs[0]
            text, new_tokens, entries = delta.update(c)
            for k, (token_id, entry) in enumerate(zip(new_tokens, entries)):
                last = k == len(new_tokens) - 1
                token = TGIToken(id=token_id, text=text if last else "", special=token_id in special,
                                 logprob=LP.token_logprob(entry, token_id))
                event = TGIStreamResponse(index=delta.num_tokens - len(new_tokens) + k + 1, token=token)
                if p.top_n_tokens:
                    event.top_tokens = LP.tgi_top_tokens(entry, p.top_n_tokens, special)
                if last and c.finish_reason is not None:
                    event.generated_text = (body.inputs if p.return_full_text else "") + c.text
                    if p.details:
                        event.details = TGIStreamDetails(
                            finish_reason=_tgi_finish_reason(c), generated_tokens=len(c.token_ids),
                            seed=p.seed, input_length=len(prompt))
                yield sse(event)
    except EngineDeadError:
        yield stream_error("/generate_stream")
    except RequestAborted:
        # TGI's client raises IncompleteGenerationError for this type: the text so far is all there is.
        yield stream_error("/generate_stream", SHUTTING_DOWN, tgi_type="incomplete_generation")
