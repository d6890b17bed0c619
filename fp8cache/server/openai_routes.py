"""OpenAI routes: /v1/models, /v1/completions and /v1/chat/completions (streamed or not), with logprobs,
structured outputs and tool calls."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fp8cache.server import logprobs as LP
from fp8cache.server import tools as TOOLS
from fp8cache.server.async_engine import EngineDeadError, RequestAborted, RequestStream
from fp8cache.server.chat_template import render_chat
from fp8cache.server.generation import Prepared, collect_finals, merge_streams, submit_all, usage_info
from fp8cache.server.parsing import parse
from fp8cache.server.protocol.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    DeltaToolCall,
)
from fp8cache.server.protocol.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from fp8cache.server.protocol.model_list import ModelCard, ModelList
from fp8cache.server.protocol.outputs import PromptLogprobs, UsageInfo
from fp8cache.server.protocol.request_error import RequestError
from fp8cache.server.protocol.sampling import SamplingFields
from fp8cache.server.state import AppState, app_state, run_tokenizer
from fp8cache.server.streaming import SSEResponse, TextDelta, sse, stream_error
from fp8cache.server.validation import check_lengths, check_model, compile_structure, make_sampling_params

logger = logging.getLogger("fp8kv.server")


async def list_models(request: Request) -> Response:
    state = app_state(request)
    card = ModelCard(id=state.settings.served_model_name, root=state.settings.model_path,
                     max_model_len=state.info.max_model_len)
    return JSONResponse(ModelList(data=[card]).model_dump())


def _sampling_kwargs(state: AppState, body: SamplingFields) -> dict[str, Any]:
    """The request's sampling fields over the model's generation config (vLLM's --generation-config)."""
    return state.settings.generation.sampling | body.sampling_kwargs()


def _usage_options(body: SamplingFields) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage with running totals on every chunk: vLLM's continuous_usage_stats)."""
    options = body.stream_options
    return (options is not None and options.include_usage,
            options is not None and options.continuous_usage_stats)


async def completions(request: Request) -> Response:
    state = app_state(request)
    body: CompletionRequest = await parse(request, CompletionRequest)
    check_model(state, body.model)
    tok = state.info.tokenizer
    prompts = await run_tokenizer(state, lambda: [p if isinstance(p, list) else tok.encode(p) for p in body.prompt],
                                  size=sum(len(p) for p in body.prompt))
    if any(not p for p in prompts):
        raise RequestError("prompt: a prompt encodes to zero tokens", param="prompt", code="invalid_value")
    max_tokens = check_lengths(state, prompts, body.max_tokens if "max_tokens" in body.model_fields_set
                               else None, "prompt", "max_tokens")
    if "max_tokens" not in body.model_fields_set:
        max_tokens = min(max_tokens, 16)  # OpenAI's default for completions
    texts = [p if isinstance(p, str) else "" for p in body.prompt]
    if body.echo:
        texts = await run_tokenizer(state, lambda: [t or tok.decode(p) for t, p in zip(texts, prompts)],
                                    size=sum(len(p) for p in prompts))
    params = make_sampling_params(state, _sampling_kwargs(state, body) | {"max_tokens": max_tokens})
    await compile_structure(request, state, params, body.structure_field())
    prepared = Prepared(prompts, texts, max_tokens, params)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = submit_all(state, request_id, prepared)
    name = state.settings.served_model_name
    if body.stream:
        return SSEResponse(_completion_events(request_id, name, body, prepared, streams, tok), streams)
    finals = await collect_finals(request, streams)
    if isinstance(finals, Response):
        return finals
    choices = []
    for i, out in sorted(finals.items()):
        echoed = _echo_logprobs(body, tok, out, prompts[i])
        for c in out.outputs:
            generated = _completion_logprobs(body, c.logprobs, c.token_ids, LP.end_offset(echoed))
            choices.append(CompletionChoice(index=i * body.n + c.index,
                                            text=(texts[i] if body.echo else "") + c.text,
                                            logprobs=LP.join(echoed, generated), finish_reason=c.finish_reason,
                                            prompt_logprobs=_prompt_logprobs(body, out)))
    return JSONResponse(CompletionResponse(id=request_id, model=name, choices=choices,
                                           usage=usage_info(prompts, finals)).model_dump())


def _completion_logprobs(body: CompletionRequest, entries: list | None, tokens: list[int],
                         offset: int = 0) -> CompletionLogprobs | None:
    if body.logprobs is None or entries is None:
        return None
    return LP.completion_logprobs(entries, tokens, body.logprobs, offset)


def _prompt_logprobs(body: SamplingFields, out: Any) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs field, when the request set it."""
    return LP.prompt_logprobs(out.prompt_logprobs) if body.prompt_logprobs is not None else None


def _echo_logprobs(body: CompletionRequest, tok: Any, out: Any, prompt: list[int]) -> CompletionLogprobs | None:
    """The echoed prompt's tokens: logprobs for all but the first."""
    if body.logprobs is None or not body.echo or out.prompt_logprobs is None:
        return None
    return LP.completion_logprobs(out.prompt_logprobs, prompt, body.logprobs, first_text=tok.decode([prompt[0]]))


async def _completion_events(request_id: str, name: str, body: CompletionRequest, prepared: Prepared,
                             streams: list[RequestStream], tok: Any) -> AsyncIterator[str]:
    created = int(time.time())
    deltas: dict[tuple[int, int], TextDelta] = {}
    offsets: dict[tuple[int, int], int] = {}  # per choice: where the next token's text starts (logprobs)
    finals: dict[int, Any] = {}
    include_usage, continuous_usage = _usage_options(body)

    def event(index: int, text: str, finish_reason: str | None, logprobs: CompletionLogprobs | None = None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs.model_dump() if logprobs else None,
                  "finish_reason": finish_reason}
        usage = {"usage": usage_info(prepared.prompts, finals).model_dump()} if continuous_usage else {}
        return sse({"id": request_id, "object": "text_completion", "created": created, "model": name,
                    "choices": [choice]} | usage)

    # The echo goes first; with logprobs it waits for the prompt's logprobs, which come with the first output.
    echo_waits = body.echo and body.logprobs is not None
    if body.echo and not echo_waits:
        for i, text in enumerate(prepared.prompt_texts):
            for k in range(body.n):
                yield event(i * body.n + k, text, None)
    try:
        async for i, out in merge_streams(streams):
            if echo_waits and i not in finals:
                echoed = _echo_logprobs(body, tok, out, prepared.prompts[i])
                for k in range(body.n):
                    offsets[(i, k)] = LP.end_offset(echoed)
                    yield event(i * body.n + k, prepared.prompt_texts[i], None, echoed)
            finals[i] = out
            for c in out.outputs:
                delta = deltas.setdefault((i, c.index), TextDelta())
                text, tokens, entries = delta.update(c, hold_empty=c.finish_reason is None)
                if not text and (c.finish_reason is None or delta.finish_reason is not None):
                    continue
                delta.finish_reason = c.finish_reason
                logprobs = _completion_logprobs(body, entries, tokens, offsets.get((i, c.index), 0))
                offsets[(i, c.index)] = LP.end_offset(logprobs, offsets.get((i, c.index), 0))
                yield event(i * body.n + c.index, text, c.finish_reason, logprobs)
    except EngineDeadError:
        yield stream_error("/v1/completions")
        return
    except RequestAborted:
        # Cut at the graceful shutdown timeout: every unfinished choice ends with finish_reason "abort" (vLLM's
        # reason for a request stopped from outside), so clients see a complete stream.
        for i in range(len(prepared.prompts)):
            for k in range(body.n):
                delta = deltas.get((i, k))
                if delta is None or delta.finish_reason is None:
                    yield event(i * body.n + k, "", "abort")
    if include_usage:
        usage = usage_info(prepared.prompts, finals).model_dump()
        yield sse({"id": request_id, "object": "text_completion", "created": created, "model": name,
                   "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


async def chat_completions(request: Request) -> Response:
    state = app_state(request)
    body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
    check_model(state, body.model)
    offered = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools and body.tool_choice != "none" \
        else None
    prompt = await render_chat(state, body.messages, body.add_generation_prompt, tools=offered)
    tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = check_lengths(state, [prompt], body.requested_max_tokens, "messages", tokens_param)
    kwargs = _sampling_kwargs(state, body) | {"max_tokens": max_tokens}
    if body.calls_tools:
        kwargs["structured_outputs"] = TOOLS.structured_outputs(body.tools, body.tool_choice,
                                                                parallel=body.parallel_tool_calls is not False)
    params = make_sampling_params(state, kwargs)
    await compile_structure(request, state, params, "tool_choice" if body.calls_tools else body.structure_field())
    prepared = Prepared([prompt], [""], max_tokens, params)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = submit_all(state, request_id, prepared)
    name = state.settings.served_model_name
    if body.stream:
        return SSEResponse(_chat_events(request_id, name, body, prepared, streams), streams)
    finals = await collect_finals(request, streams)
    if isinstance(finals, Response):
        return finals
    choices = [ChatChoice(index=c.index, message=_chat_message(body, c),
                          logprobs=_chat_logprobs(body, c.logprobs, c.token_ids),
                          finish_reason=_chat_finish_reason(body, c)) for c in finals[0].outputs]
    return JSONResponse(ChatCompletionResponse(id=request_id, model=name, choices=choices,
                                               usage=usage_info([prompt], finals),
                                               prompt_logprobs=_prompt_logprobs(body, finals[0])).model_dump())


def _chat_message(body: ChatCompletionRequest, completion: Any) -> ChatMessageOut:
    if body.calls_tools:
        calls = TOOLS.tool_calls(body.tools, body.tool_choice, completion.text)
        return ChatMessageOut(content=None, tool_calls=calls)
    return ChatMessageOut(content=completion.text)


def _chat_finish_reason(body: ChatCompletionRequest, completion: Any) -> str | None:
    # OpenAI: "tool_calls" when the model chose to call; a named (forced) call ends with "stop"
    if body.tool_choice == "required" and completion.finish_reason == "stop":
        return "tool_calls"
    return completion.finish_reason


def _chat_logprobs(body: ChatCompletionRequest, entries: list | None, tokens: list[int]) -> ChatLogprobs | None:
    if not body.logprobs or entries is None:
        return None
    return LP.chat_logprobs(entries, tokens, body.top_logprobs or 0)


async def _chat_events(request_id: str, name: str, body: ChatCompletionRequest, prepared: Prepared,
                       streams: list[RequestStream]) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage, continuous_usage = _usage_options(body)
    finals: dict[int, Any] = {}

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        if usage is None and continuous_usage:
            usage = usage_info(prepared.prompts, finals)
        body = ChatCompletionChunk(id=request_id, created=created, model=name, choices=choices,
                                   usage=usage).model_dump()
        for choice in body["choices"]:  # OpenAI leaves unset delta fields out rather than null
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        if usage is None:
            del body["usage"]
        return sse(body)

    for i in range(body.n):
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
    deltas = [TextDelta() for _ in range(body.n)]
    try:
        async for _, out in merge_streams(streams):
            finals[0] = out
            for c in out.outputs:
                delta = deltas[c.index]
                if body.calls_tools and c.finish_reason is None:
                    continue  # the calls are parsed from the whole output: they go out at its end
                text, tokens, entries = delta.update(c, hold_empty=c.finish_reason is None)
                logprobs = _chat_logprobs(body, entries, tokens) if tokens else None
                if body.calls_tools and delta.finish_reason is None:
                    calls = [DeltaToolCall(index=k, **call.model_dump())
                             for k, call in enumerate(_chat_message(body, c).tool_calls)]
                    yield chunk([ChatChunkChoice(index=c.index, delta=ChatDelta(tool_calls=calls),
                                                 logprobs=logprobs)])
                    text, logprobs = "", None
                if text:
                    yield chunk([ChatChunkChoice(index=c.index, delta=ChatDelta(content=text),
                                                 logprobs=logprobs)])
                    logprobs = None
                if c.finish_reason is not None and delta.finish_reason is None:
                    delta.finish_reason = c.finish_reason
                    yield chunk([ChatChunkChoice(index=c.index, delta=ChatDelta(), logprobs=logprobs,
                                                 finish_reason=_chat_finish_reason(body, c))])
    except EngineDeadError:
        yield stream_error("/v1/chat/completions")
        return
    except RequestAborted:  # cut at the graceful shutdown timeout (see _completion_events)
        for index, delta in enumerate(deltas):
            if delta.finish_reason is None:
                delta.finish_reason = "abort"
                yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason="abort")])
    if include_usage:
        yield chunk([], usage_info(prepared.prompts, finals))
    yield "data: [DONE]\n\n"
