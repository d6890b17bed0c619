"""What the routes share for the server's life: its settings, what it knows of the model, the engine, the
metrics and the tokenizer threads (AppState, reached from a request with app_state)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from fp8cache.engine.generation_defaults import DEFAULT_MAX_TOKENS, GenerationDefaults
from fp8cache.server import grammar as G
from fp8cache.server.async_engine import AsyncEngine
from fp8cache.server.metrics import ServerMetrics

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


@dataclass
class ServerSettings:
    served_model_name: str
    model_path: str | None = None
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_concurrent_requests: int = 256  # counted in sequences: a request's prompts times its n
    # Only these Host names are served (None: any). A server bound to loopback answers only to loopback names,
    # so that a web page cannot reach it through DNS rebinding.
    allowed_hosts: frozenset[str] | None = None
    structured_output_timeout: float = G.DEFAULT_TIMEOUT_S
    structured_output_memory: int = G.DEFAULT_MEMORY_BYTES
    stall_timeout: float = 60.0  # /health answers 503 when the engine had work but finished no step this long
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # new tokens of a request that does not say (0: the room left)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # what OpenAI requests leave out


@dataclass
class ModelInfo:
    """What the routes need to know about the loaded model and its cache."""

    tokenizer: Any
    max_model_len: int
    capacity_tokens: int
    kv_cache_dtype: str
    scales_source: str
    block_size: int
    num_blocks: int
    vocab_size: int
    model_dtype: str = "float32"
    device: str = "cpu"
    special_ids: frozenset[int] = field(default_factory=frozenset)
    kv_recent_window: int = 0  # newest tokens per sequence also kept in full precision
    kv_recent_window_sinks: int = 0  # and its first tokens (attention sinks), with the window
    window_dtype: str = "float32"  # the dtype of that window (the model dtype unless chosen)
    kv_scales: str = "static"  # or "dynamic": a scale per token and KV head
    kv_rotation: str = "none"  # the K/V rotation before FP8 (hadamard)
    skip_layers: tuple[int, ...] = ()  # layers whose cache stays in the model dtype

    @classmethod
    def from_runner(cls, runner: Any) -> ModelInfo:
        tokenizer = runner.tokenizer
        vocab = len(tokenizer)
        model_vocab = getattr(getattr(runner, "hf_config", None), "vocab_size", None)
        return cls(
            tokenizer=tokenizer, max_model_len=int(runner.max_model_len),
            capacity_tokens=int(runner.capacity_tokens), kv_cache_dtype=str(runner.cache_dtype_name),
            scales_source=str(getattr(runner, "scales_source", "none")), block_size=int(runner.block_size),
            num_blocks=int(runner.num_blocks), vocab_size=min(vocab, model_vocab) if model_vocab else vocab,
            model_dtype=str(getattr(runner, "dtype", "float32")).removeprefix("torch."),
            device=str(getattr(runner, "device", "cpu")),
            special_ids=frozenset(getattr(tokenizer, "all_special_ids", ()) or ()),
            kv_recent_window=int(getattr(runner, "kv_recent_window", 0)),
            kv_recent_window_sinks=int(getattr(runner, "kv_recent_window_sinks", 0)),
            window_dtype=str(getattr(runner, "window_dtype", getattr(runner, "dtype", "float32"))).removeprefix("torch."),
            **_cache_choices(getattr(runner, "kv_spec", None)))


def _cache_choices(spec: Any) -> dict[str, Any]:
    """The FP8 cache's scales, rotation and 16-bit layers from the runner's KVCacheSpec (none: the defaults)."""
    if spec is None:
        return {}
    return {"kv_scales": "dynamic" if spec.dynamic_scales else "static", "kv_rotation": str(spec.rotation),
            "skip_layers": tuple(spec.skip_layers)}


@dataclass
class AppState:
    settings: ServerSettings
    info: ModelInfo
    engine: AsyncEngine
    metrics: ServerMetrics
    sampling_params: Callable[..., Any]  # SamplingParams class (injected so tests may swap engines)
    # Two pools so that a short prompt never waits behind a megabyte one (tokenizers release the GIL, so the
    # work itself runs beside the event loop and the engine).
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="fp8kv-tokenizer"))
    large_tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="fp8kv-tokenizer-large"))
    grammar: G.GrammarCompiler | None = None  # made at the first structured output request

    def grammar_compiler(self) -> G.GrammarCompiler:
        if self.grammar is None:
            self.grammar = G.GrammarCompiler(self.info.tokenizer, self.settings.structured_output_timeout,
                                             self.settings.structured_output_memory,
                                             observe=self.metrics.observe_compile)
        return self.grammar


def app_state(request: Request) -> AppState:
    return request.app.state.fp8kv


LARGE_TEXT = 65536  # characters (or tokens) from which tokenizer work goes to the pool for large inputs


async def run_tokenizer(state: AppState, fn: Callable[[], Any], size: int = 0) -> Any:
    """fn() on a tokenizer thread; size: characters or tokens it works on (a large input has its own pool)."""
    pool = state.large_tokenizer_pool if size >= LARGE_TEXT else state.tokenizer_pool
    return await asyncio.get_running_loop().run_in_executor(pool, fn)
