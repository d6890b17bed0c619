"""A few paged_attention calls on random FP8 (or 16-bit) caches, for a profiler to catch one of them:

    ncu -k regex:tc_attention --launch-skip 2 --launch-count 1 \
        python scripts/profile_attention.py --batch 8 --context 8192 --heads 32/8/128

(scripts/gpu_check.sh's `stalls` step). The call is the one `fp8kv bench kernels` times
(fp8cache.bench.kernels.paged_call: blocks in a random order, as an engine's cache holds them). --check compares
the last call with the pure-torch reference (fp8cache.ops.reference) and prints the largest error as a share of the
output's scale: the call profiled computes the right thing.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from fp8cache import ops
from fp8cache.bench import kernels
from fp8cache.ops import reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--heads", default="32/8/128", help="query heads / KV heads / head size")
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    (heads, kv_heads, head_size), = kernels.parse_heads(args.heads)
    device = torch.device(args.device)
    ops.load(device)
    gen = torch.Generator(device if device.type == "cuda" else "cpu").manual_seed(0)
    case = kernels.KernelCase("fp8kv", args.kv_cache_dtype, torch.bfloat16)
    call = kernels.paged_call(case, args.batch, args.context, heads, kv_heads, head_size, args.block_size, gen,
                              device)
    for _ in range(args.calls):
        call.run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    line = f"{args.calls} calls, {args.batch} x {args.context}, {args.heads}, {args.kv_cache_dtype}"
    if args.check:
        want = dataclasses.replace(call, out=torch.empty_like(call.out))
        want.run(reference)
        error = (call.out.float() - want.out.float()).abs().max() / want.out.float().abs().max()
        line += f"; max error {error.item():.2e} of the output scale"
    print(line)


if __name__ == "__main__":
    main()
