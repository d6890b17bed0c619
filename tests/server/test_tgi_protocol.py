"""The pieces behind the TGI clients' tests, on their own and fast: JSON null as "not set" in every request body,
the bodies TGI's own client builds, TGI's dialect of the chat chunks, and the error event that ends a stream
which fails once open."""

from __future__ import annotations

import json

import pydantic
import pytest
from fastapi import FastAPI, Request
from starlette.testclient import TestClient

from fp8cache.server.parsing import note_flags, validated
from fp8cache.server.protocol.chat import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
)
from fp8cache.server.protocol.completions import CompletionRequest
from fp8cache.server.protocol.request_error import RequestError
from fp8cache.server.protocol.tgi import GenerateRequest
from fp8cache.server.protocol.tokenize import DetokenizeRequest, TGITokenizeRequest, TokenizeRequest
from fp8cache.server.streaming import SSEResponse, tgi_chat_chunk

MESSAGES = [{"role": "user", "content": "hi"}]
# Each request body with only what it requires.
MINIMAL = {
    ChatCompletionRequest: {"messages": MESSAGES},
    CompletionRequest: {"prompt": "x"},
    GenerateRequest: {"inputs": "x"},
    TokenizeRequest: {"prompt": "x"},
    DetokenizeRequest: {"tokens": [1]},
    TGITokenizeRequest: {"inputs": "x"},
}


def _with_every_optional_null(model, body: dict) -> dict:
    return body | {field.alias or name: None for name, field in model.model_fields.items()
                   if not field.is_required() and name not in body}


@pytest.mark.parametrize("model", list(MINIMAL), ids=lambda m: m.__name__)
def test_null_is_the_same_as_absent_for_every_optional_field(model):
    body = MINIMAL[model]
    if model is TokenizeRequest:  # prompt and messages are each optional, but one is needed
        nulls = _with_every_optional_null(model, {}) | body
    else:
        nulls = _with_every_optional_null(model, body)
    assert len(nulls) > len(body)
    assert validated(model, nulls) == validated(model, body)


def test_null_in_nested_bodies_is_absent_too():
    chat = validated(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi", "name": None,
                                                           "tool_calls": None}],
                                             "stream": True, "stream_options": {"include_usage": None}})
    assert chat == validated(ChatCompletionRequest, {"messages": MESSAGES, "stream": True, "stream_options": {}})
    tgi = validated(GenerateRequest, {"inputs": "x", "parameters": _with_every_optional_null(
        GenerateRequest.model_fields["parameters"].annotation, {})})
    assert tgi == validated(GenerateRequest, {"inputs": "x"})


def test_null_defaults_on_completions_are_the_absent_ones():
    # max_tokens: null is OpenAI's default (16), not "as many as fit"
    assert validated(CompletionRequest, {"prompt": "x", "max_tokens": None}).max_tokens == 16
    assert validated(CompletionRequest, {"prompt": "x", "n": None, "echo": None}).n == 1


@pytest.mark.parametrize(("model", "body", "field"), [
    (ChatCompletionRequest, {"messages": None}, "messages"),
    (GenerateRequest, {"inputs": None}, "inputs"),
    (ChatCompletionRequest, {"messages": [{"role": None, "content": "x"}]}, "messages.0.role"),
    (ChatCompletionRequest, {"messages": MESSAGES, "n": "2"}, "n"),
    (CompletionRequest, {"prompt": "x", "seed": 1.5}, "seed"),
    (GenerateRequest, {"inputs": "x", "parameters": {"stop": "x"}}, "parameters.stop"),
])
def test_required_nulls_and_wrong_types_are_still_refused(model, body, field):
    with pytest.raises(RequestError) as refused:
        validated(model, body)
    assert refused.value.param == field
    if field in ("messages", "inputs"):
        assert "not null" in refused.value.message


def test_text_generation_clients_bodies_validate():
    """The bodies text-generation 0.7.0 builds (every field, null when unset) pass as it sends them."""
    types = pytest.importorskip("text_generation.types")
    chat = types.ChatRequest(model="tgi", messages=[types.Message(role="user", content="hi")], max_tokens=5,
                             temperature=0.5)
    parsed = validated(ChatCompletionRequest, json.loads(json.dumps(chat.model_dump())))
    assert (parsed.n, parsed.seed, parsed.stop, parsed.max_tokens, parsed.temperature) == (1, None, None, 5, 0.5)
    params = types.Parameters(max_new_tokens=7, details=True, top_n_tokens=2, stop=["x"],
                              grammar=types.Grammar(type="regex", value="[0-9]+"))
    request = types.Request(inputs="hello", stream=False, parameters=params)
    parsed = validated(GenerateRequest, json.loads(json.dumps(request.model_dump())))
    assert parsed.parameters.max_new_tokens == 7 and parsed.parameters.stop == ["x"]
    assert parsed.parameters.sampling_kwargs()["temperature"] == 0.0  # TGI's default: greedy


def _our_chunk(delta: ChatDelta, finish_reason: str | None = None) -> dict:
    chunk = ChatCompletionChunk(id="c", created=1, model="m",
                                choices=[ChatChunkChoice(index=0, delta=delta, finish_reason=finish_reason)])
    body = chunk.model_dump()
    body["choices"][0]["delta"] = {k: v for k, v in body["choices"][0]["delta"].items() if v is not None}
    return body


def test_tgi_chat_chunks_parse_as_text_generations_chunks():
    types = pytest.importorskip("text_generation.types")
    for delta, reason in [(ChatDelta(role="assistant", content=""), None), (ChatDelta(content="Paris"), None),
                          (ChatDelta(), "stop")]:
        ours = _our_chunk(delta, reason)
        with pytest.raises(pydantic.ValidationError):  # OpenAI's form: no tool_calls, a role only at first
            types.ChatCompletionChunk(**ours)
        parsed = types.ChatCompletionChunk(**tgi_chat_chunk(ours))
        assert parsed.choices[0].delta.role == "assistant"
        assert parsed.choices[0].delta.content == delta.content and parsed.choices[0].finish_reason == reason


def test_tgi_chat_error_events_are_tgis_errors():
    errors = pytest.importorskip("text_generation.errors")
    refused = tgi_chat_chunk({"error": {"message": "bad", "type": "invalid_request_error"}})
    failed = tgi_chat_chunk({"error": {"message": "boom", "type": "internal_server_error"}})
    assert isinstance(errors.parse_error(200, refused), errors.ValidationError)
    assert isinstance(errors.parse_error(200, failed), errors.GenerationError)


def _app_streaming(fail_with: Exception) -> FastAPI:
    app = FastAPI()

    async def events():
        yield 'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
        raise fail_with

    async def route(request: Request):
        note_flags(request, await request.json())
        return SSEResponse(events(), [])

    app.add_api_route("/v1/chat/completions", route, methods=["POST"])
    app.add_api_route("/v1/completions", route, methods=["POST"])
    app.add_api_route("/generate_stream", route, methods=["POST"])
    return app


def _events(app: FastAPI, path: str, body: dict) -> list:
    with TestClient(app) as client:
        text = client.post(path, json=body).text
    return [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize(("fault", "openai_type", "tgi_type"), [
    (RuntimeError("secret detail"), "internal_server_error", "generation"),
    (RequestError("found late"), "invalid_request_error", "validation"),
])
def test_a_stream_that_fails_once_open_ends_in_an_error_event(fault, openai_type, tgi_type):
    app = _app_streaming(fault)
    openai = _events(app, "/v1/chat/completions", {"model": "smol"})
    assert openai[0]["choices"][0]["delta"] == {"content": "a"} and openai[-1]["error"]["type"] == openai_type
    tgi = _events(app, "/generate_stream", {"inputs": "x"})
    assert tgi[-1]["error_type"] == tgi_type and isinstance(tgi[-1]["error"], str)
    dialect = _events(app, "/v1/chat/completions", {"model": "tgi"})
    assert dialect[0]["choices"][0]["delta"] == {"role": "assistant", "content": "a", "tool_calls": None}
    assert dialect[-1]["error_type"] == tgi_type
    completions = _events(app, "/v1/completions", {"model": "tgi"})  # chat's dialect only on chat
    assert completions[0] == openai[0] and completions[-1]["error"]["type"] == openai_type
    message = openai[-1]["error"]["message"]
    assert ("found late" in message) == isinstance(fault, RequestError) and "secret detail" not in message


@pytest.mark.parametrize(("path", "flags", "status", "media", "tgi_shape"), [
    ("/v1/chat/completions", {"tgi_dialect": True, "streamed": True}, 400, "text/event-stream", True),
    ("/v1/chat/completions", {"tgi_dialect": True, "streamed": False}, 400, "application/json", False),
    ("/v1/completions", {"tgi_dialect": True, "streamed": True}, 400, "application/json", False),
    ("/v1/chat/completions", {"tgi_dialect": False, "streamed": True}, 400, "application/json", False),
    ("/generate_stream", {"streamed": True}, 422, "application/json", True),
])
def test_only_a_refused_chat_stream_in_tgis_dialect_is_an_event(path, flags, status, media, tgi_shape):
    from fp8cache.server.errors import error_response

    response = error_response(path, RequestError("n: bad", param="n"), flags=flags)
    assert response.status_code == status and response.media_type == media
    body = json.loads(response.body.decode().removeprefix("data: "))
    assert body == ({"error": "n: bad", "error_type": "validation"} if tgi_shape else
                    {"error": {"message": "n: bad", "type": "invalid_request_error", "param": "n", "code": None}})
