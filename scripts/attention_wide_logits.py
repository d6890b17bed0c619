"""Time CPU decode attention on ordinary data and on data whose logits lie hundreds apart.

With wide logits most softmax weights, and their products with V, fall below float32's normal range; x86
cores take a microcode assist per such operation unless denormals are flushed, which the kernel does.
Usage: python scripts/attention_wide_logits.py [--threads 2] [--batch 16] [--context 320]
"""

from __future__ import annotations

import argparse
import time

import torch

from fp8cache import ops
from fp8cache.kvcache.layout import allocate_kv_cache


def time_call(fn, repeats: int = 200) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads, head_size, block_size = 9, 3, 64, 16  # the default model's attention
    blocks_per_seq = -(-args.context // block_size)
    num_blocks = args.batch * blocks_per_seq
    key_cache, value_cache = allocate_kv_cache(num_blocks, block_size, kv_heads, head_size,
                                                   args.kv_cache_dtype, torch.float32)
    tokens = torch.randn(2, num_blocks * block_size, kv_heads, head_size)
    ops.reshape_and_cache(tokens[0], tokens[1], key_cache, value_cache, torch.randperm(num_blocks * block_size),
                          args.kv_cache_dtype, torch.ones(1), torch.ones(1))
    table = torch.randperm(num_blocks).to(torch.int32).view(args.batch, blocks_per_seq)
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    query = torch.randn(args.batch, heads, head_size)
    out = torch.empty_like(query)
    for name, q in (("ordinary logits", query), ("logits hundreds apart", query * 400.0)):
        us = time_call(lambda q=q: ops.paged_attention(
            out, q, key_cache, value_cache, kv_heads, head_size ** -0.5, table, seq_lens, block_size,
            args.context, None, args.kv_cache_dtype, torch.ones(1), torch.ones(1)))
        print(f"{name}: {us:.1f} us per call ({args.batch} x {args.context}, {args.kv_cache_dtype}, "
              f"{args.threads} threads)")


if __name__ == "__main__":
    main()
