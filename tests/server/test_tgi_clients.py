"""Hugging Face's clients against a real `fp8kv run`: TGI's own `text-generation` 0.7.0 (Client, AsyncClient) and
huggingface_hub's InferenceClient, unchanged, on the routes and shapes they read; the texts they get are the
engine's (fp8cache's offline LLM with the same model and cache), and every failure, before or during a stream,
reaches them as an exception they raise.

text-generation 0.7.0 pins an old huggingface-hub, so it is installed without its dependencies
(`pip install --no-deps text-generation==0.7.0`; it needs pydantic and aiohttp): these tests are skipped where
it is missing.
"""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import machines_auto_dtype
from server_process import ServerProcess, wait_idle

# text-generation 0.7.0 calls pydantic's deprecated .dict(); not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:text_generation")
try:  # not in the test extra: it must be installed without its dependencies (see the docstring)
    import text_generation as tg
    from text_generation import errors as tg_errors
    from text_generation.types import Grammar, Message
except ImportError:
    pytest.skip("needs text-generation: pip install --no-deps text-generation==0.7.0", allow_module_level=True)

MAX_MODEL_LEN = 256
KV_CACHE_MEMORY = "24MiB"
TOO_MANY = 10_000  # new tokens past MAX_MODEL_LEN: refused before anything runs
PROMPT = "The sun rises in the"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

# Faults injected in the server (by the max_tokens of a request, so that the other tests are unaffected): the
# request's stream fails after its first two outputs, as a bug, as a refusal only found then, or as the engine's
# death.
BUG_AFTER_TWO = 13
REFUSAL_AFTER_TWO = 14
ENGINE_DEATH_AFTER_TWO = 15
FAULTS = f"""
import fp8cache.server.generation as _generation
from fp8cache.server.async_engine import EngineDeadError
from fp8cache.server.protocol.request_error import RequestError

_FAULTS = {{{BUG_AFTER_TWO}: lambda: RuntimeError("injected fault"),
           {REFUSAL_AFTER_TWO}: lambda: RequestError("injected: refused once the stream was open"),
           {ENGINE_DEATH_AFTER_TWO}: lambda: EngineDeadError("injected")}}
_submit_all = _generation.submit_all


class _FailingStream:
    def __init__(self, stream, fault):
        self.stream, self.fault, self.seen = stream, fault, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.seen == 2:
            raise self.fault()
        self.seen += 1
        return await self.stream.__anext__()

    def close(self):
        self.stream.close()


def _submit_all_with_faults(state, request_id, prepared):
    streams = _submit_all(state, request_id, prepared)
    fault = _FAULTS.get(prepared.max_tokens)
    return streams if fault is None else [_FailingStream(s, fault) for s in streams]


_generation.submit_all = _submit_all_with_faults  # before the routes import it
"""


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    proc = ServerProcess([default_model_path, "--kv-cache-dtype", "fp8", "--kv-cache-memory", KV_CACHE_MEMORY,
                          "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "smol"],
                         str(tmp_path_factory.mktemp("server") / "server.log"), python_prelude=FAULTS)
    yield proc
    code = proc.stop()
    assert code == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def reference(default_model_path):
    """The offline LLM, run on a worker thread (OpenMP's spin-waiting slows this process's main thread badly on
    a busy machine; see test_server.ThreadedLLM)."""
    from fp8cache import LLM

    pool = ThreadPoolExecutor(1)
    llm = pool.submit(LLM, model=default_model_path, kv_cache_dtype="fp8", kv_cache_memory=KV_CACHE_MEMORY,
                      max_model_len=MAX_MODEL_LEN, dtype=machines_auto_dtype(), log=lambda msg: None).result()

    class Reference:
        def generate(self, prompt, params):
            return pool.submit(llm.generate, prompt, params).result()[0]

        def chat(self, messages, params):
            return pool.submit(llm.chat, messages, params).result()[0]

    yield Reference()
    pool.shutdown()


def greedy(max_tokens: int, **kwargs):
    from fp8cache import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def tgi_finish_reason(completion) -> str:
    if completion.finish_reason == "length":
        return "length"
    return "stop_sequence" if isinstance(completion.stop_reason, str) else "eos_token"


def messages() -> list:
    return [Message(**m) for m in CHAT]


# -- text-generation 0.7.0 ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_text_generation_generate_sync_and_async(server, reference):
    # Client.generate posts to / and reads payload[0]: TGI's one-element list
    want = reference.generate(PROMPT, greedy(8, logprobs=2, prompt_logprobs=0))
    out = want.outputs[0]
    sync = tg.Client(server.url, timeout=120).generate(PROMPT, max_new_tokens=8, decoder_input_details=True,
                                                      top_n_tokens=2)
    asynchronous = asyncio.run(tg.AsyncClient(server.url, timeout=120).generate(PROMPT, max_new_tokens=8))
    assert sync.generated_text == asynchronous.generated_text == out.text
    for response in (sync, asynchronous):
        details = response.details
        assert [t.id for t in details.tokens] == out.token_ids
        assert details.generated_tokens == len(out.token_ids)
        assert details.finish_reason.value == tgi_finish_reason(out)
        assert [t.logprob for t in details.tokens] == pytest.approx(
            [entry[t].logprob for entry, t in zip(out.logprobs, out.token_ids)], abs=1e-4)
    assert [t.id for t in sync.details.prefill] == want.prompt_token_ids
    assert sync.details.prefill[0].logprob is None
    assert [t.logprob for t in sync.details.prefill[1:]] == pytest.approx(
        [e[t].logprob for e, t in zip(want.prompt_logprobs[1:], want.prompt_token_ids[1:])], abs=1e-4)
    assert [[t.id for t in top] for top in sync.details.top_tokens] == [
        sorted(entry, key=lambda t: -entry[t].logprob)[:2] for entry in out.logprobs]
    assert asynchronous.details.prefill == [] and asynchronous.details.top_tokens is None


@pytest.mark.slow
def test_text_generation_generate_with_grammar_and_stop(server, reference):
    from fp8cache.engine.structured_output import StructuredOutputsParams

    client = tg.Client(server.url, timeout=120)
    digits = client.generate("Pick a number:", max_new_tokens=6, grammar=Grammar(type="regex", value="[0-9]{3}"))
    want = reference.generate("Pick a number:", greedy(6, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")))
    assert re.fullmatch("[0-9]{3}", digits.generated_text) and digits.generated_text == want.outputs[0].text
    stopped = client.generate("Count: one, two,", max_new_tokens=12, stop_sequences=[" four"], return_full_text=True)
    want = reference.generate("Count: one, two,", greedy(12, stop=[" four"])).outputs[0]
    assert stopped.generated_text == "Count: one, two," + want.text
    assert stopped.details.finish_reason.value == tgi_finish_reason(want)


@pytest.mark.slow
def test_text_generation_generate_stream_sync_and_async(server, reference):
    out = reference.generate(PROMPT, greedy(8)).outputs[0]

    async def collect():
        return [e async for e in tg.AsyncClient(server.url, timeout=120).generate_stream(PROMPT, max_new_tokens=8)]

    for events in (list(tg.Client(server.url, timeout=120).generate_stream(PROMPT, max_new_tokens=8)),
                   asyncio.run(collect())):
        assert [e.token.id for e in events] == out.token_ids
        assert "".join(e.token.text for e in events) == out.text == events[-1].generated_text
        assert events[-1].details.generated_tokens == len(out.token_ids)
        assert events[-1].details.finish_reason.value == tgi_finish_reason(out)
        assert all(e.details is None and e.generated_text is None for e in events[:-1])


@pytest.mark.slow
def test_text_generation_chat_sync_and_async_streamed_or_not(server, reference):
    # Client.chat sends every optional field, null when unset ("n": null, "seed": null, ...), and model "tgi";
    # streamed, it needs TGI's chunks (role and tool_calls on every delta, no [DONE]).
    want = reference.chat(CHAT, greedy(8))
    text = want.outputs[0].text
    client = tg.Client(server.url, timeout=120)
    whole = client.chat(messages(), max_tokens=8, temperature=0)
    assert whole.choices[0].message.content == text
    assert whole.choices[0].finish_reason == want.outputs[0].finish_reason
    assert whole.usage == {"prompt_tokens": len(want.prompt_token_ids), "completion_tokens": len(
        want.outputs[0].token_ids), "total_tokens": len(want.prompt_token_ids) + len(want.outputs[0].token_ids)}
    chunks = list(client.chat(messages(), max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == want.outputs[0].finish_reason

    async def chat_async():
        aclient = tg.AsyncClient(server.url, timeout=120)
        whole = await aclient.chat(messages(), max_tokens=8, temperature=0)
        streamed = [c async for c in await aclient.chat(messages(), max_tokens=8, temperature=0, stream=True)]
        return whole, streamed

    whole, streamed = asyncio.run(chat_async())
    assert whole.choices[0].message.content == text
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text


@pytest.mark.slow
def test_text_generation_refusals_raise(server):
    client, aclient = tg.Client(server.url, timeout=120), tg.AsyncClient(server.url, timeout=120)
    with pytest.raises(tg_errors.ValidationError, match="max_new_tokens"):
        client.generate(PROMPT, max_new_tokens=TOO_MANY)
    with pytest.raises(tg_errors.ValidationError, match="max_new_tokens"):
        list(client.generate_stream(PROMPT, max_new_tokens=TOO_MANY))
    with pytest.raises(tg_errors.BadRequestError, match="max_tokens"):  # a 400 in OpenAI's shape
        client.chat(messages(), max_tokens=TOO_MANY)

    async def chat_stream():
        return [c async for c in await aclient.chat(messages(), max_tokens=TOO_MANY, stream=True)]

    # A refused chat stream used to be a 400 with a JSON body, which Client.chat(stream=True) does not read: an
    # empty stream. Now it is TGI's error event: AsyncClient raises TGI's error; Client reads it too, and then
    # fails in its own error path (it asks a requests.Response for `.status`), which still raises.
    with pytest.raises(tg_errors.ValidationError, match="max_tokens"):
        asyncio.run(chat_stream())
    with pytest.raises(AttributeError, match="status"):
        list(client.chat(messages(), max_tokens=TOO_MANY, stream=True))


@pytest.mark.slow
def test_text_generation_failures_inside_streams_raise(server):
    client, aclient = tg.Client(server.url, timeout=120), tg.AsyncClient(server.url, timeout=120)
    seen = []
    with pytest.raises(tg_errors.GenerationError, match=r"internal error \(id (\w+)"):
        seen.extend(client.generate_stream("Once upon a time", max_new_tokens=BUG_AFTER_TWO))
    assert len(seen) >= 1  # it failed after the stream opened
    with pytest.raises(tg_errors.ValidationError, match="refused once the stream was open"):
        list(client.generate_stream("Once upon a time", max_new_tokens=REFUSAL_AFTER_TWO))
    with pytest.raises(tg_errors.GenerationError, match="the engine crashed or stopped"):
        list(client.generate_stream("Once upon a time", max_new_tokens=ENGINE_DEATH_AFTER_TWO))

    async def chat_stream(max_tokens: int):
        return [c async for c in await aclient.chat(messages(), max_tokens=max_tokens, stream=True)]

    with pytest.raises(tg_errors.GenerationError, match="internal error"):
        asyncio.run(chat_stream(BUG_AFTER_TWO))
    with pytest.raises(tg_errors.ValidationError, match="refused once the stream was open"):
        asyncio.run(chat_stream(REFUSAL_AFTER_TWO))
    with pytest.raises(tg_errors.GenerationError, match="the engine crashed or stopped"):
        asyncio.run(chat_stream(ENGINE_DEATH_AFTER_TWO))
    stats = wait_idle(server)  # the failed streams' requests were aborted and their blocks freed
    assert stats["blocks_used"] == 0 and stats["active_requests"] == 0, stats


# -- huggingface_hub's InferenceClient ------------------------------------------------------------------------


@pytest.mark.slow
def test_inference_client_text_generation_details_and_stream(server, reference):
    from huggingface_hub import InferenceClient

    client = InferenceClient(model=server.url, timeout=120)
    want = reference.generate(PROMPT, greedy(8, logprobs=2, prompt_logprobs=0))
    out = want.outputs[0]
    detailed = client.text_generation(PROMPT, max_new_tokens=8, details=True, decoder_input_details=True,
                                      top_n_tokens=2)
    assert detailed.generated_text == out.text == client.text_generation(PROMPT, max_new_tokens=8)
    assert [t.id for t in detailed.details.tokens] == out.token_ids
    assert detailed.details.generated_tokens == len(out.token_ids)
    assert [t.id for t in detailed.details.prefill] == want.prompt_token_ids
    assert [[t["id"] for t in top] for top in detailed.details.top_tokens] == [
        sorted(entry, key=lambda t: -entry[t].logprob)[:2] for entry in out.logprobs]
    events = list(client.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True, top_n_tokens=2))
    assert [e.token.id for e in events] == out.token_ids and events[-1].generated_text == out.text
    assert events[-1].details.input_length == len(want.prompt_token_ids)
    assert [[t.id for t in e.top_tokens] for e in events] == [[t["id"] for t in top]
                                                               for top in detailed.details.top_tokens]
    assert "".join(client.text_generation(PROMPT, max_new_tokens=8, stream=True)) == out.text


@pytest.mark.slow
def test_inference_client_json_grammar(server, reference):
    import json

    from huggingface_hub import InferenceClient

    from fp8cache.engine.structured_output import StructuredOutputsParams

    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    text = InferenceClient(model=server.url, timeout=120).text_generation(
        "A person as JSON:", max_new_tokens=24, grammar={"type": "json", "value": schema})
    want = reference.generate("A person as JSON:", greedy(24, structured_outputs=StructuredOutputsParams(json=schema)))
    assert text == want.outputs[0].text
    if want.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text)["age"], int)


@pytest.mark.slow
def test_inference_client_chat_completion_streamed_or_not(server, reference):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=server.url, timeout=120)
    want = reference.chat(CHAT, greedy(8))
    whole = client.chat_completion(CHAT, max_tokens=8, temperature=0, seed=None, stop=None)
    assert whole.choices[0].message.content == want.outputs[0].text
    assert whole.usage.completion_tokens == len(want.outputs[0].token_ids)
    chunks = list(client.chat_completion(CHAT, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text


@pytest.mark.slow
def test_inference_client_endpoint_info_and_health(server):
    from huggingface_hub import InferenceClient

    client = InferenceClient(model=server.url, provider="hf-inference", timeout=120)
    info = client.get_endpoint_info()  # GET /info, TGI's Info
    assert info["model_id"] == "smol" and info["max_total_tokens"] == MAX_MODEL_LEN
    assert info["max_input_tokens"] == MAX_MODEL_LEN - 1 and info["max_best_of"] == 1
    assert all(isinstance(info[k], int) for k in ("max_concurrent_requests", "max_stop_sequences",
                                                  "validation_workers", "max_client_batch_size"))
    assert client.health_check()


@pytest.mark.slow
def test_inference_client_failures_raise(server):
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import GenerationError, ValidationError

    client = InferenceClient(model=server.url, timeout=120)
    with pytest.raises(ValidationError, match="max_new_tokens"):
        client.text_generation(PROMPT, max_new_tokens=TOO_MANY)
    with pytest.raises(GenerationError, match="internal error"):
        list(client.text_generation("Once upon a time", max_new_tokens=BUG_AFTER_TWO, stream=True))
    chat_client = InferenceClient(base_url=server.url, timeout=120)  # kept alive: it owns the open stream
    with pytest.raises(Exception, match="internal error"):  # the OpenAI-shaped error: UnknownError
        list(chat_client.chat_completion(CHAT, max_tokens=BUG_AFTER_TWO, stream=True))


# -- OpenAI's SDK: errors inside its streams ------------------------------------------------------------------


@pytest.mark.slow
def test_openai_sdk_raises_failures_inside_streams(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.APIError, match="internal error") as failed:
        list(client.chat.completions.create(model="smol", messages=CHAT, max_tokens=BUG_AFTER_TWO, stream=True))
    assert re.search(r"internal error \(id \w+, in the server log\)", str(failed.value))
    # what raised goes to the log only (which says a cause once per interval: maybe under an earlier id)
    assert "RuntimeError: injected fault" in server.output() and "injected" not in str(failed.value)
    with pytest.raises(openai.APIError, match="refused once the stream was open"):
        list(client.completions.create(model="smol", prompt="Once upon a time", max_tokens=REFUSAL_AFTER_TWO,
                                       stream=True))
    with pytest.raises(openai.BadRequestError):  # refused before it opened: an ordinary 400, JSON body
        client.chat.completions.create(model="smol", messages=CHAT, max_tokens=TOO_MANY, stream=True)


@pytest.mark.slow
def test_openai_sdk_reads_tgis_chat_dialect(server, reference):
    # TGI's docs point the OpenAI SDK at TGI with model "tgi": it reads TGI's chunks (no [DONE]) as well
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(model="tgi", messages=CHAT, max_tokens=8, temperature=0,
                                                 stream=True))
    want = reference.chat(CHAT, greedy(8)).outputs[0]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="tgi", messages=CHAT, max_tokens=TOO_MANY)
