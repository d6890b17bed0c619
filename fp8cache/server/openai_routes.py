"""OpenAI routes: /v1/completions and /v1/chat/completions (streamed or not), with logprobs, structured
outputs and tool calls."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError

from fp8cache.server import logprobs as LP
from fp8cache.server import protocol as P
from fp8cache.server import tools as TOOLS
from fp8cache.server.app import (
    AppState,
    Prepared,
    SSEResponse,
    TextDelta,
    _check_lengths,
    _check_model,
    _compile_structure,
    _merge,
    _sampling_params,
    _state,
    _stream_error,
    _submit_all,
    _tokenize,
    _usage,
    collect_finals,
    parse,
    sse,
)
from fp8cache.server.async_engine import EngineDeadError, RequestAborted, RequestStream

logger = logging.getLogger("fp8kv.server")


def _usage_options(body: P.SamplingFields) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage with running totals on every chunk: vLLM's continuous_usage_stats)."""
    options = body.stream_options
    return (options is not None and options.include_usage,
            options is not None and options.continuous_usage_stats)


async def completions(request: Request) -> Response:
    state = _state(request)
    body: P.CompletionRequest = await parse(request, P.CompletionRequest)
    _check_model(state, body.model)
    tok = state.info.tokenizer
    prompts = await _tokenize(state, lambda: [p if isinstance(p, list) else tok.encode(p) for p in body.prompt],
                              size=sum(len(p) for p in body.prompt))
    if any(not p for p in prompts):
        raise P.RequestError("prompt: a prompt encodes to zero tokens", param="prompt", code="invalid_value")
    max_tokens = _check_lengths(state, prompts, body.max_tokens if "max_tokens" in body.model_fields_set
                                else None, "prompt", "max_tokens")
    if "max_tokens" not in body.model_fields_set:
        max_tokens = min(max_tokens, 16)  # OpenAI's default for completions
    texts = [p if isinstance(p, str) else "" for p in body.prompt]
    if body.echo:
        texts = await _tokenize(state, lambda: [t or tok.decode(p) for t, p in zip(texts, prompts)],
                                size=sum(len(p) for p in prompts))
    params = _sampling_params(state, body.sampling_kwargs() | {"max_tokens": max_tokens})
    await _compile_structure(request, state, params, body.structure_field())
    prepared = Prepared(prompts, texts, max_tokens, params)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = _submit_all(state, request_id, prepared)
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
            choices.append(P.CompletionChoice(index=i * body.n + c.index,
                                              text=(texts[i] if body.echo else "") + c.text,
                                              logprobs=LP.join(echoed, generated), finish_reason=c.finish_reason,
                                              prompt_logprobs=_prompt_logprobs(body, out)))
    return JSONResponse(P.CompletionResponse(id=request_id, model=name, choices=choices,
                                             usage=_usage(prompts, finals)).model_dump())


def _completion_logprobs(body: P.CompletionRequest, entries: list | None, tokens: list[int],
                         offset: int = 0) -> P.CompletionLogprobs | None:
    if body.logprobs is None or entries is None:
        return None
    return LP.completion_logprobs(entries, tokens, body.logprobs, offset)


def _prompt_logprobs(body: P.SamplingFields, out: Any) -> P.PromptLogprobs | None:
    """vLLM's prompt_logprobs field, when the request set it."""
    return LP.prompt_logprobs(out.prompt_logprobs) if body.prompt_logprobs is not None else None


def _echo_logprobs(body: P.CompletionRequest, tok: Any, out: Any, prompt: list[int]) -> P.CompletionLogprobs | None:
    """The echoed prompt's tokens: logprobs for all but the first."""
    if body.logprobs is None or not body.echo or out.prompt_logprobs is None:
        return None
    return LP.completion_logprobs(out.prompt_logprobs, prompt, body.logprobs, first_text=tok.decode([prompt[0]]))


async def _completion_events(request_id: str, name: str, body: P.CompletionRequest, prepared: Prepared,
                             streams: list[RequestStream], tok: Any) -> AsyncIterator[str]:
    created = int(time.time())
    deltas: dict[tuple[int, int], TextDelta] = {}
    offsets: dict[tuple[int, int], int] = {}  # per choice: where the next token's text starts (logprobs)
    finals: dict[int, Any] = {}
    include_usage, continuous_usage = _usage_options(body)

    def event(index: int, text: str, finish_reason: str | None, logprobs: P.CompletionLogprobs | None = None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs.model_dump() if logprobs else None,
                  "finish_reason": finish_reason}
        usage = {"usage": _usage(prepared.prompts, finals).model_dump()} if continuous_usage else {}
        return sse({"id": request_id, "object": "text_completion", "created": created, "model": name,
                    "choices": [choice]} | usage)

    # The echo goes first; with logprobs it waits for the prompt's logprobs, which come with the first output.
    echo_waits = body.echo and body.logprobs is not None
    if body.echo and not echo_waits:
        for i, text in enumerate(prepared.prompt_texts):
            for k in range(body.n):
                yield event(i * body.n + k, text, None)
    try:
        async for i, out in _merge(streams):
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
        yield _stream_error("/v1/completions")
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
        usage = _usage(prepared.prompts, finals).model_dump()
        yield sse({"id": request_id, "object": "text_completion", "created": created, "model": name,
                   "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body: P.ChatCompletionRequest = await parse(request, P.ChatCompletionRequest)
    _check_model(state, body.model)
    offered = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools and body.tool_choice != "none" \
        else None
    prompt = await _render_chat(state, body.messages, body.add_generation_prompt, tools=offered)
    tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = _check_lengths(state, [prompt], body.requested_max_tokens, "messages", tokens_param)
    kwargs = body.sampling_kwargs() | {"max_tokens": max_tokens}
    if body.calls_tools:
        kwargs["structured_outputs"] = TOOLS.structured_outputs(body.tools, body.tool_choice,
                                                                parallel=body.parallel_tool_calls is not False)
    params = _sampling_params(state, kwargs)
    await _compile_structure(request, state, params, "tool_choice" if body.calls_tools else body.structure_field())
    prepared = Prepared([prompt], [""], max_tokens, params)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = _submit_all(state, request_id, prepared)
    name = state.settings.served_model_name
    if body.stream:
        return SSEResponse(_chat_events(request_id, name, body, prepared, streams), streams)
    finals = await collect_finals(request, streams)
    if isinstance(finals, Response):
        return finals
    choices = [P.ChatChoice(index=c.index, message=_chat_message(body, c),
                            logprobs=_chat_logprobs(body, c.logprobs, c.token_ids),
                            finish_reason=_chat_finish_reason(body, c)) for c in finals[0].outputs]
    return JSONResponse(P.ChatCompletionResponse(id=request_id, model=name, choices=choices,
                                                 usage=_usage([prompt], finals),
                                                 prompt_logprobs=_prompt_logprobs(body, finals[0])).model_dump())


def _chat_message(body: P.ChatCompletionRequest, completion: Any) -> P.ChatMessageOut:
    if body.calls_tools:
        calls = TOOLS.tool_calls(body.tools, body.tool_choice, completion.text)
        return P.ChatMessageOut(content=None, tool_calls=calls)
    return P.ChatMessageOut(content=completion.text)


def _chat_finish_reason(body: P.ChatCompletionRequest, completion: Any) -> str | None:
    # OpenAI: "tool_calls" when the model chose to call; a named (forced) call ends with "stop"
    if body.tool_choice == "required" and completion.finish_reason == "stop":
        return "tool_calls"
    return completion.finish_reason


def _chat_logprobs(body: P.ChatCompletionRequest, entries: list | None, tokens: list[int]) -> P.ChatLogprobs | None:
    if not body.logprobs or entries is None:
        return None
    return LP.chat_logprobs(entries, tokens, body.top_logprobs or 0)


async def _render_chat(state: AppState, messages: list[P.ChatMessage], add_generation_prompt: bool,
                       add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
    """Token ids of messages (and the tools offered) through the tokenizer's chat template."""
    tok = state.info.tokenizer
    if not getattr(tok, "chat_template", None):
        raise P.RequestError("messages: this model's tokenizer has no chat template; use /v1/completions",
                             param="messages", code="no_chat_template")
    plain = [{"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
             | {k: v for k, v in (("name", m.name), ("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id))
                if v}
             for m in messages]

    def render() -> list[int]:
        text = tok.apply_chat_template(plain, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)
        return tok.encode(text, add_special_tokens=add_special_tokens)

    try:
        return await _tokenize(state, render, size=sum(len(m["content"]) for m in plain))
    except TemplateError as exc:  # the template's own complaint (raise_exception) is the useful message
        raise P.RequestError(f"messages: the chat template refused them: {exc}", param="messages",
                             code="invalid_value") from None
    except Exception as exc:  # noqa: BLE001 - what broke inside the template is no message for a client
        logger.info("the chat template failed on a request's messages: %r", exc)
        raise P.RequestError("messages: the chat template cannot render these messages (see the server log); "
                             "check their roles and order", param="messages", code="invalid_value") from None


async def _chat_events(request_id: str, name: str, body: P.ChatCompletionRequest, prepared: Prepared,
                       streams: list[RequestStream]) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage, continuous_usage = _usage_options(body)
    finals: dict[int, Any] = {}

    def chunk(choices: list[P.ChatChunkChoice], usage: P.UsageInfo | None = None) -> str:
        if usage is None and continuous_usage:
            usage = _usage(prepared.prompts, finals)
        body = P.ChatCompletionChunk(id=request_id, created=created, model=name, choices=choices,
                                     usage=usage).model_dump()
        for choice in body["choices"]:  # OpenAI leaves unset delta fields out rather than null
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        if usage is None:
            del body["usage"]
        return sse(body)

    for i in range(body.n):
        yield chunk([P.ChatChunkChoice(index=i, delta=P.ChatDelta(role="assistant", content=""))])
    deltas = [TextDelta() for _ in range(body.n)]
    try:
        async for _, out in _merge(streams):
            finals[0] = out
            for c in out.outputs:
                delta = deltas[c.index]
                if body.calls_tools and c.finish_reason is None:
                    continue  # the calls are parsed from the whole output: they go out at its end
                text, tokens, entries = delta.update(c, hold_empty=c.finish_reason is None)
                logprobs = _chat_logprobs(body, entries, tokens) if tokens else None
                if body.calls_tools and delta.finish_reason is None:
                    calls = [P.DeltaToolCall(index=k, **call.model_dump())
                             for k, call in enumerate(_chat_message(body, c).tool_calls)]
                    yield chunk([P.ChatChunkChoice(index=c.index, delta=P.ChatDelta(tool_calls=calls),
                                                   logprobs=logprobs)])
                    text, logprobs = "", None
                if text:
                    yield chunk([P.ChatChunkChoice(index=c.index, delta=P.ChatDelta(content=text),
                                                   logprobs=logprobs)])
                    logprobs = None
                if c.finish_reason is not None and delta.finish_reason is None:
                    delta.finish_reason = c.finish_reason
                    yield chunk([P.ChatChunkChoice(index=c.index, delta=P.ChatDelta(), logprobs=logprobs,
                                                   finish_reason=_chat_finish_reason(body, c))])
    except EngineDeadError:
        yield _stream_error("/v1/chat/completions")
        return
    except RequestAborted:  # cut at the graceful shutdown timeout (see _completion_events)
        for index, delta in enumerate(deltas):
            if delta.finish_reason is None:
                delta.finish_reason = "abort"
                yield chunk([P.ChatChunkChoice(index=index, delta=P.ChatDelta(), finish_reason="abort")])
    if include_usage:
        yield chunk([], _usage(prepared.prompts, finals))
    yield "data: [DONE]\n\n"
