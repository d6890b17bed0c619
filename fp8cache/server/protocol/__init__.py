"""Request and response bodies of the HTTP API, one API concept per module:

    base.py           the strict base model, size limits and field checks the bodies share
    request_error.py  RequestError (a refused request) and pydantic failures turned into one
    sampling.py       the sampling and structured output fields of both OpenAI requests
    outputs.py        usage and prompt_logprobs, shared by both OpenAI responses
    completions.py    POST /v1/completions
    chat.py           POST /v1/chat/completions, tools and tool calls included
    model_list.py     GET /v1/models
    tgi.py            Hugging Face TGI's /generate, /generate_stream and /
    tokenize.py       POST /tokenize and /detokenize

Requests are parsed strictly: JSON types must match (no "0.5" for a float), unknown fields are refused,
ranges are checked here, and fields fp8kv cannot honour (tool_choice "auto", LoRA adapters, ...) are
refused with a message instead of being silently ignored. Checks that need the model (prompt length against
max-model-len, token ids against the vocabulary, the model name) live in server/validation.py.

The server's modules import from the module that defines a name. Code outside fp8cache/server (tests, scripts)
may read any of them as `protocol.X`, from when this was one module: the package finds X in its modules.
"""

import importlib
import pkgutil

from pydantic import BaseModel

from fp8cache.server.protocol import request_error

_MODULES = tuple(importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__))


def __getattr__(name: str) -> object:
    """`protocol.X`: the public name X of the module that defines (or imports) it."""
    for module in _MODULES:
        if not name.startswith("_") and name in vars(module):
            return vars(module)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


request_error.MODEL_NAMES.update(name for module in _MODULES for name, v in vars(module).items()
                                 if isinstance(v, type) and issubclass(v, BaseModel))
