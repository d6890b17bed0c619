"""Chat messages (and the tools offered) rendered to prompt token ids by the tokenizer's chat template, for
/v1/chat/completions and for /tokenize with messages."""

from __future__ import annotations

import logging

from jinja2 import TemplateError

from fp8cache.server.protocol.chat import ChatMessage
from fp8cache.server.protocol.request_error import RequestError
from fp8cache.server.state import AppState, run_tokenizer

logger = logging.getLogger("fp8kv.server")


async def render_chat(state: AppState, messages: list[ChatMessage], add_generation_prompt: bool,
                      add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
    """Token ids of messages (and the tools offered) through the tokenizer's chat template."""
    tok = state.info.tokenizer
    if not getattr(tok, "chat_template", None):
        raise RequestError("messages: this model's tokenizer has no chat template; use /v1/completions",
                           param="messages", code="no_chat_template")
    plain = [{"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
             | {k: v for k, v in (("name", m.name), ("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id))
                if v}
             for m in messages]

    def render() -> list[int]:
        text = tok.apply_chat_template(plain, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)
        return tok.encode(text, add_special_tokens=add_special_tokens)

    try:
        return await run_tokenizer(state, render, size=sum(len(m["content"]) for m in plain))
    except TemplateError as exc:  # the template's own complaint (raise_exception) is the useful message
        raise RequestError(f"messages: the chat template refused them: {exc}", param="messages",
                           code="invalid_value") from None
    except Exception as exc:  # noqa: BLE001 - what broke inside the template is no message for a client
        logger.info("the chat template failed on a request's messages: %r", exc)
        raise RequestError("messages: the chat template cannot render these messages (see the server log); "
                           "check their roles and order", param="messages", code="invalid_value") from None
