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

The server's modules import from the module that defines a name. The names below are re-exported because
code outside fp8cache/server (tests, scripts) reads them as `protocol.X`, from when this was one module.
"""

from fp8cache.server.protocol import request_error
from fp8cache.server.protocol.base import (
    INT64_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP_LENGTH,
    MAX_STOP_SEQUENCES,
    Strict,
)
from fp8cache.server.protocol.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatMessageOut,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaToolCall,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    TextPart,
    Tool,
    ToolCall,
)
from fp8cache.server.protocol.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from fp8cache.server.protocol.model_list import ModelCard, ModelList
from fp8cache.server.protocol.outputs import PromptLogprob, PromptLogprobs, UsageInfo
from fp8cache.server.protocol.request_error import RequestError, validation_error
from fp8cache.server.protocol.sampling import JsonSchemaFormat, ResponseFormat, SamplingFields, StreamOptions
from fp8cache.server.protocol.tgi import (
    GenerateParameters,
    GenerateRequest,
    TGIDetails,
    TGIGenerateResponse,
    TGIGrammar,
    TGIPrefillToken,
    TGIStreamDetails,
    TGIStreamResponse,
    TGIToken,
)
from fp8cache.server.protocol.tokenize import DetokenizeRequest, TGITokenizeRequest, TokenizeRequest

__all__ = [
    "INT64_MAX", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_MESSAGES", "MAX_N", "MAX_PROMPTS", "MAX_STOP_LENGTH",
    "MAX_STOP_SEQUENCES", "ChatChoice", "ChatChunkChoice", "ChatCompletionChunk", "ChatCompletionRequest",
    "ChatCompletionResponse", "ChatDelta", "ChatLogprobs", "ChatMessage", "ChatMessageOut",
    "ChatTokenLogprob", "ChatTopLogprob", "CompletionChoice", "CompletionLogprobs", "CompletionRequest",
    "CompletionResponse", "DeltaToolCall", "DetokenizeRequest", "FunctionCall", "FunctionDefinition",
    "GenerateParameters", "GenerateRequest", "JsonSchemaFormat", "ModelCard", "ModelList", "NamedFunction",
    "NamedToolChoice", "PromptLogprob", "PromptLogprobs", "RequestError", "ResponseFormat", "SamplingFields",
    "StreamOptions", "Strict", "TGIDetails", "TGIGenerateResponse", "TGIGrammar", "TGIPrefillToken",
    "TGIStreamDetails", "TGIStreamResponse", "TGIToken", "TGITokenizeRequest", "TextPart", "TokenizeRequest",
    "Tool", "ToolCall", "UsageInfo", "validation_error",
]


def _model_names() -> set[str]:
    import importlib
    import pkgutil

    from pydantic import BaseModel

    names = set()
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        names |= {name for name, v in vars(module).items() if isinstance(v, type) and issubclass(v, BaseModel)}
    return names


request_error.MODEL_NAMES.update(_model_names())
