"""Time CPU FP8 decode attention for bfloat16 queries with and without AVX512-BF16 dot products.

Both paths run in one process and take turns (FP8KV_CPU_BF16_DOT is read on every call), on the issue's
shape by default (batch 8 x 8192, 32 query / 8 KV heads, head size 128, block size 16), with the caches
evicted before each call, and, for scale, our kernel on a bfloat16 cache.
Usage: python scripts/ab_bf16_dot.py [--threads 2] [--batch 8] [--context 8192] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from fp8cache import ops


def build_case(kv_cache_dtype: str, batch: int, context: int, heads: int, kv_heads: int, head_size: int,
               block_size: int):
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    key_cache, value_cache = ops.allocate_kv_cache(num_blocks, block_size, kv_heads, head_size, kv_cache_dtype,
                                                   torch.bfloat16)
    for cache in (key_cache, value_cache):  # codes / values straight from a generator: no quantization pass
        if cache.dtype == torch.uint8:
            cache.copy_(torch.randint(0, 120, cache.shape, dtype=torch.uint8))
        else:
            cache.normal_()
    table = torch.randperm(num_blocks).to(torch.int32).view(batch, blocks_per_seq)
    query = torch.randn(batch, heads, head_size, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    one = torch.ones(1)

    def call() -> None:
        ops.paged_attention(out, query, key_cache, value_cache, kv_heads, head_size ** -0.5, table, seq_lens,
                            block_size, context, None, kv_cache_dtype, one, one)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=7, help="calls per path per round (median taken)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = {"batch": args.batch, "context": args.context, "heads": 32, "kv_heads": 8, "head_size": 128,
             "block_size": 16}
    fp8 = build_case("fp8_e4m3", **shape)
    bf16_cache = build_case("auto", **shape)
    evict = torch.empty(64 << 20, dtype=torch.uint8)  # larger than the last-level cache

    def median_ms(call, switch: str) -> float:
        os.environ["FP8KV_CPU_BF16_DOT"] = switch
        times = []
        for _ in range(args.calls):
            evict.add_(1)
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    median_ms(fp8, "1"), median_ms(fp8, "0"), median_ms(bf16_cache, "1")  # warm-up: build, page in
    for r in range(args.rounds):
        dot, fma, auto = median_ms(fp8, "1"), median_ms(fp8, "0"), median_ms(bf16_cache, "1")
        print(f"round {r}: fp8_e4m3 bf16 dot {dot:.2f} ms, float FMA {fma:.2f} ms ({fma / dot:.2f}x); "
              f"auto bfloat16 cache {auto:.2f} ms (ratio {dot / auto:.3f} vs {fma / auto:.3f})", flush=True)


if __name__ == "__main__":
    main()
