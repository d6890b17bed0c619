"""Offline generation with and without the glibc malloc tuning, in fresh processes taking turns.

The tuning is process-wide and cannot be undone, so each round starts two interpreters, one with
FP8KV_TUNE_MALLOC=0. Each generates for 16 prompts x 256 tokens of random ids, 128 new tokens each, on the
default model (fp8_e4m3 cache), and prints prefill and decode time.
Usage: python scripts/ab_malloc_tuning.py [--rounds 3] [--dtype bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ONE_RUN = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
from fp8cache import LLM, SamplingParams
llm = LLM(dtype=sys.argv[1], kv_cache_dtype="fp8_e4m3")
runner = llm.llm_engine.runner
spent = {"prefill": 0.0, "decode": 0.0}
execute = runner.execute
def timed(batch):
    start = time.perf_counter()
    try:
        return execute(batch)
    finally:
        spent["decode" if batch.is_decode_only else "prefill"] += time.perf_counter() - start
runner.execute = timed
g = torch.Generator().manual_seed(int(sys.argv[3]))
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (256,), generator=g).tolist()} for _ in range(16)]
start = time.perf_counter()
llm.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True, temperature=0))
total = time.perf_counter() - start
print(f"{16 * 128 / total:.1f} output tok/s, prefill {spent['prefill']:.2f} s, decode {spent['decode']:.2f} s")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    for r in range(args.rounds):
        for label, switch in (("tuned", "1"), ("glibc defaults", "0")):
            env = {**os.environ, "FP8KV_TUNE_MALLOC": switch}
            out = subprocess.run([sys.executable, "-c", ONE_RUN, args.dtype, str(args.threads), str(r)],
                                 capture_output=True, text=True, env=env, check=True)
            print(f"round {r} {label}: {out.stdout.strip().splitlines()[-1]}", flush=True)


if __name__ == "__main__":
    main()
