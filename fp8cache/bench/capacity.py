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

import gc
from collections.abc import Callable, Iterator

from fp8cache.bench import machine
from fp8cache.bench.prompts import PromptSource
from fp8cache.bench.throughput import WARMUP_OUTPUT_LEN, Progress, check_kv_cache_dtypes, run_batch

WARMUP_INPUT_LEN = 64


def max_batch(num_blocks: int, block_size: int, context: int) -> int:
    """Sequences of `context` tokens that fit in the cache together."""
    return num_blocks // -(-context // block_size)


def iter_capacity(model: str | None = None, kv_cache_dtypes: tuple[str, ...] = ("auto", "fp8_e4m3"),
                  kv_cache_memory: int | str = "256MiB", contexts: tuple[int, ...] = (4096,),
                  output_len: int = 128, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                  block_size: int = 16, dtype: str = "auto", text_path: str | None = None,
                  progress: Progress | None = None, log: Callable[[str], None] = print) -> Iterator[dict]:
    """Yield one row per (dtype, context) as soon as it is measured."""
    from fp8cache.engine.llm import LLM

    dtypes = check_kv_cache_dtypes(list(kv_cache_dtypes))
    contexts = _check_contexts(contexts, output_len)
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
    info = machine.describe()
    for kv_dtype in dtypes:
        llm = LLM(model=model, dtype=dtype, kv_cache_dtype=kv_dtype, kv_cache_memory=kv_cache_memory,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                  block_size=block_size, max_model_len=max(contexts), log=log)
        runner = llm.llm_engine.runner
        source = PromptSource(llm.get_tokenizer(), text_path)
        _warm_up(llm, source, min(contexts) - output_len)
        for context in contexts:
            yield _measure(llm, source, kv_dtype, context, output_len, max_num_seqs, kv_cache_memory, info,
                           progress)
        del llm, runner
        gc.collect()


def _warm_up(llm, source: PromptSource, input_len: int) -> None:
    # Two short prompts run every code path (prefill, decode, cache writes) before anything is timed.
    runner = llm.llm_engine.runner
    length = min(input_len, WARMUP_INPUT_LEN)
    count = min(2, max_batch(runner.num_blocks, runner.block_size, length + WARMUP_OUTPUT_LEN))
    if count:
        run_batch(llm, source.take(count, length), WARMUP_OUTPUT_LEN)


def _measure(llm, source: PromptSource, kv_dtype: str, context: int, output_len: int, max_num_seqs: int,
             kv_cache_memory: int | str, info: dict, progress: Progress | None) -> dict:
    runner = llm.llm_engine.runner
    fits = max_batch(runner.num_blocks, runner.block_size, context)
    batch = min(fits, max_num_seqs)
    input_len = context - output_len
    row = {"engine": "fp8kv", "kv_cache_dtype": kv_dtype, "kv_cache_memory": kv_cache_memory,
           "capacity_tokens": runner.capacity_tokens, "bytes_per_token": runner.bytes_per_token,
           "num_blocks": runner.num_blocks, "block_size": runner.block_size, "context": context,
           "input_len": input_len, "output_len": output_len, "max_batch": fits, "batch": batch,
           "limited_by": "memory" if fits <= max_num_seqs else "max_num_seqs", "machine": info}
    if batch == 0:
        row.update(verified=False, note=f"one sequence of {context} tokens does not fit "
                                        f"{runner.capacity_tokens} tokens of cache")
        return row
    label = f"{kv_dtype} context {context} batch {batch}"
    total = batch * output_len
    on_tokens = (lambda n: progress(label, n, total)) if progress else None
    result = run_batch(llm, source.take(batch, input_len), output_len, on_tokens)
    row.update(result.rates(), input_tokens=result.input_tokens, output_tokens=result.output_tokens,
               num_preemptions=result.num_preemptions, peak_running=result.peak_running,
               verified=result.num_preemptions == 0)
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
