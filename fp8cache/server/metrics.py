"""Prometheus metrics of one server, in its own CollectorRegistry so several apps can live in one process.

Every series carries `model_name` and `kv_cache_dtype` labels so dashboards can put an fp8 and an auto
deployment of the same model side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_COMMON = ("model_name", "kv_cache_dtype")


class ServerMetrics:
    def __init__(self, model_name: str, kv_cache_dtype: str, info: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._labels = {"model_name": model_name, "kv_cache_dtype": kv_cache_dtype}
        r = self.registry
        self.requests = Counter("fp8kv_requests", "HTTP requests answered, by route and status code.",
                                _COMMON + ("route", "status"), registry=r)
        self.request_duration = Histogram(
            "fp8kv_request_duration_seconds", "Time from request arrival to the last byte of the answer.",
            _COMMON + ("route",), buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("fp8kv_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.",
                              _COMMON, buckets=_LATENCY_BUCKETS, registry=r).labels(**self._labels)
        self.itl = Histogram("fp8kv_inter_token_latency_seconds",
                             "Time between two generated tokens of one sequence.",
                             _COMMON, buckets=_LATENCY_BUCKETS, registry=r).labels(**self._labels)
        self.batch_size = Histogram("fp8kv_batch_size", "Sequences in one engine step.",
                                    _COMMON, buckets=_BATCH_BUCKETS, registry=r).labels(**self._labels)
        self.prompt_tokens = self._counter("fp8kv_prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = self._counter("fp8kv_generation_tokens", "Tokens generated.")
        self.aborted = self._counter("fp8kv_requests_aborted", "Requests aborted (client gone or shutdown).")
        self.queue_size = self._gauge("fp8kv_num_requests_waiting", "Requests waiting for a batch slot.")
        self.running = self._gauge("fp8kv_num_requests_running", "Requests in the running batch.")
        self.blocks_used = self._gauge("fp8kv_kv_cache_blocks_used", "KV cache blocks holding tokens.")
        self.blocks_free = self._gauge("fp8kv_kv_cache_blocks_free", "KV cache blocks free.")
        self.usage = self._gauge("fp8kv_kv_cache_usage_ratio", "Share of KV cache blocks in use (0-1).")
        self.prefix_hit_rate = self._gauge("fp8kv_prefix_cache_hit_rate",
                                           "Share of queried prompt blocks found in the prefix cache.")
        self.engine_alive = self._gauge("fp8kv_engine_alive", "1 while the engine loop runs.")
        # vLLM's names; the engine keeps running totals, which these counters follow (_totals: the last seen).
        self._totals: dict[str, float] = {}
        self.spec_draft_tokens = self._counter("fp8kv_spec_decode_num_draft_tokens",
                                               "Speculative decoding: proposed tokens verified.")
        self.spec_accepted_tokens = self._counter("fp8kv_spec_decode_num_accepted_tokens",
                                                  "Speculative decoding: proposed tokens accepted.")
        self.structured_output_compiles = Counter(
            "fp8kv_structured_output_compiles", "Structured output grammars asked for, by outcome: compiled, "
            "cached, refused (too big, too costly or invalid), busy (costly ones' line full: 429), timeout, memory "
            "(over budget), cancelled (client gone).",
            _COMMON + ("outcome",), registry=r)
        self.cache_info = Info("fp8kv_kv_cache", "KV cache configuration.", registry=r)
        self.cache_info.info({"kv_cache_dtype": kv_cache_dtype, "model_name": model_name, **(info or {})})

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, _COMMON, registry=self.registry).labels(**self._labels)

    def _gauge(self, name: str, doc: str):
        return Gauge(name, doc, _COMMON, registry=self.registry).labels(**self._labels)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(**self._labels, route=route, status=str(status)).inc()
        self.request_duration.labels(**self._labels, route=route).observe(seconds)

    def observe_compile(self, outcome: str) -> None:
        self.structured_output_compiles.labels(**self._labels, outcome=outcome).inc()

    def observe_engine(self, stats: dict[str, float]) -> None:
        """Refresh the gauges from an engine stats snapshot (see AsyncEngine.stats)."""
        self.queue_size.set(stats.get("num_waiting", 0))
        self.running.set(stats.get("num_running", 0))
        used, free = stats.get("blocks_used", 0), stats.get("blocks_free", 0)
        self.blocks_used.set(used)
        self.blocks_free.set(free)
        self.usage.set(used / (used + free) if used + free else 0.0)
        self.prefix_hit_rate.set(stats.get("prefix_cache_hit_rate", 0.0))
        self.engine_alive.set(1 if stats.get("engine_alive") else 0)
        for counter, name in ((self.spec_draft_tokens, "spec_decode_num_draft_tokens"),
                              (self.spec_accepted_tokens, "spec_decode_num_accepted_tokens")):
            total = stats.get(name, 0)
            if total > self._totals.get(name, 0):  # a counter only goes up: add what the engine added since
                counter.inc(total - self._totals.get(name, 0))
                self._totals[name] = total

    def watch_saturation(self, source: Callable[[], Sequence]) -> None:
        """Expose the cache write's per-layer counts (kvcache/saturation.py LayerSaturation rows from `source`,
        e.g. ModelRunner.saturation_counts), read at each scrape."""
        self.registry.register(_SaturationCollector(source, self._labels))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SaturationCollector:
    """fp8kv_kv_cache_{written,saturated,underflow}_total{layer,kind}: counters the engine keeps itself."""

    _SERIES = (("written", "K/V values counted at the cache write (static scales; a sample of the steps)."),
               ("saturated", "K/V values clipped at the FP8 format's largest magnitude by the cache write."),
               ("underflow", "Nonzero K/V values the cache write stored as zero codes (flushed to zero)."))

    def __init__(self, source: Callable[[], Sequence], labels: dict[str, str]) -> None:
        self.source, self.labels = source, labels

    def collect(self) -> Iterator[CounterMetricFamily]:
        rows = self.source()
        names = list(self.labels) + ["layer", "kind"]
        for field, doc in self._SERIES:
            family = CounterMetricFamily(f"fp8kv_kv_cache_{field}", doc, labels=names)
            for row in rows:
                family.add_metric([*self.labels.values(), str(row.layer), row.kind], getattr(row, field))
            yield family

    def describe(self) -> list:
        return []  # no description at registration: collect() reads the engine's counts only on a scrape
