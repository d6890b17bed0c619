"""Tool calls on /v1/chat/completions, the way vLLM does them without a model-specific parser: a named
tool_choice constrains the output to that function's parameters schema, "required" to a JSON array of
{"name", "parameters"} calls of the given tools; the structured output is then the tool calls."""

from __future__ import annotations

import json
import uuid
from typing import Any

from fp8cache.engine.structured_output import StructuredOutputsParams
from fp8cache.server.protocol.chat import FunctionCall, NamedToolChoice, Tool, ToolCall


def structured_outputs(
    tools: list[Tool], choice: Any, parallel: bool = True
) -> StructuredOutputsParams | None:
    """The constraint a tool_choice puts on the output; None for "none" (and no tools). parallel=False: one
    call at most (OpenAI's parallel_tool_calls)."""
    if not tools or choice in (None, "none"):
        return None
    if isinstance(choice, NamedToolChoice):
        return StructuredOutputsParams(json=_parameters(_named(tools, choice.function.name)))
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | (
        {} if parallel else {"maxItems": 1}
    )
    return StructuredOutputsParams(json=array)


def tool_calls(tools: list[Tool], choice: Any, text: str) -> list[ToolCall]:
    """The calls in a finished output (a named call's arguments are the whole text). Output cut short (by
    max_tokens) is not valid JSON: a 'required' call list then comes back empty."""
    if isinstance(choice, NamedToolChoice):
        return [_call(choice.function.name, text)]
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [_call(c["name"], json.dumps(c["parameters"])) for c in calls]


def _named(tools: list[Tool], name: str) -> Tool:
    return next(t for t in tools if t.function.name == name)  # the request's validator checked the name


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(
        id=f"chatcmpl-tool-{uuid.uuid4().hex}", function=FunctionCall(name=name, arguments=arguments)
    )
