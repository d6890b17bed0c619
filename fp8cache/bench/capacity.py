"""`fp8kv bench capacity`: what a fixed KV-cache memory budget holds per dtype, and what that buys.

For each dtype and context length: the tokens that fit, the largest batch of sequences of that context
that fits at once (from the block count: each sequence needs ceil(context / block_size) blocks), and the
throughput of that batch, run for real and checked to finish without a single preemption. The same
budget holds twice (vs bfloat16) or four times (vs float32) as many tokens in FP8, so at long context
the FP8 batch is larger, which is where its throughput comes from.

The whole batch is submitted at once; peak_running says how many the scheduler held at the same time
(chunked prefill admits long prompts one token budget at a time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from fp8cache.bench import machine
from fp8cache.bench.prompts import PromptSource
from fp8cache.bench.throughput import (
    WARMUP_OUTPUT_LEN,
    BatchResult,
    Progress,
    cache_figures,
    check_kv_cache_dtypes,
    median_result,
    run_batch,
    step_figures,
)
from fp8cache.kvcache import formats, sizing

WARMUP_INPUT_LEN = 64
KV_SCALES_CHOICES = ("static", "dynamic", "both")


def cache_variants(kv_cache_dtypes: list[str], kv_scales: str = "static") -> dict[str, dict]:
    """Engine label -> config overrides: each FP8 dtype with static scales, dynamic ones (label + " dynamic") or
    both; an auto cache (no scales) once."""
    if kv_scales not in KV_SCALES_CHOICES:
        raise ValueError(f"kv_scales={kv_scales!r}; valid: {', '.join(KV_SCALES_CHOICES)}")
    kinds = ("static", "dynamic") if kv_scales == "both" else (kv_scales,)
    variants = {}
    for dtype in kv_cache_dtypes:
        for kind in kinds if formats.get_format(dtype) is not None else ("static",):
            variants[dtype if kind == "static" else f"{dtype} dynamic"] = {"kv_cache_dtype": dtype, "kv_scales": kind}
    return variants


def token_figures(spec) -> dict:
    """Tokens per GiB of a cache spec's memory, and the share of each token's bytes its dynamic scales take (0 with
    static scales), by the engine's own sizing arithmetic (kvcache/sizing.py; no recent-token window)."""
    total = sizing.spec_bytes_per_token(spec)
    codes = sizing.spec_bytes_per_token(dataclasses.replace(spec, dynamic_scales=False))
    scales = "dynamic" if spec.dynamic_scales else "static" if spec.is_fp8 else "none"
    return {"kv_scales": scales, "tokens_per_gib": 2**30 / total, "scales_share": (total - codes) / total}


def build_engines(model: str | None, variants: dict[str, dict], log: Callable[[str], None] = print,
                  **config) -> dict[str, object]:
    """One LLMEngine per cache variant, all on one loaded copy of the weights."""
    from fp8cache.config import EngineConfig
    from fp8cache.engine.llm_engine import LLMEngine
    from fp8cache.model.loader import load_model
    from fp8cache.model.runner import ModelRunner

    base = EngineConfig(model=model, **config)
    loaded = load_model(base)
    engines = {}
    for label, overrides in variants.items():
        cfg = dataclasses.replace(base, **overrides)
        engines[label] = LLMEngine(cfg, log=log, runner=ModelRunner(cfg, log=log, loaded=loaded))
    return engines


def max_batch(num_blocks: int, block_size: int, context: int) -> int:
    """Sequences of `context` tokens that fit in the cache together."""
    return num_blocks // -(-context // block_size)


def fitting_batch(runner, context: int) -> int:
    """max_batch, and no more sequences than the recent-token window has seats for."""
    fits = max_batch(runner.num_blocks, runner.block_size, context)
    seats = runner.cache_plan.window_seats
    return min(fits, seats) if seats else fits


def iter_capacity(model: str | None = None, kv_cache_dtypes: tuple[str, ...] = ("auto", "fp8_e4m3"),
                  kv_cache_memory: int | str = "256MiB", contexts: tuple[int, ...] = (4096,),
                  output_len: int = 128, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                  block_size: int = 16, dtype: str = "auto", repeats: int = 1, text_path: str | None = None,
                  progress: Progress | None = None, log: Callable[[str], None] = print,
                  kv_recent_window: int | None = None, kv_recent_window_dtype: str = "auto",
                  device: str = "auto", load_format: str = "auto", kv_scales: str = "static") -> Iterator[dict]:
    """Yield one row per (context, cache variant). The variants of one context take turns, `repeats` rounds of
    fresh prompts, so drift on a shared machine hits them alike; a row reports the median round.
    load_format "dummy": random weights from the model's config.json alone, or a shape shipped with fp8kv
    by name (e.g. llama-3.1-8b: capacity at a real model's size without its checkpoint).
    kv_scales: the FP8 caches' scales, static, dynamic (a scale per token and KV head, in the budget too) or both."""
    dtypes = check_kv_cache_dtypes(list(kv_cache_dtypes), device)
    variants = cache_variants(dtypes, kv_scales)
    contexts = _check_contexts(contexts, output_len)
    if max_num_seqs < 1 or repeats < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} and repeats={repeats} must both be >= 1")
    engines = build_engines(model, variants, log, dtype=dtype, device=device, kv_cache_memory=kv_cache_memory,
                            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            block_size=block_size, max_model_len=max(contexts), kv_recent_window=kv_recent_window,
                            kv_recent_window_dtype=kv_recent_window_dtype, load_format=load_format)
    source = PromptSource(next(iter(engines.values())).tokenizer, text_path)
    for engine in engines.values():
        batches = warmup_batches(engine.runner, contexts, max_num_seqs)
        _warm_up(engine, source, min(contexts) - output_len, batches)
    info = machine.describe()
    for context in contexts:
        results: dict[str, list[BatchResult]] = {dt: [] for dt in engines}
        for r in range(repeats):
            for variant, engine in engines.items():
                batch = min(fitting_batch(engine.runner, context), max_num_seqs)
                if batch:
                    label = f"{variant} context {context} batch {batch}"
                    done, total = r * batch * output_len, repeats * batch * output_len
                    on_tokens = (lambda n, lb=label, d=done, t=total: progress(lb, d + n, t)) if progress else None
                    prompts = source.take(batch, context - output_len)
                    results[variant].append(run_batch(engine, prompts, output_len, on_tokens))
                if r == repeats - 1:
                    yield _row(engine, variant, context, output_len, max_num_seqs, kv_cache_memory,
                               results[variant], info)


def warmup_batches(runner, contexts: list[int], max_num_seqs: int) -> list[int]:
    """How many short prompts each warm-up batch runs: two on a CPU; on a GPU every batch size the timed runs
    will decode at, so that those decode steps' CUDA graphs are captured before the clock starts (at 8B
    scale a capture takes about a second, which would count against the batch it first runs)."""
    if runner.device.type != "cuda":
        return [2]
    return sorted({min(fitting_batch(runner, c), max_num_seqs) for c in contexts} - {0}) or [2]


def _warm_up(engine, source: PromptSource, input_len: int, batches: list[int]) -> None:
    # Short prompts run every code path (prefill, decode, cache writes) before anything is timed. Short enough
    # that a batch's prompts all prefill in one step: the next is then a decode of the whole batch.
    runner = engine.runner
    for batch in batches:
        length = max(1, min(input_len, WARMUP_INPUT_LEN, runner.config.max_num_batched_tokens // batch))
        count = min(batch, fitting_batch(runner, length + WARMUP_OUTPUT_LEN))
        if count:
            run_batch(engine, source.take(count, length), WARMUP_OUTPUT_LEN)


def _row(engine, label: str, context: int, output_len: int, max_num_seqs: int, kv_cache_memory: int | str,
         results: list[BatchResult], info: dict) -> dict:
    runner = engine.runner
    fits = fitting_batch(runner, context)
    row = {"engine": "fp8kv", "kv_cache_dtype": runner.config.kv_cache_dtype, "variant": label,
           "kv_cache_memory": kv_cache_memory, **cache_figures(runner), **token_figures(runner.kv_spec), "num_blocks": runner.num_blocks, "block_size": runner.block_size, "context": context,
           "input_len": context - output_len, "output_len": output_len, "max_batch": fits,
           "batch": min(fits, max_num_seqs), "limited_by": "memory" if fits <= max_num_seqs else "max_num_seqs",
           "machine": info}
    if not results:
        row.update(verified=False, note=f"one sequence of {context} tokens does not fit "
                                        f"{runner.capacity_tokens} tokens of cache")
        return row
    median = median_result(results)
    preemptions = sum(r.num_preemptions for r in results)
    row.update(step_figures(median))  # its peak_running is replaced by the lowest round's below
    row.update(median.rates(), input_tokens=median.input_tokens, output_tokens=median.output_tokens,
               num_preemptions=preemptions, peak_running=min(r.peak_running for r in results),
               repeats=len(results), elapsed_all_s=[r.elapsed_s for r in results], verified=preemptions == 0)
    return row


def add_ratios(rows: list[dict]) -> list[dict]:
    """Add each row's output tokens/s over the `auto` row's at the same context, when there is one."""
    auto = {r["context"]: r for r in rows if r["kv_cache_dtype"] == "auto" and "output_tokens_per_s" in r}
    for r in rows:
        base = auto.get(r["context"])
        if base is not None and "output_tokens_per_s" in r:
            r["vs_auto"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
    return rows


def _check_contexts(contexts: tuple[int, ...], output_len: int) -> list[int]:
    contexts = sorted(set(contexts))
    if not contexts:
        raise ValueError("give at least one context length")
    if output_len < 1:
        raise ValueError(f"output_len={output_len} must be >= 1")
    short = [c for c in contexts if c <= output_len]
    if short:
        raise ValueError(f"context {short[0]} leaves no room for a prompt before {output_len} output tokens; "
                         f"use a context above --output-len")
    return contexts
