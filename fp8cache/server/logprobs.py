"""The engine's per-token Logprob dicts in each API's shape: OpenAI completions (parallel lists), OpenAI chat
(one object per token with its top alternatives) and TGI (tokens with a logprob, top_tokens)."""

from __future__ import annotations

from fp8cache.engine.outputs import Logprob
from fp8cache.server.protocol.chat import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob
from fp8cache.server.protocol.completions import CompletionLogprobs
from fp8cache.server.protocol.outputs import PromptLogprob, PromptLogprobs
from fp8cache.server.protocol.tgi import TGIToken

# JSON has no -inf: a token the model rules out entirely is reported as this (as vLLM does).
LOWEST_LOGPROB = -9999.0


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, LOWEST_LOGPROB)


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of one step (the sampled token's entry counts only if it is among them)."""
    return sorted((item for item in entry.items() if item[1].rank <= k), key=lambda item: item[1].rank)[:k]


def completion_logprobs(
    entries: list[dict[int, Logprob] | None], tokens: list[int], k: int, offset: int = 0, first_text: str = ""
) -> CompletionLogprobs:
    """offset: where the first token's text starts (token texts laid end to end, as vLLM counts). An entry
    of None (an echoed prompt's first token, whose text is first_text) has no logprobs."""
    out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    for entry, token in zip(entries, tokens):
        chosen = entry[token] if entry is not None else None
        text = chosen.decoded_token if chosen is not None else first_text
        out.text_offset.append(offset)
        out.tokens.append(text)
        out.token_logprobs.append(_value(chosen) if chosen is not None else None)
        # vLLM's shape: the top k and the chosen token
        out.top_logprobs.append(
            {lp.decoded_token: _value(lp) for _, lp in _top(entry, k) + [(token, chosen)]}
            if chosen is not None
            else None
        )
        offset += len(text)
    return out


def end_offset(logprobs: CompletionLogprobs | None, offset: int = 0) -> int:
    """Where text after these tokens starts."""
    if logprobs is None or not logprobs.tokens:
        return offset
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])


def join(
    first: CompletionLogprobs | None, second: CompletionLogprobs | None
) -> CompletionLogprobs | None:
    if first is None or second is None:
        return first or second
    return CompletionLogprobs(
        **{name: getattr(first, name) + getattr(second, name) for name in CompletionLogprobs.model_fields}
    )


def _chat_token(logprob: Logprob) -> dict:
    text = logprob.decoded_token
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[dict[int, Logprob]], tokens: list[int], k: int) -> ChatLogprobs:
    content = [
        ChatTokenLogprob(
            **_chat_token(entry[token]),
            top_logprobs=[ChatTopLogprob(**_chat_token(lp)) for _, lp in _top(entry, k)],
        )
        for entry, token in zip(entries, tokens)
    ]
    return ChatLogprobs(content=content)


def prompt_logprobs(entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs field: each prompt token's dict (the token and its top k), ids as keys."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token): PromptLogprob(logprob=_value(lp), rank=lp.rank, decoded_token=lp.decoded_token)
            for token, lp in entry.items()
        }
        for entry in entries
    ]


def token_logprob(entry: dict[int, Logprob], token_id: int) -> float:
    return _value(entry[token_id])


def tgi_top_tokens(entry: dict[int, Logprob], k: int, special: set[int]) -> list[TGIToken]:
    return [
        TGIToken(id=token_id, text=lp.decoded_token, logprob=_value(lp), special=token_id in special)
        for token_id, lp in _top(entry, k)
    ]
