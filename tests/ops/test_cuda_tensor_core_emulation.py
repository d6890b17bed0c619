"""The tensor-core decode kernel (csrc/cuda/attention_tc_kernels.cuh) run on the host and held to the reference.

csrc/cuda/host_emulation.cpp stands in for the tensor core (an m16n8k16 mma computed from the fragment layouts
PTX defines, its operands exchanged between the emulated lanes) and for cp.async (the bytes land at once, the
tail zero-filled), so these tests check what the kernel's logic decides: the token and dim permutations of the
fragments, the pipeline's stages, the FP8 decoding (the shared bit moves and the sm_89+ conversion), the split
halves of float32 queries, zero-filled tails and the plan. What only a GPU shows (speed, the real mma's
rounding) is for tests/ops/test_ops_cuda.py and scripts/gpu_check.sh. The compiled kernels' registers against the
plan's shared memory are in tests/ops/test_compile_check.py, from the compile check's resource report.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from test_cuda_host_emulation import (
    DTYPE_CODES,
    EMULATION_VARIANTS,
    FORMAT_CODES,
    TOLERANCES,
    _filled_cache,
    _scales,
    emu_paged_attention,
    load_emulation,
)

from fp8cache.ops import reference

pytestmark = pytest.mark.slow

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
FP8 = ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz"]
NAN_CODES = {"fp8_e4m3": 0x7F, "fp8_e5m2": 0x7E, "fp8_e4m3fnuz": 0x80}
TC_WARPS = 4  # kTcWarps in csrc/cuda/launch.h
TC_TILE = 32  # kTcTile


@pytest.fixture(scope="module", params=EMULATION_VARIANTS)
def emu(request: pytest.FixtureRequest) -> ctypes.CDLL:
    return load_emulation(request.param)


def tc_plan(emu: ctypes.CDLL, dtype: torch.dtype, kv_cache_dtype: str, head_size: int, group: int,
            num_seqs: int = 1, num_kv_heads: int = 1, max_seq_len: int = 1, stages: int = 0) -> dict[str, int]:
    out = (ctypes.c_int * 5)()
    emu.fp8kv_emu_tc_plan(DTYPE_CODES[dtype], FORMAT_CODES[kv_cache_dtype], head_size, group, num_seqs,
                          num_kv_heads, max_seq_len, stages, out)
    return dict(zip(("stages", "smem_bytes", "blocks_per_sm", "splits", "stage_bytes"), out))


def _matrix() -> list[tuple]:
    """Every head size 32-256 in steps of 8 that a paged cache can have (FP8 keys come in 16-byte chunks of 16
    dims; 16-bit caches take multiples of 8 up to 128 on tensor cores), GQA groups 1-8, 12 and 16, block sizes
    8/16/32, every query dtype, one split (1 SM), the plan's splits (132) and the most splits (100k SMs)."""
    groups = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]
    cases = []
    for i, head_size in enumerate(range(32, 257, 8)):
        if head_size % 16 == 0:
            kv, dtype = FP8[i % 3], (f32, bf16, f16)[(i // 2) % 3]
            if dtype == f32 and head_size > 128:
                dtype = f16  # float32 queries over 128 dims run on CUDA cores (test_plan_refuses_...)
        elif head_size <= 128:
            kv, dtype = "auto", (bf16, f16)[i % 2]
        else:
            continue  # a 16-bit cache over 128 dims not a multiple of 16: test_plan_refuses_what_the_kernel_cannot_take
        group = groups[i % len(groups)]
        num_kv_heads = 1 + i % 2
        lens = (1 + (i * 37) % 50, 130 + 29 * i)
        cases.append((kv, dtype, head_size, group, num_kv_heads, (8, 16, 32)[i % 3], lens, (1, 132, 100_000)[i % 3],
                      i % 4 == 1, i % 5 == 2))
    return cases


def _disjoint_tables(lens: tuple[int, ...], block_size: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Block tables whose sequences share no block (so a slot past one sequence's end is no other's)."""
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    width = max(1, max((s + block_size - 1) // block_size for s in lens))
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for s, length in enumerate(lens):
        n = (length + block_size - 1) // block_size
        table[s, :n] = ids[used:used + n]
        used += n
    return table


def _attend(emu, kv, dtype, head_size, group, num_kv_heads, block_size, lens, sm_count, per_head, alibi,
            seed: int = 0, edit_cache=None):
    gen = torch.Generator().manual_seed(seed + head_size)
    num_heads = group * num_kv_heads
    num_blocks = sum((s + block_size - 1) // block_size for s in lens) + 2
    k_scale, v_scale = _scales(per_head, num_kv_heads, gen)
    cache_dtype = dtype if kv == "auto" else f32
    key_cache, value_cache = _filled_cache(num_blocks, block_size, num_kv_heads, head_size, kv, cache_dtype,
                                           k_scale, v_scale, gen)
    tables = _disjoint_tables(lens, block_size, num_blocks, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if edit_cache is not None:
        edit_cache(key_cache, value_cache, tables, seq_lens)
    query = torch.randn(len(lens), num_heads, head_size, generator=gen).to(dtype)
    slopes = torch.rand(num_heads, generator=gen) * 0.1 if alibi else None
    scale = head_size**-0.5
    expected = torch.empty(query.shape, dtype=f32)
    reference.paged_attention(expected, query, key_cache, value_cache, num_kv_heads, scale, tables, seq_lens,
                              block_size, max(lens), slopes, kv, k_scale, v_scale)
    out = torch.full(query.shape, float("nan"), dtype=dtype)
    previous = emu.fp8kv_emu_set_sm_count(sm_count)
    try:
        error = emu_paged_attention(emu, out, query, key_cache, value_cache, tables, seq_lens, max(lens), slopes,
                                    kv, k_scale, v_scale, scale)
    finally:
        emu.fp8kv_emu_set_sm_count(previous)
    return error, out, expected


@pytest.mark.parametrize("case", _matrix(), ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-d{c[2]}-g{c[3]}x{c[4]}-bs{c[5]}-sm{c[7]}")
def test_tensor_core_kernel_matches_reference(emu, case):
    kv, dtype, head_size, group, num_kv_heads, lens = case[0], case[1], case[2], case[3], case[4], case[6]
    plan = tc_plan(emu, dtype, kv, head_size, group, len(lens), num_kv_heads, max(lens))
    assert plan["stages"] >= 2, f"the tensor-core kernel should take {case}"

    error, out, expected = _attend(emu, *case)

    assert error == 0
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def _poison(kv: str, where: str, nan_code: int):
    """An edit of the caches: a NaN in one position the sequences attend to (`where`: key or value), and NaN in
    every slot past each sequence's end in its last block, which the kernel must not read."""

    def edit(key_cache, value_cache, tables, seq_lens):
        x = key_cache.shape[-1]
        block_size = value_cache.shape[-1]
        nan = nan_code if kv != "auto" else float("nan")
        for s, length in enumerate(seq_lens.tolist()):
            last = tables[s, (length - 1) // block_size]
            for offset in range(length % block_size or block_size, block_size):
                key_cache[last, :, :, offset, :] = nan
                value_cache[last, :, :, offset] = nan
        if where in ("key", "value"):
            block, offset, dim = tables[0, 0], 5, 3
            if where == "key":
                key_cache[block, 0, dim // x, offset, dim % x] = nan
            else:
                value_cache[block, 0, dim, offset] = nan

    return edit


@pytest.mark.parametrize("kv,where", [(kv, where) for kv in FP8 for where in ("key", "value")] +
                         [("auto", "value"), ("auto", "stale only")])
def test_nan_comes_out_where_the_reference_puts_it_and_stale_slots_stay_unread(emu, kv, where):
    dtype = bf16 if kv == "auto" else f32
    edit = _poison(kv, where, NAN_CODES.get(kv, 0))
    # Lengths 45 and 70 end inside a group of 8 positions: the zero-filled tail of a lane's value copy.
    error, out, expected = _attend(emu, kv, dtype, 64, 4, 2, 16, (45, 70), 132, False, False, edit_cache=edit)

    assert error == 0
    assert torch.isnan(expected).any() == (where != "stale only")
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    ok = ~torch.isnan(expected)
    torch.testing.assert_close(out.float()[ok], expected[ok], rtol=TOLERANCES[dtype], atol=TOLERANCES[dtype])


@pytest.mark.parametrize("tensor_cores", [1, 0], ids=["tensor-cores", "cuda-cores"])
def test_both_kernels_give_the_same_attention(emu, tensor_cores):
    """The CUDA-core kernel stays for HIP, float32 caches and what the tensor-core one cannot take."""
    previous = emu.fp8kv_emu_set_tensor_cores(tensor_cores)
    try:
        error, out, expected = _attend(emu, "fp8_e4m3", bf16, 128, 4, 2, 16, (300, 17), 132, True, True)
    finally:
        emu.fp8kv_emu_set_tensor_cores(previous)
    assert error == 0
    torch.testing.assert_close(out.float(), expected, rtol=TOLERANCES[bf16], atol=TOLERANCES[bf16])


def test_plan_refuses_what_the_kernel_cannot_take(emu):
    assert tc_plan(emu, f32, "auto", 128, 4)["stages"] == 0  # float32 caches: CUDA cores
    assert tc_plan(emu, bf16, "auto", 136, 4)["stages"] == 0  # 256-dim class of a 16-bit cache: no shared memory
    assert tc_plan(emu, f32, "fp8_e4m3", 256, 4)["stages"] == 0  # split float32 halves at 256 dims: registers
    assert tc_plan(emu, bf16, "fp8_e4m3", 264, 4)["stages"] == 0  # past kMaxHeadSize
    assert tc_plan(emu, bf16, "fp8_e4m3", 256, 4)["stages"] >= 2
    assert tc_plan(emu, bf16, "auto", 40, 4)["stages"] >= 2


# The shapes issue 37 measures decode at: 32/8 heads d128 (Llama-3.1-8B), 28/4 (Qwen2-7B), 9/3 d64 (SmolLM2).
DECODE_SHAPES = [(32, 8, 128, 8, 8192), (32, 8, 128, 32, 4096), (32, 8, 128, 1, 16384), (28, 4, 128, 8, 8192),
                 (9, 3, 64, 8, 8192), (9, 3, 64, 64, 300)]


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: f"{s[0]}/{s[1]}-d{s[2]}-{s[3]}x{s[4]}")
def test_plan_keeps_24_kb_in_flight_on_every_sm(emu, shape):
    """docs/design.md section 9: at least ~24 KB an SM in flight (an H100/H200's bandwidth times its latency),
    and enough thread blocks to give every SM its share."""
    num_heads, num_kv_heads, head_size, num_seqs, length = shape
    plan = tc_plan(emu, bf16, "fp8_e4m3", head_size, num_heads // num_kv_heads, num_seqs, num_kv_heads, length)
    in_flight = plan["blocks_per_sm"] * TC_WARPS * (plan["stages"] - 1) * plan["stage_bytes"]
    assert in_flight >= 24 * 1024, plan
    blocks = num_seqs * num_kv_heads * plan["splits"]
    assert blocks >= min(132, num_seqs * num_kv_heads * (length // 256)), plan
    assert plan["smem_bytes"] * plan["blocks_per_sm"] <= 228 * 1024


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "auto"])
@pytest.mark.parametrize("head_size,group,dtype", [(128, 4, bf16), (128, 7, bf16), (64, 3, bf16), (64, 3, f32),
                                                   (128, 16, bf16), (128, 4, f32), (256, 8, bf16), (96, 2, f16)])
def test_plan_prefers_blocks_an_sm_to_pipeline_depth(emu, kv, head_size, group, dtype):
    """More warps an SM beat a deeper pipeline (on an H200, 2 stages and 3 blocks took 58 us at 32/8 d128 FP8
    8 x 8192 where 3 stages and 2 blocks took 65): the plan has the most blocks any depth allows, and of those
    depths the deepest."""
    if kv == "auto" and (head_size > 128 or dtype == f32):
        return  # CUDA cores: a float32 cache, a 16-bit cache's 256-dim class (test_plan_refuses_what_...)
    chosen = tc_plan(emu, dtype, kv, head_size, group)
    # A depth that does not fit the shared memory is answered with the plan's own choice.
    forced = {s: tc_plan(emu, dtype, kv, head_size, group, stages=s) for s in (2, 3, 4)}
    fits = [p for s, p in forced.items() if p["stages"] == s]
    assert chosen["stages"] >= 2 and chosen in fits
    most = max(p["blocks_per_sm"] for p in fits)
    assert chosen["blocks_per_sm"] == most
    assert chosen["stages"] == max(p["stages"] for p in fits if p["blocks_per_sm"] == most)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(32, 8, 128), (9, 3, 64), (28, 4, 128)])
def test_a_short_single_sequence_is_spread_a_tile_a_warp(emu, num_heads, num_kv_heads, head_size):
    """A lone sequence of 512 positions is latency-bound: on an H200 4 splits of a tile a warp took 13.8 us
    where 1 or 2 splits took 15.4 and 16.1 (32/8 d128 FP8). A long one is split so every SM gets work, and
    not so far that the reduce kernel's merge of many splits costs more than it saves (FP8KV_TC_SPLITS sweeps at
    9/3 d64, 1 x 16384: 16 splits 19.5 us, 32 15.6, 64 17.2)."""
    group = num_heads // num_kv_heads
    short = tc_plan(emu, bf16, "fp8_e4m3", head_size, group, 1, num_kv_heads, 512)
    assert short["splits"] * TC_WARPS * TC_TILE >= 512
    long = tc_plan(emu, bf16, "fp8_e4m3", head_size, group, 1, num_kv_heads, 16384)
    assert 16 < long["splits"] < 64


# ---- sliding windows, soft-capping, sinks (both GPU kernels) --------------------------------------------

FEATURE_CASES = [
    # kv, dtype, head_size, group, num_kv_heads, block_size, lens, sliding_window, softcap, sinks
    ("fp8_e4m3", bf16, 64, 4, 2, 16, (15, 16, 17, 40, 300), 16, 0.0, False),
    ("fp8_e5m2", f32, 128, 1, 2, 8, (9, 33, 64, 65, 700), 33, 2.0, True),
    ("fp8_e4m3fnuz", f16, 128, 7, 1, 32, (1, 100, 1500), 200, 0.0, True),
    ("auto", bf16, 64, 3, 2, 16, (30, 513), 0, 1.5, False),
    ("fp8_e4m3", f32, 96, 8, 1, 16, (2, 47, 2100), 0, 0.0, True),
    ("fp8_e4m3", bf16, 128, 16, 1, 8, (31, 32, 95, 96, 97), 32, 3.0, True),
]


def _attend_features(emu, kv, dtype, head_size, group, num_kv_heads, block_size, lens, window, softcap, sinks,
                     sm_count, poison_before_window=False):
    gen = torch.Generator().manual_seed(head_size + len(lens))
    num_heads = group * num_kv_heads
    num_blocks = sum((s + block_size - 1) // block_size for s in lens) + 2
    k_scale, v_scale = _scales(True, num_kv_heads, gen)
    key_cache, value_cache = _filled_cache(num_blocks, block_size, num_kv_heads, head_size, kv,
                                           dtype if kv == "auto" else f32, k_scale, v_scale, gen)
    tables = _disjoint_tables(lens, block_size, num_blocks, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), num_heads, head_size, generator=gen).to(dtype)
    sink_values = torch.randn(num_heads, generator=gen) * 2.0 if sinks else None
    scale = head_size**-0.5
    expected = torch.empty(query.shape, dtype=f32)
    reference.paged_attention(expected, query, key_cache, value_cache, num_kv_heads, scale, tables, seq_lens,
                              block_size, max(lens), None, kv, k_scale, v_scale, window, softcap, sink_values)
    if poison_before_window:  # NaN before each window in its first block, -1 for the blocks wholly before it
        nan = NAN_CODES.get(kv, float("nan"))
        for s, length in enumerate(lens):
            first = max(0, length - window)
            for pos in range(first // block_size * block_size, first):
                block = tables[s, pos // block_size]
                key_cache[block, :, :, pos % block_size, :] = nan
                value_cache[block, :, :, pos % block_size] = nan
            tables[s, : first // block_size] = -1
    out = torch.full(query.shape, float("nan"), dtype=dtype)
    previous = emu.fp8kv_emu_set_sm_count(sm_count)
    try:
        error = emu_paged_attention(emu, out, query, key_cache, value_cache, tables, seq_lens, max(lens), None, kv,
                                    k_scale, v_scale, scale, window, softcap, sink_values)
    finally:
        emu.fp8kv_emu_set_sm_count(previous)
    return error, out, expected


@pytest.mark.parametrize("tensor_cores", [1, 0], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: f"{c[0]}-d{c[2]}-g{c[3]}-bs{c[5]}-w{c[7]}-cap{c[8]:g}"
                                                             + ("-sinks" if c[9] else ""))
@pytest.mark.parametrize("sm_count", [1, 100_000])
def test_sliding_window_softcap_and_sinks_match_reference(emu, tensor_cores, case, sm_count):
    dtype, head_size = case[1], case[2]
    if not tensor_cores and head_size % 16:
        pytest.skip("the CUDA-core kernel takes multiples of 16")
    previous = emu.fp8kv_emu_set_tensor_cores(tensor_cores)
    try:
        error, out, expected = _attend_features(emu, *case, sm_count)
    finally:
        emu.fp8kv_emu_set_tensor_cores(previous)
    assert error == 0
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("tensor_cores", [1, 0], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize("kv,block_size", [("fp8_e4m3", 8), ("fp8_e4m3fnuz", 16), ("auto", 32)])
def test_nothing_before_a_sliding_window_is_read(emu, tensor_cores, kv, block_size):
    """The GPU kernels never look up a block id before the window (-1 there would be reported) and zero what
    they copied of the window's first block before its first position (NaN there stays out of the output)."""
    previous = emu.fp8kv_emu_set_tensor_cores(tensor_cores)
    try:
        error, out, expected = _attend_features(emu, kv, bf16, 64, 4, 2, block_size, (45, 77, 130), 21, 0.0, False,
                                                132, poison_before_window=True)
    finally:
        emu.fp8kv_emu_set_tensor_cores(previous)
    assert error == 0
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), expected, rtol=TOLERANCES[bf16], atol=TOLERANCES[bf16])
