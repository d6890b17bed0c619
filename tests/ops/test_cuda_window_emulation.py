"""The GPU kernel of paged_attention_window, run on the host and held to the pure-torch reference.

The kernel bodies of csrc/cuda/attention_kernels.cuh run through csrc/cuda/host_emulation.cpp (see
tests/ops/test_cuda_host_emulation.py for how, and what this cannot check). Each case is a batch whose
sequences are shorter than, as long as and longer than the window, with window starts at both ends of the
allowed range and in between, so ring runs wrap and start off block boundaries. The ring holds K/V drawn
independently of the paged cache's, so reading a position from the wrong cache shows; every slot the
kernel must not read (ring slots outside the window, paged slots past the sequence) holds NaN, and ring
blocks that hold no position of the window are -1 in the window block table. With window_sinks S > 0 the ring's
first S seats hold positions [0, S) (the attention sinks), which the kernel reads from there instead of the paged
cache: the cases cover S beside every window start, sequences shorter than S, sliding windows that begin
before, inside and past the sinks, and both paged kernels (tensor-core and CUDA-core).
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

import pytest
import torch
from test_cuda_host_emulation import (
    DTYPE_CODES,
    EMULATION_VARIANTS,
    ERROR_BLOCK,
    ERROR_SEQ_LEN,
    FORMAT_CODES,
    TOLERANCES,
    _p,
    load_emulation,
)

from fp8cache.ops import reference

# Compiles the kernels for the host first (two variants, ~10 s each at -O0), then runs each GPU thread as a fiber.
pytestmark = pytest.mark.slow

ERROR_WINDOW_START, ERROR_WINDOW_BLOCK = 8, 16

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(scope="module", params=EMULATION_VARIANTS)
def emu(request: pytest.FixtureRequest) -> ctypes.CDLL:
    return load_emulation(request.param)


@dataclass
class WindowCase:
    kv_cache_dtype: str
    window_dtype: torch.dtype
    window_size: int
    head_size: int
    block_size: int
    num_heads: int
    num_kv_heads: int
    dtype: torch.dtype  # query and out
    seq_lens: tuple[int, ...] = ()  # default: around the window size
    starts: tuple[str, ...] = ("low", "high", "mid")  # cycled over the sequences, see window_start()
    per_head_scale: bool = False
    alibi: bool = False
    dynamic: bool = False  # dynamic scales for the paged cache, its K and V of varied magnitudes across tokens
    window_sinks: int = 0  # the ring's first seats: positions [0, window_sinks)

    def lens(self) -> tuple[int, ...]:
        w = self.window_size
        return self.seq_lens or (1, max(1, w - 1), w, w + 1, 3 * w + 5)

    def id(self) -> str:
        def name(dtype: torch.dtype) -> str:
            return str(dtype).removeprefix("torch.")

        return "-".join([self.kv_cache_dtype, f"win-{name(self.window_dtype)}", f"W{self.window_size}",
                         f"d{self.head_size}", f"bs{self.block_size}", f"h{self.num_heads}/{self.num_kv_heads}",
                         f"q-{name(self.dtype)}", "x".join(map(str, self.lens()))]
                        + [flag for flag, on in (("perhead", self.per_head_scale), ("alibi", self.alibi),
                                                 ("dynamic", self.dynamic)) if on]
                        + ([f"sinks{self.window_sinks}"] if self.window_sinks else []))


def window_start(kind: str, seq_len: int, window_size: int) -> int:
    low, high = max(0, seq_len - window_size), seq_len
    value = {"low": low, "high": high, "mid": (low + high) // 2, "low+1": low + 1, "high-1": high - 1}[kind]
    return min(high, max(low, value))


CASES = [
    WindowCase("fp8_e4m3", bf16, 32, 128, 16, 8, 2, bf16),  # GQA
    WindowCase("fp8_e5m2", f32, 7, 64, 8, 4, 4, f32, per_head_scale=True),  # ring of a block and a bit
    WindowCase("fp8_e4m3fnuz", f16, 33, 80, 32, 6, 1, f16, alibi=True),  # MQA, ring in one partial block
    WindowCase("fp8_e4m3", f16, 16, 112, 32, 4, 2, f32, starts=("low+1", "high-1", "mid"), per_head_scale=True,
               alibi=True),  # window dtype != query dtype
    WindowCase("fp8_e5m2", bf16, 40, 256, 8, 2, 1, f16, starts=("mid", "low")),
    WindowCase("auto", f32, 1, 96, 8, 4, 2, f32, alibi=True),
    WindowCase("auto", bf16, 24, 64, 16, 4, 4, bf16, starts=("high-1", "mid", "low"), per_head_scale=True),
    # long sequences: several paged partitions merged with the window; an empty sequence
    WindowCase("fp8_e4m3", bf16, 64, 128, 16, 4, 2, f32, seq_lens=(1300, 513, 64, 0), per_head_scale=True),
    WindowCase("fp8_e4m3fnuz", f16, 33, 64, 32, 2, 1, f16, seq_lens=(1100, 1030, 33),
               starts=("mid", "high", "low"), alibi=True),
    # a window longer than a partition: two window partitions
    WindowCase("fp8_e5m2", f32, 700, 64, 32, 2, 1, bf16, seq_lens=(1401, 650, 700, 1300),
               starts=("low", "mid", "low+1", "high-1"), alibi=True),
    # dynamic scales (the paged cache's own, per token and head; the ring has none)
    WindowCase("fp8_e4m3", bf16, 32, 128, 16, 8, 2, bf16, dynamic=True),
    WindowCase("fp8_e5m2", f16, 16, 64, 32, 4, 1, f32, seq_lens=(700, 40, 16), alibi=True, dynamic=True),
    WindowCase("fp8_e4m3fnuz", f32, 24, 64, 16, 4, 2, f32, seq_lens=(300, 24), dynamic=True),
]


# window_sinks S > 0: the default lengths (1, w - 1, w, w + 1, 3w + 5) put sequences shorter than S, window
# starts at or below S and far past it in each case.
SINK_CASES = [
    WindowCase("fp8_e4m3", bf16, 32, 128, 16, 8, 2, bf16, window_sinks=1),  # GQA
    WindowCase("fp8_e5m2", f32, 7, 64, 8, 4, 4, f32, per_head_scale=True, window_sinks=3),  # seats 8, 9: block 2
    WindowCase("fp8_e4m3fnuz", f16, 33, 80, 32, 6, 1, f16, alibi=True, window_sinks=3),  # ALiBi by true position
    WindowCase("auto", bf16, 24, 64, 16, 4, 4, bf16, starts=("high-1", "mid", "low"), window_sinks=1),
    WindowCase("auto", f32, 13, 96, 8, 4, 2, f32, alibi=True, window_sinks=3),  # 16 seats: two whole blocks
    # more sinks than a tile and a block: the ring's run of sinks and recent positions spans tiles
    WindowCase("fp8_e4m3", f16, 16, 64, 8, 4, 2, f16, seq_lens=(5, 19, 40, 90), starts=("low", "mid", "low+1"),
               window_sinks=19),
    # long sequences: several paged splits merged with the ring's
    WindowCase("fp8_e4m3", bf16, 64, 128, 16, 4, 2, f32, seq_lens=(1300, 513, 64, 0, 2), per_head_scale=True,
               window_sinks=3),
    # a window longer than a split: the sinks join the ring's first of several splits
    WindowCase("fp8_e5m2", f32, 300, 64, 32, 2, 1, bf16, seq_lens=(701, 302, 3), starts=("low", "low+1", "mid"),
               alibi=True, window_sinks=3),
    # dynamic scales (the paged cache's own; the ring, sinks included, has none)
    WindowCase("fp8_e4m3", bf16, 32, 128, 16, 8, 2, bf16, dynamic=True, window_sinks=3),
    WindowCase("fp8_e5m2", f16, 16, 64, 32, 4, 1, f32, seq_lens=(700, 40, 16, 2), alibi=True, dynamic=True,
               window_sinks=1),
    WindowCase("fp8_e4m3fnuz", f32, 24, 64, 16, 4, 2, f32, seq_lens=(300, 24, 26), dynamic=True, window_sinks=3),
]


def _nan_filled(cache: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    if cache.dtype == torch.uint8:
        return cache.fill_(0x80 if kv_cache_dtype == "fp8_e4m3fnuz" else 0x7F)  # the format's NaN code
    return cache.fill_(float("nan"))


def build(case: WindowCase, seed: int = 0) -> dict:
    """Caches, tables and queries of a batch: paged positions [0, seq_len), ring [seq_len - window, seq_len) and
    the sinks [0, window_sinks)."""
    gen = torch.Generator().manual_seed(seed)
    bs, hk, d, w, sinks = case.block_size, case.num_kv_heads, case.head_size, case.window_size, case.window_sinks
    lens = case.lens()
    blocks_per_seq = [(n + bs - 1) // bs for n in lens]
    ring_blocks = (sinks + w + bs - 1) // bs
    num_blocks, num_window_blocks = sum(blocks_per_seq) + 3, len(lens) * ring_blocks + 2
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    window_ids = torch.randperm(num_window_blocks, generator=gen).to(torch.int32)
    table = torch.full((len(lens), max(1, *blocks_per_seq) + 1), -1, dtype=torch.int32)  # a column never read
    window_table = torch.full((len(lens), ring_blocks + 1), -1, dtype=torch.int32)
    n_scales = hk if case.per_head_scale else 1
    k_scale = torch.rand(n_scales, generator=gen) * 0.5 + 0.05
    v_scale = torch.rand(n_scales, generator=gen) * 0.5 + 0.05
    caches = [_nan_filled(c, case.kv_cache_dtype) for c in reference.allocate_kv_cache(
        num_blocks, bs, hk, d, case.kv_cache_dtype, case.dtype)]
    window_caches = [_nan_filled(c, "auto") for c in reference.allocate_kv_cache(
        num_window_blocks, bs, hk, d, "auto", case.window_dtype)]
    # NaN where no token was written: a scale the kernel must not read
    scale_caches = [torch.full((num_blocks, hk, bs), float("nan"), dtype=torch.bfloat16) for _ in range(2)] \
        if case.dynamic else [None, None]
    used = 0
    for s, length in enumerate(lens):
        table[s, :blocks_per_seq[s]] = ids[used:used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        positions = torch.arange(length)
        slots = table[s].long()[positions // bs] * bs + positions % bs
        key = torch.randn(length, hk, d, generator=gen) * 0.5
        value = torch.randn(length, hk, d, generator=gen)
        if case.dynamic:
            key *= torch.logspace(-2, 1, length)[torch.randperm(length, generator=gen), None, None]
            value *= torch.logspace(-3, 3, length)[torch.randperm(length, generator=gen), None, None]
        reference.reshape_and_cache(key.to(case.dtype), value.to(case.dtype), *caches, slots, case.kv_cache_dtype,
                                    k_scale, v_scale, *scale_caches)
        # The ring: the sinks and the newest window; only blocks holding one of their positions get an id.
        ring = torch.cat([torch.arange(min(sinks, max(0, length - w))), torch.arange(max(0, length - w), length)])
        seats = torch.where(ring < sinks, ring, sinks + ring % w)
        held = torch.unique(seats // bs)
        window_table[s, held] = window_ids[s * ring_blocks + held]
        key = (torch.randn(ring.numel(), hk, d, generator=gen) * 0.5).to(case.window_dtype)
        value = torch.randn(ring.numel(), hk, d, generator=gen).to(case.window_dtype)
        reference.reshape_and_cache(key, value, *window_caches,
                                    reference.window_slots(window_table[s], ring, w, bs, sinks), "auto", k_scale,
                                    v_scale)
    starts = [window_start(case.starts[s % len(case.starts)], n, w) for s, n in enumerate(lens)]
    return {"query": torch.randn(len(lens), case.num_heads, d, generator=gen).to(case.dtype),
            "caches": caches, "window_caches": window_caches, "table": table, "window_table": window_table,
            "seq_lens": torch.tensor(lens, dtype=torch.int32), "window_starts": torch.tensor(starts, dtype=torch.int32),
            "k_scale": k_scale, "v_scale": v_scale, "k_scale_cache": scale_caches[0], "v_scale_cache": scale_caches[1],
            "alibi": torch.rand(case.num_heads, generator=gen) * 0.1 if case.alibi else None}


def emu_attention(emu: ctypes.CDLL, case: WindowCase, b: dict, max_seq_len: int | None = None
                  ) -> tuple[int, torch.Tensor]:
    """The emulated kernel's output (query dtype) and error bits."""
    out = torch.full(b["query"].shape, 7.0, dtype=case.dtype)  # every row must be written
    (key_cache, value_cache), (window_key_cache, window_value_cache) = b["caches"], b["window_caches"]
    table, window_table = b["table"], b["window_table"]
    error = emu.fp8kv_emu_paged_attention_window(
        DTYPE_CODES[case.dtype], FORMAT_CODES[case.kv_cache_dtype], DTYPE_CODES[case.window_dtype], _p(out),
        _p(b["query"]), _p(key_cache), _p(value_cache), _p(window_key_cache), _p(window_value_cache), _p(table),
        _p(window_table), _p(b["seq_lens"]), _p(b["window_starts"]), _p(b["alibi"]), _p(b["k_scale"]),
        _p(b["v_scale"]), len(case.lens()), case.num_heads, case.num_kv_heads, case.head_size,
        key_cache.shape[0], window_key_cache.shape[0], case.block_size, table.shape[1], window_table.shape[1],
        case.window_size, max(case.lens()) if max_seq_len is None else max_seq_len,
        ctypes.c_float(case.head_size**-0.5), int(b["k_scale"].numel() > 1), int(b["v_scale"].numel() > 1),
        b.get("sliding_window", 0), ctypes.c_float(b.get("logit_softcap", 0.0)), _p(b.get("sinks")),
        _p(b.get("k_scale_cache")), _p(b.get("v_scale_cache")), case.window_sinks)
    return error, out


def reference_attention(case: WindowCase, b: dict) -> torch.Tensor:
    expected = torch.empty(b["query"].shape, dtype=torch.float32)
    reference.paged_attention_window(
        expected, b["query"], *b["caches"], *b["window_caches"], case.num_kv_heads, case.head_size**-0.5,
        b["table"], b["window_table"], b["seq_lens"], b["window_starts"], case.window_size, case.block_size,
        max(case.lens()), b["alibi"], case.kv_cache_dtype, b["k_scale"], b["v_scale"],
        sliding_window=b.get("sliding_window", 0), logit_softcap=b.get("logit_softcap", 0.0), sinks=b.get("sinks"),
        k_scale_cache=b["k_scale_cache"],
        v_scale_cache=b["v_scale_cache"], window_sinks=case.window_sinks)
    return expected


@pytest.fixture(params=[1, 0], ids=["tensor-cores", "cuda-cores"])
def paged_kernel(emu, request):
    """The paged cache's kernel: the tensor-core one (FP8 and 16-bit caches on sm_80+) or the CUDA-core one."""
    previous = emu.fp8kv_emu_set_tensor_cores(request.param)
    yield request.param
    emu.fp8kv_emu_set_tensor_cores(previous)


def assert_matches_reference(emu, case: WindowCase, b: dict) -> None:
    expected = reference_attention(case, b)

    error, out = emu_attention(emu, case, b)

    assert error == 0
    assert not expected.isnan().any()
    tol = TOLERANCES[case.dtype]
    # dynamic cases' outputs span their values' 1e-3 .. 1e3: each row relative to its size
    size = expected.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) if case.dynamic else 1.0
    torch.testing.assert_close(out.float() / size, expected / size, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES, ids=WindowCase.id)
def test_window_attention_matches_reference(emu, case):
    assert_matches_reference(emu, case, build(case))


def test_every_window_start_of_one_sequence(emu):
    """All window starts a 45-token sequence allows with a ring of 20 (ring runs of every phase)."""
    case = WindowCase("fp8_e4m3", bf16, 20, 64, 8, 2, 1, f32, seq_lens=(45,) * 21)
    b = build(case)
    b["window_starts"] = torch.arange(25, 46, dtype=torch.int32)

    error, out = emu_attention(emu, case, b)

    assert error == 0
    torch.testing.assert_close(out, reference_attention(case, b), rtol=2e-5, atol=2e-5)


SMALL = WindowCase("fp8_e4m3", bf16, 16, 64, 16, 4, 2, f32, seq_lens=(40, 10))


@pytest.mark.parametrize("seq, start", [(0, 23), (0, 41), (1, -1), (1, 11)])
def test_window_start_out_of_range_is_reported(emu, seq, start):
    b = build(SMALL)
    b["window_starts"][seq] = start

    error, out = emu_attention(emu, SMALL, b)

    assert error == ERROR_WINDOW_START
    assert torch.isfinite(out).all()  # clamped into range: nothing outside the caches was read


@pytest.mark.parametrize("bad_id", [-1, 10_000])
def test_out_of_range_window_block_id_is_reported(emu, bad_id):
    b = build(SMALL)
    b["window_starts"][0] = 24  # positions 24..39 fill the ring's only block
    b["window_table"][0, 0] = bad_id
    assert emu_attention(emu, SMALL, b)[0] == ERROR_WINDOW_BLOCK


def test_window_block_ids_outside_the_window_are_not_read(emu):
    case = WindowCase("fp8_e4m3", bf16, 64, 64, 16, 4, 2, f32, seq_lens=(40, 100))
    b = build(case)
    b["window_starts"][1] = 80  # ring slots 16..35: blocks 1 and 2 of 4
    b["window_table"][1, 0] = b["window_table"][1, 3] = 10_000

    error, out = emu_attention(emu, case, b)

    assert error == 0
    torch.testing.assert_close(out, reference_attention(case, b), rtol=2e-5, atol=2e-5)


def test_paged_block_ids_are_checked_below_the_window_start_only(emu):
    case = WindowCase("fp8_e4m3", bf16, 32, 64, 16, 4, 2, f32, seq_lens=(40, 10))
    b = build(case)
    b["table"][0, 1] = 10_000  # positions 16..31
    b["window_starts"][0] = 30
    assert emu_attention(emu, case, b)[0] == ERROR_BLOCK

    b["window_starts"][0] = 16  # positions 16..39 from the window
    error, out = emu_attention(emu, case, b)

    assert error == 0
    torch.testing.assert_close(out, reference_attention(case, b), rtol=2e-5, atol=2e-5)


def test_length_past_max_seq_len_is_reported(emu):
    b = build(SMALL)
    assert emu_attention(emu, SMALL, b, max_seq_len=39)[0] == ERROR_SEQ_LEN


@pytest.mark.parametrize("case", SINK_CASES, ids=WindowCase.id)
def test_window_sinks_match_reference(emu, paged_kernel, case):
    assert_matches_reference(emu, case, build(case))


# Lengths 40 (window starts 24, 40, 32), 20 (start 4) and 3 (shorter than the sinks), window 16, S = 3: a sliding
# window of 38 begins inside the sinks (position 2), of 30 between the sinks and the window start, of 12 past the
# window start of the first sequence; of 2 past everything but the newest positions.
@pytest.mark.parametrize("sliding_window", [38, 30, 12, 2])
def test_sliding_window_before_inside_and_past_the_sinks(emu, paged_kernel, sliding_window):
    case = WindowCase("fp8_e4m3", bf16, 16, 64, 8, 4, 2, f32, seq_lens=(40, 40, 40, 20, 3), alibi=True,
                      window_sinks=3)
    b = build(case)
    b["sliding_window"] = sliding_window
    assert_matches_reference(emu, case, b)


def test_window_sinks_with_soft_capping_and_sink_logits(emu, paged_kernel):
    """The model's own features beside the ring's sinks: soft-capped logits, gpt-oss sink logits (one more logit
    per head in the denominator, merged by the reduce), a sliding window beginning inside the ring's sinks."""
    case = WindowCase("fp8_e5m2", bf16, 16, 64, 16, 6, 2, f32, seq_lens=(300, 40, 20, 2), alibi=True,
                      dynamic=True, window_sinks=3)
    b = build(case)
    b["sliding_window"], b["logit_softcap"] = 299, 2.0
    b["sinks"] = torch.randn(case.num_heads, generator=torch.Generator().manual_seed(1))
    assert_matches_reference(emu, case, b)


def test_every_window_start_beside_the_sinks(emu):
    """All window starts a 45-token sequence allows with a ring of 3 sinks and 20 recent seats (ring runs of every
    phase after the sinks), and starts of shorter sequences at, below and just past the sinks' end."""
    case = WindowCase("fp8_e4m3", bf16, 20, 64, 8, 2, 1, f32, seq_lens=(45,) * 21 + (21, 22, 23, 22),
                      window_sinks=3)
    b = build(case)
    b["window_starts"] = torch.cat([torch.arange(25, 46), torch.tensor([1, 2, 3, 5])]).to(torch.int32)
    assert_matches_reference(emu, case, b)


def test_sink_seats_are_read_and_their_block_ids_checked(emu):
    """With no recent positions (window start = length) the ring still gives the sinks, from its first block, whose
    id is checked; its second block (recent seats 16-18 only) is then not read."""
    case = WindowCase("fp8_e4m3", bf16, 16, 64, 16, 4, 2, f32, seq_lens=(40, 10), window_sinks=3)
    b = build(case)
    b["window_starts"][0] = 40
    b["window_table"][0, 1] = 10_000
    assert_matches_reference(emu, case, b)

    b["window_table"][0, 0] = 10_000
    assert emu_attention(emu, case, b)[0] == ERROR_WINDOW_BLOCK


def test_negative_window_sinks_are_refused(emu):
    b = build(SMALL)
    assert emu_attention(emu, dataclasses.replace(SMALL, window_sinks=-1), b)[0] == -1
