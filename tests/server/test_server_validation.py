"""Malformed requests against a real server: each gets its 4xx with an error that names the field, in the
error shape of its API, and the server keeps serving with nothing leaked."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
from server_process import ServerProcess, wait_idle

API_KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 128
MAX_REQUEST_BYTES = 65536
LONG_TEXT = "hello " * 300  # > MAX_MODEL_LEN tokens
MID_TEXT = "hello " * 100  # fits, but not with 100 more tokens
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


@dataclass
class Case:
    name: str
    path: str
    body: dict | bytes | None
    status: int
    param: str | None = None  # the field the error must name
    headers: dict | None = None
    method: str = "POST"


def msg(content, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], **extra}


def gen(**parameters) -> dict:
    return {"inputs": "Hello", "parameters": parameters}


CASES = [
    # body-level problems
    Case("bad json", CMPL, b'{"prompt": "x",', 400, "body"),
    Case("invalid utf-8", CMPL, b'{"prompt": "\xff\xfe"}', 400, "body"),
    Case("json array", CMPL, b"[1, 2]", 400, "body"),
    Case("empty body", CMPL, b"", 400, "body"),
    Case("NaN literal", CMPL, b'{"prompt": "x", "temperature": NaN}', 400, "body"),
    Case("deep nesting", CMPL, b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}", 400, "body"),
    Case("unknown field", CMPL, {"prompt": "x", "foo": 1}, 400, "foo"),
    # completions fields
    Case("missing prompt", CMPL, {}, 400, "prompt"),
    Case("prompt int", CMPL, {"prompt": 5}, 400, "prompt"),
    Case("prompt empty", CMPL, {"prompt": ""}, 400, "prompt"),
    Case("prompt mixed list", CMPL, {"prompt": [1, "a"]}, 400, "prompt"),
    Case("prompt negative id", CMPL, {"prompt": [-1]}, 400, "prompt"),
    Case("prompt id beyond vocab", CMPL, {"prompt": [10**6]}, 400, "prompt"),
    Case("prompt bools", CMPL, {"prompt": [True]}, 400, "prompt"),
    Case("prompt too long", CMPL, {"prompt": LONG_TEXT}, 400, "prompt"),
    Case("prompt+max_tokens too long", CMPL, {"prompt": MID_TEXT, "max_tokens": 100}, 400, "max_tokens"),
    Case("max_tokens 0", CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    Case("max_tokens negative", CMPL, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    Case("max_tokens string", CMPL, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    Case("max_tokens float", CMPL, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    Case("max_tokens huge", CMPL, {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    Case("temperature negative", CMPL, {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    Case("temperature too high", CMPL, {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    Case("temperature string", CMPL, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    Case("top_p zero", CMPL, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    Case("top_p above one", CMPL, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    Case("top_k -2", CMPL, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    Case("top_k float", CMPL, {"prompt": "x", "top_k": 1.5}, 400, "top_k"),
    Case("min_p above one", CMPL, {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    Case("presence_penalty 3", CMPL, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    Case("frequency_penalty -3", CMPL, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    Case("repetition_penalty 0", CMPL, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    Case("repetition_penalty 1e-300", CMPL, {"prompt": "x", "repetition_penalty": 1e-300}, 400,
         "repetition_penalty"),  # finite in JSON, inf in float32 logits: every seen token tied at inf
    Case("n zero", CMPL, {"prompt": "x", "n": 0}, 400, "n"),
    Case("n too many", CMPL, {"prompt": "x", "n": 100}, 400, "n"),
    Case("stop too many", CMPL, {"prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    Case("stop int", CMPL, {"prompt": "x", "stop": 5}, 400, "stop"),
    Case("stop empty string", CMPL, {"prompt": "x", "stop": [""]}, 400, "stop"),
    Case("stop too long", CMPL, {"prompt": "x", "stop": ["y" * 600]}, 400, "stop"),
    Case("seed negative", CMPL, {"prompt": "x", "seed": -1}, 400, "seed"),
    Case("seed too big", CMPL, {"prompt": "x", "seed": 2**64}, 400, "seed"),
    Case("stream string", CMPL, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    Case("echo string", CMPL, {"prompt": "x", "echo": "true"}, 400, "echo"),
    Case("prompt_logprobs while streaming", CMPL, {"prompt": "x", "stream": True, "prompt_logprobs": 1}, 400,
         "prompt_logprobs"),
    Case("logprobs too many", CMPL, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    Case("logprobs negative", CMPL, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    Case("best_of", CMPL, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    Case("logit_bias key not an id", CMPL, {"prompt": "x", "logit_bias": {"hello": 5}}, 400, "logit_bias"),
    Case("logit_bias value too big", CMPL, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    Case("logit_bias id beyond vocab", CHAT, msg("x", logit_bias={"1000000": 1}), 400, "logit_bias"),
    Case("logit_bias superscript key", CMPL, {"prompt": "x", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),
    Case("logit_bias superscript key chat", CHAT, msg("x", logit_bias={"\u00b2": 1}), 400, "logit_bias"),
    Case("logit_bias 5000 digits", CMPL, {"prompt": "x", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias"),
    Case("logit_bias 5000 digits chat", CHAT, msg("x", logit_bias={"9" * 5000: 1}), 400, "logit_bias"),
    Case("lone surrogate prompt", CMPL, b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    Case("lone surrogate in a prompt list", CMPL, b'{"prompt": ["ok", "\\udc00"]}', 400, "prompt.1"),
    Case("lone surrogate chat", CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400,
         "messages.0.content"),
    Case("lone surrogate tokenize", "/tokenize", b'{"prompt": "\\ud800"}', 422, "prompt"),
    Case("lone surrogate tgi tokenize", "/tokenize", b'{"inputs": "x\\udfff"}', 422, "inputs"),
    Case("too many sequences", CMPL, {"prompt": ["x"] * 64, "n": 16, "max_tokens": 1}, 400, "n"),
    Case("guided_choice too large", CMPL, {"prompt": "x", "max_tokens": 1, "guided_choice": ["a" * 20000]}, 400,
         "guided_choice"),
    Case("tgi regex grammar too long", "/generate", gen(max_new_tokens=1, grammar={"type": "regex",
                                                                                   "value": "a" * 5000}), 422,
         "parameters.grammar"),
    Case("stop_token_ids negative", CMPL, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    Case("stream_options without stream", CMPL, {"prompt": "x", "stream_options": {"include_usage": True}},
         400, "stream_options"),
    Case("unknown model", CMPL, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    Case("invalid while streaming", CMPL, {"prompt": "x", "stream": True, "top_p": 7}, 400, "top_p"),
    # chat fields
    Case("messages missing", CHAT, {}, 400, "messages"),
    Case("messages empty", CHAT, {"messages": []}, 400, "messages"),
    Case("messages string", CHAT, {"messages": "hi"}, 400, "messages"),
    Case("role unknown", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    Case("content int", CHAT, msg(5), 400, "messages.0.content"),
    Case("image part", CHAT, msg([{"type": "image_url", "image_url": {"url": "x"}}]), 400, "messages.0.content"),
    Case("user without content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages.0"),
    Case("max_completion_tokens 0", CHAT, msg("x", max_completion_tokens=0), 400, "max_completion_tokens"),
    Case("tool without function", CHAT, msg("x", tools=[{"type": "function"}]), 400, "tools.0.function"),
    Case("tool_choice auto", CHAT, msg("x", tools=[{"type": "function", "function": {"name": "f"}}],
                                       tool_choice="auto"), 400, "tool_choice"),
    Case("tool_choice unknown function", CHAT, msg("x", tools=[{"type": "function", "function": {"name": "f"}}],
                                                   tool_choice={"type": "function", "function": {"name": "g"}}),
         400, "tool_choice"),
    Case("tool_choice without tools", CHAT, msg("x", tool_choice="required"), 400, "tool_choice"),
    Case("tools and response_format", CHAT, msg("x", tools=[{"type": "function", "function": {"name": "f"}}],
                                                tool_choice="required", response_format={"type": "json_object"}),
         400),
    Case("top_logprobs without logprobs", CHAT, msg("x", top_logprobs=2), 400, "top_logprobs"),
    Case("top_logprobs too many", CHAT, msg("x", logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    Case("yaml response_format", CHAT, msg("x", response_format={"type": "yaml"}), 400, "response_format.type"),
    Case("json_schema without schema", CHAT, msg("x", response_format={"type": "json_schema"}), 400,
         "response_format"),
    Case("two output constraints", CMPL, {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, 400),
    Case("bad guided regex", CMPL, {"prompt": "x", "guided_regex": "[a-"}, 400, "guided_regex"),
    Case("empty guided choice", CHAT, msg("x", guided_choice=[]), 400, "guided_choice"),
    Case("chat too long", CHAT, msg(LONG_TEXT), 400, "messages"),
    Case("chat max_tokens too long", CHAT, msg("hello " * 60, max_tokens=100), 400, "max_tokens"),
    Case("chat unknown model", CHAT, msg("x", model="other"), 404, "model"),
    Case("chat streaming bad n", CHAT, msg("x", stream=True, n=0), 400, "n"),
    # TGI
    Case("tgi missing inputs", "/generate", {"parameters": {}}, 422, "inputs"),
    Case("tgi empty inputs", "/generate", {"inputs": ""}, 422, "inputs"),
    Case("tgi inputs int", "/", {"inputs": 5}, 422, "inputs"),
    Case("tgi temperature 0", "/generate", gen(temperature=0), 422, "parameters.temperature"),
    Case("tgi top_p 1", "/generate", gen(top_p=1.0), 422, "parameters.top_p"),
    Case("tgi top_k 0", "/generate", gen(top_k=0), 422, "parameters.top_k"),
    Case("tgi max_new_tokens 0", "/generate", gen(max_new_tokens=0), 422, "parameters.max_new_tokens"),
    Case("tgi too long", "/generate", {"inputs": MID_TEXT, "parameters": {"max_new_tokens": 100}}, 422,
         "parameters.max_new_tokens"),
    Case("tgi stop too many", "/generate", gen(stop=["a"] * 17), 422, "parameters.stop"),
    Case("tgi stop string", "/generate", gen(stop="x"), 422, "parameters.stop"),
    Case("tgi grammar type", "/generate", gen(grammar={"type": "ebnf", "value": "x"}), 422,
         "parameters.grammar.type"),
    Case("tgi regex grammar not a string", "/generate", gen(grammar={"type": "regex", "value": 5}), 422,
         "parameters.grammar"),
    Case("tgi bad regex grammar", "/generate", gen(grammar={"type": "regex", "value": "(x"}), 422,
         "parameters.grammar"),
    Case("tgi unknown parameter", "/generate", gen(foo=1), 422, "parameters.foo"),
    Case("tgi truncate 0", "/generate", gen(truncate=0), 422, "parameters.truncate"),
    Case("tgi typical_p 1", "/generate", gen(typical_p=1.0), 422, "parameters.typical_p"),
    Case("tgi top_n_tokens too many", "/generate", gen(top_n_tokens=21), 422, "parameters.top_n_tokens"),
    Case("tgi parameters string", "/generate", {"inputs": "x", "parameters": "x"}, 422, "parameters"),
    Case("tgi stream bad json", "/generate_stream", b'{"inputs": ', 422, "body"),
    Case("tgi stream bad value", "/generate_stream", gen(repetition_penalty=-1), 422,
         "parameters.repetition_penalty"),
    # authentication
    Case("no key completions", CMPL, {"prompt": "x"}, 401, headers={}),
    Case("wrong key models", "/v1/models", None, 401, headers={"Authorization": "Bearer nope"}, method="GET"),
    Case("basic scheme generate", "/generate", gen(), 401, headers={"Authorization": f"Basic {API_KEY}"}),
    Case("no key metrics", "/metrics", None, 401, headers={}, method="GET"),
    Case("no key info", "/info", None, 401, headers={}, method="GET"),
    Case("key prefix only", CHAT, msg("x"), 401, headers={"Authorization": f"Bearer {API_KEY[:-1]}"}),
    # size
    Case("huge completion body", CMPL, {"prompt": "x" * (MAX_REQUEST_BYTES + 10)}, 413),
    Case("huge tgi body", "/generate", {"inputs": "x" * (2 * MAX_REQUEST_BYTES)}, 413),
    # routing
    Case("GET on completions", CMPL, None, 405, method="GET"),
    Case("unknown v1 route", "/v1/nope", {"x": 1}, 404),
    Case("unknown root route", "/nope", None, 404, method="GET"),
]


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    proc = ServerProcess([default_model_path, "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "8MiB",
                          "--max-request-bytes", str(MAX_REQUEST_BYTES), "--no-access-log"],
                         str(tmp_path_factory.mktemp("server") / "server.log"), env={"FP8KV_API_KEY": API_KEY})
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


def test_table_is_large_enough():
    assert len(CASES) >= 50
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_malformed_request(server, case: Case):
    headers = dict(AUTH if case.headers is None else case.headers)
    kwargs = {}
    if isinstance(case.body, bytes):
        kwargs["content"] = case.body
        headers["Content-Type"] = "application/json"
    elif case.body is not None:
        kwargs["json"] = case.body
    with server.client(headers=headers) as c:
        response = c.request(case.method, case.path, **kwargs)
    assert response.status_code == case.status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    if case.path.startswith("/v1/"):
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, body
        message = error["message"]
        if case.param is not None:
            assert error["param"] == case.param, body
    else:
        assert set(body) == {"error", "error_type"}, body
        message = body["error"]
        if case.status == 422:
            assert body["error_type"] == "validation"
    assert isinstance(message, str) and message
    if case.param is not None and case.param != "body":
        assert case.param.split(".")[-1] in message, message
    if case.status == 401:
        assert response.headers.get("www-authenticate") == "Bearer"


@pytest.mark.slow
def test_oversized_chunked_body_is_refused(server):
    def chunks():
        for _ in range(8):
            yield b"x" * (MAX_REQUEST_BYTES // 4)

    with server.client(headers=AUTH) as c:
        response = c.post(CMPL, content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert "max-request-bytes" in response.json()["error"]["message"]


@pytest.mark.slow
def test_health_needs_no_key(server):
    with server.client() as c:
        assert c.get("/health").status_code == 200


@pytest.mark.slow
def test_server_still_serves_and_leaks_nothing(server):
    # Runs after the table: a good request works, no request is left behind and no block is held.
    with server.client(headers=AUTH) as c:
        ok = c.post(CMPL, json={"prompt": "Hello there", "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] >= 1
        stream = c.post(CHAT, json=msg("Hi", max_tokens=2, stream=True))
        assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    stats = wait_idle(server, AUTH)
    assert stats["blocks_used"] == 0 and stats["active_requests"] == 0, stats
    with server.client(headers=AUTH) as c:
        metrics = c.get("/metrics").text
    statuses = [line for line in metrics.splitlines() if line.startswith("fp8kv_requests_total{")]
    assert statuses and not any('status="5' in line for line in statuses), statuses
    assert any('status="401"' in line for line in statuses)


@pytest.mark.slow
def test_raw_http_garbage_does_not_break_the_server(server):
    # A request line no HTTP parser accepts, then a normal request on a fresh connection.
    import socket
    from urllib.parse import urlparse

    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(b"\x00\x01GARBAGE\r\n\r\n")
        reply = sock.recv(1024)
    assert reply == b"" or reply.startswith(b"HTTP/1.1 4")
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        assert c.get("/v1/models").status_code == 200


def test_a_whole_oversized_body_in_one_message_is_refused_without_waiting():
    """The body can arrive in one ASGI message (more_body False); the refusal must not then wait for more."""
    import asyncio

    from starlette.requests import Request

    from fp8cache.server import parsing as server_app
    from fp8cache.server import protocol as P

    sent = []

    async def receive():
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": b"x" * 2048, "more_body": False}
        await asyncio.sleep(3600)  # a client waiting for our answer sends nothing more

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)

    async def read():
        return await asyncio.wait_for(server_app.read_json(request, 1024), timeout=10)

    with pytest.raises(P.RequestError) as refused:
        asyncio.run(read())
    assert refused.value.status == 413
