"""Output tokens/s with one of fp8kv's FP8KV_* switches off and at its default, in one process, taking turns.

Two engines on the same model (SWITCH=0 for the first, SWITCH unset for the second), fresh WikiText-2
prompts each round, so that a shared machine's drift hits both alike. Switches read when an engine starts:
FP8KV_FUSED_LAYERS, FP8KV_DECODE_LAYER, FP8KV_LINEAR_F32, FP8KV_PACK_LINEARS, FP8KV_MERGE_PROJECTIONS
(not FP8KV_TUNE_MALLOC: malloc is tuned once per process, so it would apply to both engines).
Usage: python scripts/ab_switch.py SWITCH [MODEL] [--dtype float32] [--rounds 3] [--prompts 16]
       [--input-len 256] [--output-len 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from fp8cache import LLM, SamplingParams
from fp8cache.bench.prompts import PromptSource


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("switch", help="environment variable, e.g. FP8KV_FUSED_LAYERS")
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = {"model": args.model, "kv_cache_dtype": "fp8_e4m3", "dtype": args.dtype, "kv_cache_memory": "1GiB",
                "log": lambda *a: None}
    os.environ[args.switch] = "0"
    engines = {"off": LLM(**settings)}
    del os.environ[args.switch]
    engines["default"] = LLM(**settings)
    source = PromptSource(engines["off"].get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate([{"prompt_token_ids": p} for p in source.take(2, args.input_len)],
                     SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            prompts = [{"prompt_token_ids": p} for p in source.take(args.prompts, args.input_len)]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            rates[name].append(args.prompts * args.output_len / (time.perf_counter() - start))
    for name, values in rates.items():
        print(f"{name}: " + ", ".join(f"{v:.1f}" for v in values) + " output tok/s")
    print(f"default / {args.switch}=0: " + ", ".join(f"{b / a:.3f}" for a, b in zip(rates["off"], rates["default"])))


if __name__ == "__main__":
    main()
