"""`fp8kv bench serve`: drive a running OpenAI-compatible server over HTTP and measure what clients see.

Requests stream from /v1/completions. They arrive as a Poisson process at `request_rate` per second
(seeded, so a run can be repeated), or all at once for rate inf, with at most `max_concurrency` in flight.
Per request: time to first token (TTFT), the gaps between streamed chunks (ITL), time per output token
after the first (TPOT) and end-to-end latency. A request that errors, gets a non-2xx answer, or whose
stream breaks or ends without [DONE] counts as failed and does not stop the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    start_s: float = 0.0  # since the benchmark started
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


class ServeBench:
    """One run. `results` fills as requests finish, so an interrupted run can still be summarized."""

    def __init__(self, url: str, model: str, prompts: list[str], input_lens: list[int], output_len: int,
                 request_rate: float = math.inf, max_concurrency: int | None = None, seed: int = 0,
                 ignore_eos: bool = True, api_key: str | None = None, timeout_s: float = 600.0,
                 count_tokens: Callable[[str], int] | None = None) -> None:
        if request_rate <= 0:
            raise ValueError(f"request_rate={request_rate} must be > 0 requests/s (or inf: all at once)")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1 (or None: no limit)")
        if len(prompts) != len(input_lens) or not prompts:
            raise ValueError("give at least one prompt and one input length per prompt")
        self.url = url.rstrip("/")
        self.model, self.prompts, self.input_lens = model, prompts, input_lens
        self.output_len, self.request_rate, self.max_concurrency = output_len, request_rate, max_concurrency
        self.seed, self.ignore_eos, self.api_key, self.timeout_s = seed, ignore_eos, api_key, timeout_s
        self.count_tokens = count_tokens
        self.results: list[RequestResult] = []
        self.started: float | None = None
        self.finished: float | None = None

    def arrival_gaps(self) -> list[float]:
        """Seconds to wait before each request: exponential gaps (a Poisson process), 0 for rate inf."""
        if math.isinf(self.request_rate):
            return [0.0] * len(self.prompts)
        rng = random.Random(self.seed)
        return [0.0] + [rng.expovariate(self.request_rate) for _ in self.prompts[1:]]

    @property
    def duration_s(self) -> float:
        if self.started is None:
            return 0.0
        return (self.finished or time.perf_counter()) - self.started

    async def run(self, on_result: Callable[[RequestResult], None] | None = None) -> list[RequestResult]:
        import httpx

        limit = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        connections = httpx.Limits(max_connections=self.max_concurrency or len(self.prompts))
        timeout = httpx.Timeout(self.timeout_s, connect=30.0)
        async with httpx.AsyncClient(headers=headers, limits=connections, timeout=timeout) as client:

            async def one(i: int) -> None:
                if limit is None:
                    result = await self._request(client, i)
                else:
                    async with limit:
                        result = await self._request(client, i)
                self.results.append(result)
                if on_result is not None:
                    on_result(result)

            self.started = time.perf_counter()
            tasks = []
            try:
                for i, gap in enumerate(self.arrival_gaps()):
                    if gap:
                        await asyncio.sleep(gap)
                    tasks.append(asyncio.ensure_future(one(i)))
                await asyncio.gather(*tasks)
            finally:
                self.finished = time.perf_counter()
                for t in tasks:  # only left running when the run itself is cancelled (Ctrl-C)
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return self.results

    async def _request(self, client, i: int) -> RequestResult:
        import httpx

        body = {"model": self.model, "prompt": self.prompts[i], "max_tokens": self.output_len,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        start = time.perf_counter()
        result = RequestResult(ok=False, start_s=start - self.started, input_tokens=self.input_lens[i])
        try:
            async with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                if response.status_code // 100 != 2:
                    text = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {_short(text)}"
                    return result
                await self._read_stream(response, start, result)
        except (httpx.HTTPError, OSError) as exc:  # connect errors, timeouts, cut connections
            result.error = f"{type(exc).__name__}: {_short(str(exc)) or 'connection failed'}"
        return result

    async def _read_stream(self, response, start: float, result: RequestResult) -> None:
        text_parts: list[str] = []
        usage = None
        last = start
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments, keep-alives
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                result.error = f"broken stream: not JSON: {_short(data)}"
                return
            if not isinstance(event, dict) or event.get("error"):
                result.error = f"error in stream: {_short(json.dumps(event))}"
                return
            usage = event.get("usage") or usage
            choices = event.get("choices") or []
            text = (choices[0].get("text") or "") if choices else ""
            if text:
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                text_parts.append(text)
        if not done:
            result.error = "broken stream: it ended without data: [DONE]"
            return
        result.latency_s = time.perf_counter() - start
        if result.ttft_s is None:
            result.error = "the stream carried no text"
            return
        result.output_tokens = self._output_tokens(usage, "".join(text_parts), len(text_parts))
        if usage and usage.get("prompt_tokens"):
            result.input_tokens = int(usage["prompt_tokens"])
        result.ok = True

    def _output_tokens(self, usage: dict | None, text: str, chunks: int) -> int:
        # The server's own count first; else our tokenizer's count of the text; else one token a chunk.
        if usage and usage.get("completion_tokens"):
            return int(usage["completion_tokens"])
        if self.count_tokens is not None:
            return self.count_tokens(text)
        return chunks


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """Request counts, throughput over the run's duration, and latency statistics in milliseconds."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    errors = Counter(r.error for r in failed)
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    summary = {"completed": len(ok), "failed": len(failed), "errors": dict(errors.most_common(10)),
               "duration_s": duration_s, "input_tokens": input_tokens, "output_tokens": output_tokens,
               "request_throughput": len(ok) / duration, "output_tokens_per_s": output_tokens / duration,
               "total_tokens_per_s": (input_tokens + output_tokens) / duration}
    series = {"ttft_ms": [r.ttft_s for r in ok], "tpot_ms": [r.tpot_s for r in ok if r.tpot_s is not None],
              "itl_ms": [gap for r in ok for gap in r.itl_s], "e2el_ms": [r.latency_s for r in ok]}
    for name, seconds in series.items():
        summary[name] = latency_stats([1000.0 * s for s in seconds])
    return summary


def latency_stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    data = np.asarray(values, dtype=np.float64)
    stats = {"mean": float(data.mean())}
    for q in PERCENTILES:
        stats["median" if q == 50 else f"p{q}"] = float(np.percentile(data, q))
    return stats


def load_tokenizer(path: str | None = None):
    """The tokenizer that cuts the prompts: the folder given, else the default model's. A shape fp8kv ships
    (llama-3.1-8b, ...), or a folder with a config and no tokenizer, gets the byte-level tokenizer that a
    server started on it with --load-format dummy builds."""
    import os

    from transformers import AutoConfig, AutoTokenizer

    from fp8cache.model import dummy, hub, shapes

    if path is None:
        from fp8cache.model.default_model import ensure_default_model

        path = ensure_default_model()
    folder = shapes.shape_path(path) if not os.path.exists(path) else path
    if folder is None and hub.looks_like_repo_id(path):  # a hub id, as the server was started with
        folder = path = hub.resolve(path, tokenizer_only=True)
    if folder is not None and os.path.isfile(os.path.join(folder, "config.json")) and not dummy.has_tokenizer(folder):
        return dummy.byte_tokenizer(AutoConfig.from_pretrained(folder, local_files_only=True))
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {path!r} ({exc}); give the served model's folder "
                         "with --tokenizer PATH") from exc


def make_prompts(tokenizer, num_prompts: int, input_len: int, text_path: str | None = None
                 ) -> tuple[list[str], list[int]]:
    """WikiText-2 windows of input_len tokens, as text, and their lengths."""
    from fp8cache.bench.prompts import PromptSource

    texts = PromptSource(tokenizer, text_path).take_text(num_prompts, input_len)
    return texts, [input_len] * num_prompts


def fetch_model_name(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model the server lists at /v1/models."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=timeout_s)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise ConnectionError(f"cannot list the models of {url} ({type(exc).__name__}: {_short(str(exc))}); "
                              "is the server running there? Give --model NAME to skip this lookup") from exc


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
