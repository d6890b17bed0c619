"""The checks of a parsed request that need the model or the server: the model name, prompt lengths against
max-model-len and the cache, token ids against the vocabulary, the sampling parameters, and the structured
output grammar (compiled here, so a bad one is refused before the request reaches the engine)."""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from fp8cache.engine.generation_defaults import default_max_tokens
from fp8cache.server import grammar as G
from fp8cache.server.generation import until_disconnect
from fp8cache.server.protocol.request_error import RequestError
from fp8cache.server.state import AppState

# TGI serves one model and ignores the name (its docs send "tgi"; huggingface_hub's InferenceClient with a
# base_url sends "dummy"). Other names still get vLLM's 404, which tells an OpenAI client it is misconfigured.
TGI_MODEL_NAMES = frozenset({"tgi", "dummy"})


def check_model(state: AppState, name: str | None) -> None:
    allowed = {state.settings.served_model_name, state.settings.model_path, *TGI_MODEL_NAMES}
    if name is not None and name not in allowed:
        raise RequestError(f"model: the model `{name}` does not exist; this server serves "
                           f"`{state.settings.served_model_name}` (see /v1/models)", status=404,
                           param="model", code="model_not_found", error_type="not_found_error")


def check_lengths(state: AppState, prompts: list[list[int]], max_tokens: int | None, prompt_param: str,
                  tokens_param: str) -> int:
    """max_tokens to use: checked against max-model-len and the cache; if unset, the room left capped by
    --default-max-tokens and the generation config's max_new_tokens."""
    info = state.info
    longest = max(len(p) for p in prompts)
    limit = min(info.max_model_len, info.capacity_tokens)
    for p in prompts:
        bad = [t for t in p if t >= info.vocab_size]
        if bad:
            raise RequestError(f"{prompt_param}: token id {bad[0]} is outside the vocabulary "
                               f"(0..{info.vocab_size - 1})", param=prompt_param, code="invalid_value")
    if longest >= limit:
        raise RequestError(
            f"{prompt_param}: the prompt has {longest} tokens, but this server's limit is {limit} tokens for "
            f"prompt plus completion ({_limit_reason(state)}); shorten the prompt", param=prompt_param,
            code="context_length_exceeded")
    if max_tokens is None:
        return default_max_tokens(limit - longest, state.settings.default_max_tokens,
                                  state.settings.generation.max_new_tokens)
    if longest + max_tokens > limit:
        raise RequestError(
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


def make_sampling_params(state: AppState, kwargs: dict[str, Any]) -> Any:
    """SamplingParams for kwargs (a 400 naming the field if it refuses them)."""
    bad = [t for t in kwargs.get("logit_bias", {}) if t >= state.info.vocab_size]
    if bad:
        raise RequestError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                           f"(0..{state.info.vocab_size - 1})", param="logit_bias", code="invalid_value")
    try:
        return state.sampling_params(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        param = next((k for k in kwargs if re.search(rf"\b{re.escape(k)}\b", message)), None)
        raise RequestError(message, param=param, code="invalid_value") from None


async def compile_structure(request: Request, state: AppState, params: Any, param: str) -> None:
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
        busy = exc.status == 429  # the costly grammars' line is full: load, not this grammar
        raise RequestError(f"{param}: {exc}", status=exc.status, param=param,
                           code="grammar_queue_full" if busy else "invalid_value",
                           error_type="rate_limit_error" if busy else "invalid_request_error") from None
