"""Prefill time and output tokens/s with CPU prefill rows through the decode op and with the SDPA paths.

One engine, one process: fp8cache.model.attention.ROW_PREFILL is read when a step's prefill groups are
built, so the two paths take turns on fresh WikiText-2 prompts and a shared machine's drift hits both alike.
Usage: python scripts/ab_row_prefill.py [MODEL] [--dtype float32] [--rounds 3] [--window 32]
       [--prompts 16] [--input-len 256] [--output-len 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fp8cache import LLM, SamplingParams
from fp8cache.bench.prompts import PromptSource
from fp8cache.model import attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    parser.add_argument("--window", type=int, default=32, help="kv_recent_window (0: plain FP8)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory="1GiB",
              kv_recent_window=args.window)
    runner = llm.llm_engine.runner
    prefill_seconds = {False: 0.0, True: 0.0}
    rates: dict[bool, list[float]] = {False: [], True: []}
    current = [True]
    execute = runner.execute

    def timed_execute(batch, *a, **k):
        start = time.perf_counter()
        result = execute(batch, *a, **k)
        if any(s.query_len > 1 for s in batch.seqs):
            prefill_seconds[current[0]] += time.perf_counter() - start
        return result

    runner.execute = timed_execute
    prompts = PromptSource(llm.get_tokenizer())
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    for round_index in range(args.rounds + 1):  # round 0 warms both paths up
        for rows in (False, True):
            attention.ROW_PREFILL, current[0] = rows, rows
            batch = [{"prompt_token_ids": p} for p in prompts.take(args.prompts, args.input_len)]
            before, start = prefill_seconds[rows], time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            if round_index == 0:
                prefill_seconds[rows] = before
            else:
                rates[rows].append(args.prompts * args.output_len / (time.perf_counter() - start))
    for rows in (False, True):
        name = "rows through the decode op" if rows else "SDPA over the read-back"
        print(f"{name:28s} prefill {prefill_seconds[rows] / args.rounds:.2f} s/run, output tok/s "
              f"{' '.join(f'{r:.0f}' for r in rates[rows])} (median {statistics.median(rates[rows]):.0f})")


if __name__ == "__main__":
    main()
