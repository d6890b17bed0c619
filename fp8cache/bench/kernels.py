"""`fp8kv bench kernels`: decode attention over paged caches of each dtype, against torch SDPA.

All cases of one shape are set up first and then take turns, one timed call each per round (the median round
is reported), with a read of the machine's memory as one more turn: a clock or memory speed that drifts
during the run (shared VMs, turbo) then slows every case and the bandwidth figure alike, and ratios
between rows, and each row's share of the bandwidth, hold. Each timed call follows SETTLE_MS of untimed
calls of a twin of its case (same shape, its own cache, so that a cache that fits in the CPU's last-level
cache is not timed warm): on a shared AMD EPYC VM the first FP8 calls after a memory-bound case ran up to
20% slower (fp8_e4m3 at 8 x 8192 right after the float32 case, five calls in a row, medians of ten: 4.91,
4.51, 4.18, 4.16, 4.08 ms; the bfloat16 cache's calls flat at 9.2 ms), so without it a row measured the
case before it as much as its own kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp8cache import ops
from fp8cache.bench import machine
from fp8cache.kvcache import dynamic_scales, formats
from fp8cache.kvcache.layout import allocate_kv_cache

DEFAULT_SHAPES = ((1, 512), (1, 16384), (8, 2048), (8, 8192), (32, 512), (32, 4096))
GPU_CALLS_PER_TIMING = 50
SETTLE_MS = 20.0


@dataclass(frozen=True)
class KernelCase:
    impl: str  # "fp8kv" or "torch_sdpa"
    kv_cache_dtype: str
    dtype: torch.dtype  # query / model dtype; the auto cache uses it too
    kv_scales: str = "static"  # FP8 caches: "dynamic" reads (or writes) a scale per token and KV head
    op: str = "attention"  # or "cache_write": reshape_and_cache of batch x context tokens


KV_SCALES_CHOICES = ("static", "dynamic", "both")


def default_cases(device: torch.device | str = "cpu", kv_scales: str = "static",
                  cache_write: bool = False) -> list[KernelCase]:
    """Every FP8 format and the auto caches; the peer is torch SDPA over a dense cache: float32 on a CPU (its
    fast path there), bfloat16 on a GPU (flash attention over twice the bytes of FP8: the fair peer).
    kv_scales: the FP8 caches' scales, "both" measures each FP8 case with static and with dynamic scales side by
    side; cache_write: each FP8 case's cache write too."""
    if kv_scales not in KV_SCALES_CHOICES:
        raise ValueError(f"kv_scales={kv_scales!r}; valid: {', '.join(KV_SCALES_CHOICES)}")
    bf16, f32 = torch.bfloat16, torch.float32
    peer = f32 if torch.device(device).type == "cpu" else bf16
    kinds = ("static", "dynamic") if kv_scales == "both" else (kv_scales,)
    fp8 = [KernelCase("fp8kv", name, bf16, kind) for name in ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz")
           for kind in kinds]
    writes = [KernelCase("fp8kv", c.kv_cache_dtype, c.dtype, c.kv_scales, "cache_write") for c in fp8] \
        if cache_write else []
    return fp8 + [KernelCase("fp8kv", "auto", bf16), KernelCase("fp8kv", "auto", f32),
                  KernelCase("torch_sdpa", "auto", peer)] + writes


# Normal values drawn per cache; the rest of the cache repeats them. What a kernel reads costs the same whatever
# the values, and drawing each one took two thirds of a CPU run (14 s of randn for the 8x8192 shapes' caches).
FILL_DRAWN = 1 << 22


def _fill_cache(cache: torch.Tensor, kv_cache_dtype: str, gen: torch.Generator) -> None:
    # Drawn where the generator lives: on a GPU its own (a host draw of a GiB cache, then the copy, took
    # seconds per case); on the CPU the shared host generator, as before.
    flat = cache.view(-1)
    values = torch.randn(min(flat.numel(), FILL_DRAWN), generator=gen, device=gen.device).to(cache.device)
    fmt = formats.get_format(kv_cache_dtype)
    codes = values.to(cache.dtype) if fmt is None else values.to(fmt.torch_dtype).view(torch.uint8)
    for start in range(0, flat.numel(), codes.numel()):
        part = flat[start:start + codes.numel()]
        part.copy_(codes[:part.numel()])


@dataclass
class PagedCall:
    """One decode attention call over a paged cache as the bench times it (scripts/profile_attention.py profiles
    the same call): random K/V in the case's format, blocks in a random order, every sequence `context` long."""
    out: torch.Tensor
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: torch.Tensor
    num_kv_heads: int
    block_size: int
    context: int
    code: int
    scale_caches: tuple[torch.Tensor, ...] = ()  # dynamic scales: (k_scale_cache, v_scale_cache)

    def run(self, impl=ops) -> None:
        impl.paged_attention(self.out, self.query, self.key_cache, self.value_cache, self.num_kv_heads,
                             self.query.shape[-1] ** -0.5, self.block_tables, self.seq_lens, self.block_size,
                             self.context, None, self.code, self.scale, self.scale,
                             *((0, 0.0, None, *self.scale_caches) if self.scale_caches else ()))


def _scale_caches(case: KernelCase, num_blocks: int, block_size: int, num_kv_heads: int, gen: torch.Generator,
                  device: torch.device) -> tuple[torch.Tensor, ...]:
    """Dynamic scale caches of random scales near 1 (what they cost to read does not depend on them)."""
    if case.kv_scales != "dynamic" or formats.get_format(case.kv_cache_dtype) is None:
        return ()
    caches = dynamic_scales.allocate_scale_caches(num_blocks, block_size, num_kv_heads, device)
    for cache in caches:
        cache.copy_(torch.rand(cache.shape, generator=gen, device=gen.device) + 0.5)
    return caches


def paged_call(case: KernelCase, batch: int, context: int, num_heads: int, num_kv_heads: int, head_size: int,
               block_size: int, gen: torch.Generator, device: torch.device) -> PagedCall:
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    key_cache, value_cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size,
                                                   case.kv_cache_dtype, case.dtype, device)
    _fill_cache(key_cache, case.kv_cache_dtype, gen)
    _fill_cache(value_cache, case.kv_cache_dtype, gen)
    block_tables = torch.randperm(num_blocks, generator=gen, device=gen.device).to(torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq).to(device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, num_heads, head_size, generator=gen, device=gen.device).to(device, case.dtype)
    scale = torch.ones(1, dtype=torch.float32, device=device)
    code = ops.format_code(case.kv_cache_dtype, key_cache.device)  # resolved once, as the engine does
    return PagedCall(torch.empty_like(query), query, key_cache, value_cache, block_tables, seq_lens, scale,
                     num_kv_heads, block_size, context, code,
                     _scale_caches(case, num_blocks, block_size, num_kv_heads, gen, device))


def _paged_case(case: KernelCase, batch: int, context: int, num_heads: int, num_kv_heads: int,
                head_size: int, block_size: int, gen: torch.Generator, device: torch.device):
    call = paged_call(case, batch, context, num_heads, num_kv_heads, head_size, block_size, gen, device)
    kv_bytes = 2 * batch * context * num_kv_heads * head_size * call.key_cache.element_size()
    if call.scale_caches:
        kv_bytes += 2 * batch * context * num_kv_heads * 2  # a bfloat16 scale per token and head, K and V
    return call.run, kv_bytes


def _write_case(case: KernelCase, batch: int, context: int, num_kv_heads: int, head_size: int, block_size: int,
                gen: torch.Generator, device: torch.device):
    """reshape_and_cache of batch x context tokens (a prefill's worth) into slots in a random order; the bytes
    are the K/V read in the model dtype."""
    tokens = batch * context
    num_blocks = -(-tokens // block_size)
    caches = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, case.kv_cache_dtype, case.dtype,
                               device)
    scale_caches = _scale_caches(case, num_blocks, block_size, num_kv_heads, gen, device)
    key, value = (torch.randn(tokens, num_kv_heads, head_size, generator=gen, device=gen.device).to(device, case.dtype)
                  for _ in range(2))
    slots = torch.randperm(tokens, generator=gen, device=gen.device).to(device)
    code, ones = ops.format_code(case.kv_cache_dtype, device), torch.ones(1, device=device)

    def run() -> None:
        ops.reshape_and_cache(key, value, *caches, slots, code, ones, ones, *scale_caches)

    return run, 2 * key.numel() * key.element_size()


def _sdpa_case(case: KernelCase, batch: int, context: int, num_heads: int, num_kv_heads: int,
               head_size: int, gen: torch.Generator, device: torch.device):
    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=case.dtype, device=gen.device).to(device)

    query, key = draw(batch, num_heads, 1, head_size), draw(batch, num_kv_heads, context, head_size)
    value = draw(batch, num_kv_heads, context, head_size)

    def run() -> None:
        F.scaled_dot_product_attention(query, key, value, enable_gqa=True)

    return run, 2 * key.numel() * key.element_size()


def _case(case: KernelCase, batch: int, context: int, num_heads: int, num_kv_heads: int, head_size: int,
          block_size: int, gen: torch.Generator, device: torch.device):
    if case.impl == "torch_sdpa":
        return _sdpa_case(case, batch, context, num_heads, num_kv_heads, head_size, gen, device)
    if case.op == "cache_write":
        return _write_case(case, batch, context, num_kv_heads, head_size, block_size, gen, device)
    return _paged_case(case, batch, context, num_heads, num_kv_heads, head_size, block_size, gen, device)


def _calls_per_timing(device: torch.device) -> int:
    """One call on a CPU (and on a stand-in device in tests), a CUDA graph of GPU_CALLS_PER_TIMING on a GPU."""
    return GPU_CALLS_PER_TIMING if device.type == "cuda" else 1


def _timed_calls(run, device: torch.device):
    """What one timing runs: _calls_per_timing(device) calls. On the CPU: one call. On a GPU: back-to-back
    calls captured once in a CUDA graph (as a GPU decode loop runs them), replayed, then a wait for the
    device: one call is too short for a host clock, and without the graph the host's launch work would be
    timed too."""
    calls = _calls_per_timing(device)
    if calls == 1:
        return run
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()  # lazy initialisation stays out of the graph
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()

    def replay() -> None:
        graph.replay()
        machine.synchronize(device)

    # The graph holds no reference to the case's tensors (caches, query, output): the closure must, or they
    # are freed and the replays read and write freed memory (an illegal memory access, seen on an H100).
    replay.case = run
    return replay


def parse_heads(text: str) -> list[tuple[int, int, int]]:
    """"32/8/128,9/3/64" -> [(32, 8, 128), (9, 3, 64)]: attention heads / KV heads / head size, each a model's
    attention shape; a ValueError names what is wrong."""
    heads = []
    for item in text.split(","):
        parts = item.strip().split("/")
        try:
            num_heads, num_kv_heads, head_size = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"{item.strip()!r} is not HEADS/KV_HEADS/HEAD_SIZE, e.g. 32/8/128") from None
        if min(num_heads, num_kv_heads, head_size) < 1 or num_heads % num_kv_heads:
            raise ValueError(f"{item.strip()!r}: give positive sizes, KV heads dividing the heads (e.g. 32/8/128)")
        heads.append((num_heads, num_kv_heads, head_size))
    return heads


def run_kernel_bench(shapes=DEFAULT_SHAPES, cases=None, num_heads: int = 32, num_kv_heads: int = 8,
                     head_size: int = 128, block_size: int = 16, repeats: int = 5, settle_ms: float = SETTLE_MS,
                     on_row=None, device: torch.device | str = "cpu",
                     heads: list[tuple[int, int, int]] | None = None) -> list[dict]:
    """One row per (heads, case, batch, context); each row carries the read bandwidth measured in this run.
    settle_ms: untimed calls of a twin of each case before its timed call (0: none, and no twins).
    heads: several models' (heads, KV heads, head size) measured in one run, each at every shape (default:
    num_heads, num_kv_heads, head_size)."""
    device = torch.device(device)
    cases = cases or default_cases(device)
    calls = _calls_per_timing(device)
    ops.load(device)
    cpu_path = torch.ops.fp8kv.cpu_isa() if device.type == "cpu" else None  # avx512, avx2 or scalar
    read, read_bytes = machine.read_probe(device=device)
    gen = torch.Generator(device if device.type == "cuda" else "cpu").manual_seed(0)
    rows = []
    models = heads or [(num_heads, num_kv_heads, head_size)]
    for (n_heads, n_kv_heads, head_dim), (batch, context) in ((h, s) for h in models for s in shapes):
        shape = (batch, context, n_heads, n_kv_heads, head_dim, block_size, gen, device)
        runs = [_case(case, *shape) for case in cases]
        twins = [_timed_calls(_case(case, *shape)[0], device) for case in cases] + [read] if settle_ms > 0 else None
        *times, read_ms = machine.interleaved_ms([_timed_calls(run, device) for run, _ in runs] + [read],
                                                 repeats=repeats, settle_ms=settle_ms, settle_fns=twins)
        read_bw = read_bytes / read_ms / 1e6
        for case, (_, kv_bytes), ms in zip(cases, runs, (t / calls for t in times)):
            row = {"impl": case.impl, "op": case.op, "kv_cache_dtype": case.kv_cache_dtype, "kv_scales": case.kv_scales,
                   "dtype": str(case.dtype).removeprefix("torch."), "batch": batch, "context": context,
                   "num_heads": n_heads, "num_kv_heads": n_kv_heads, "head_size": head_dim,
                   "block_size": block_size, "device": device.type, "ms": ms, "kv_gbps": kv_bytes / ms / 1e6,
                   "read_bw_gbps": read_bw, "bandwidth_probe": machine.probe_kind(device), "cpu_path": cpu_path}
            rows.append(row)
            if on_row:
                on_row(row)
        del runs, twins
    return rows
