"""POST /tokenize (vLLM's and TGI's bodies), POST /detokenize and GET /tokenizer_info (vLLM's)."""

from __future__ import annotations

import math
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fp8cache.server.chat_template import render_chat
from fp8cache.server.parsing import parse, read_json, validated
from fp8cache.server.protocol.request_error import RequestError
from fp8cache.server.protocol.tokenize import DetokenizeRequest, TGITokenizeRequest, TokenizeRequest
from fp8cache.server.state import app_state, run_tokenizer
from fp8cache.server.validation import check_model


async def tokenize(request: Request) -> Response:
    """POST /tokenize: TGI's ({"inputs": ...}: tokens with their character spans) or vLLM's ({"prompt": ...}
    or {"messages": ...}: ids, count, max_model_len); the body tells which."""
    state = app_state(request)
    body = await read_json(request, state.settings.max_request_bytes)
    tok = state.info.tokenizer
    if "inputs" in body:
        text = validated(TGITokenizeRequest, body).inputs
        spans = await run_tokenizer(state, lambda: _token_spans(tok, text), size=len(text))
        return JSONResponse([{"id": t, "text": piece, "start": start, "stop": stop} for t, piece, start, stop in spans])
    req: TokenizeRequest = validated(TokenizeRequest, body)
    check_model(state, req.model)
    if req.messages is not None:
        ids = await render_chat(state, req.messages, req.add_generation_prompt, bool(req.add_special_tokens))
    else:
        special = req.add_special_tokens is not False
        ids = await run_tokenizer(state, lambda: tok.encode(req.prompt, add_special_tokens=special), size=len(req.prompt))
    return JSONResponse({"count": len(ids), "max_model_len": state.info.max_model_len, "tokens": ids,
                         "token_strs": None})


def _token_spans(tok: Any, text: str) -> list[tuple[int, str, int, int]]:
    """(id, piece of text, start, stop) per token of text as the generate routes encode it; tokens that add
    no text (BOS) have an empty span."""
    ids = tok.encode(text)
    if getattr(tok, "is_fast", False):
        offsets = tok(text, return_offsets_mapping=True)["offset_mapping"]
        if len(offsets) == len(ids):
            return [(t, text[a:b], a, b) for t, (a, b) in zip(ids, offsets)]
    spans, pos = [], 0  # a slow tokenizer: lay the decoded pieces end to end
    for t in ids:
        piece = tok.decode([t])
        spans.append((t, piece, pos, pos + len(piece)))
        pos += len(piece)
    return spans


async def detokenize(request: Request) -> Response:
    state = app_state(request)
    req: DetokenizeRequest = await parse(request, DetokenizeRequest)
    check_model(state, req.model)
    bad = [t for t in req.tokens if t >= state.info.vocab_size]
    if bad:
        raise RequestError(f"tokens: token id {bad[0]} is outside the vocabulary (0..{state.info.vocab_size - 1})",
                           param="tokens", code="invalid_value")
    text = await run_tokenizer(state, lambda: state.info.tokenizer.decode(req.tokens), size=len(req.tokens))
    return JSONResponse({"prompt": text})


async def tokenizer_info(request: Request) -> Response:
    """GET /tokenizer_info, as vLLM answers it: the tokenizer's settings as its tokenizer_config.json holds them
    (special tokens as text, the chat template), its class name in tokenizer_class; no file paths. Eval harnesses
    (lm-evaluation-harness' remote tokenizer) read the special tokens and the chat template here."""
    tok = app_state(request).info.tokenizer
    config = {k: _json_value(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items()
              if k not in ("vocab_file", "merges_file")}
    config["tokenizer_class"] = type(tok).__name__
    if getattr(tok, "chat_template", None):
        config["chat_template"] = tok.chat_template
    return JSONResponse(config)


def _json_value(value: Any) -> Any:
    """A tokenizer setting as JSON: an AddedToken is its text, anything else without a JSON form its str()."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    return str(value)
