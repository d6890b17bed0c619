"""A few paged_attention calls on random FP8 (or 16-bit) caches, for a profiler to catch one of them:

    ncu -k regex:tc_attention --launch-skip 2 --launch-count 1 \
        python scripts/profile_attention.py --batch 8 --context 8192 --heads 32/8/128

(scripts/gpu_check.sh's `stalls` step). Blocks are in a random order, as an engine's cache holds them. --check
compares the last call with the pure-torch reference (fp8cache.ops.reference) and prints the largest error as a
share of the output's scale: the call profiled computes the right thing.
"""

from __future__ import annotations

import argparse

import torch

from fp8cache import ops
from fp8cache.kvcache import formats
from fp8cache.kvcache.layout import allocate_kv_cache
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
    heads, kv_heads, head_size = (int(x) for x in args.heads.split("/"))
    device, bs = args.device, args.block_size
    impl = ops.load(device)
    torch.manual_seed(0)
    blocks_per_seq = -(-args.context // bs)
    num_blocks = args.batch * blocks_per_seq
    key_cache, value_cache = allocate_kv_cache(num_blocks, bs, kv_heads, head_size, args.kv_cache_dtype,
                                               torch.bfloat16, device)
    fp8 = formats.get_format(args.kv_cache_dtype, formats.backend_of(device))
    for cache in (key_cache, value_cache):  # values within every format's range, as a scaled cache holds
        values = torch.randn(cache.shape, device=device)
        cache.copy_(values.to(fp8.torch_dtype).view(torch.uint8) if fp8 else values.to(cache.dtype))
    table = torch.randperm(num_blocks, device=device).to(torch.int32).view(args.batch, blocks_per_seq)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32, device=device)
    query = torch.randn(args.batch, heads, head_size, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    one = torch.ones(1, device=device)
    code = ops.format_code(args.kv_cache_dtype, key_cache.device)

    def attend(impl, out: torch.Tensor) -> None:
        impl.paged_attention(out, query, key_cache, value_cache, kv_heads, head_size ** -0.5, table, lens, bs,
                             args.context, None, code, one, one)

    for _ in range(args.calls):
        attend(impl, out)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    line = f"{args.calls} calls, {args.batch} x {args.context}, {args.heads}, {args.kv_cache_dtype}"
    if args.check:
        want = torch.empty_like(out)
        attend(reference, want)
        error = (out.float() - want.float()).abs().max() / want.float().abs().max()
        line += f"; max error {error.item():.2e} of the output scale"
    print(line)


if __name__ == "__main__":
    main()
