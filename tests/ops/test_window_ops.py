"""CPU paged_attention_window against the pure-torch reference (fp8cache.ops.reference).

Each case is a batch whose sequences are shorter than, as long as and longer than the window, with window
starts at both ends of the allowed range and in between (so ring runs wrap and start off block
boundaries). The window ring holds K/V drawn independently of the paged cache's, so reading a position
from the wrong cache cannot hide inside the FP8 error, and every slot no token was written to holds NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from numerics import attention_error
from test_ops_cpu import tolerance

from fp8cache.ops import format_code
from fp8cache.ops import reference as ref


@pytest.fixture(scope="module")
def ops():
    from fp8cache.ops import load

    return load()


@dataclass
class WindowCase:
    kv: str
    window_dtype: torch.dtype
    window_size: int
    head_size: int = 128
    block_size: int = 16
    heads: int = 8
    kv_heads: int = 2
    dtype: torch.dtype = torch.float32  # query and out
    seq_lens: tuple[int, ...] = ()  # default: around the window size, see lens()
    starts: tuple[str, ...] = ("low", "high", "mid")  # cycled over the sequences, see window_start()
    per_head_scale: bool = False
    alibi: bool = False
    strided_query: bool = False
    window_sinks: int = 0  # the ring's extra seats for positions [0, window_sinks) (tests/ops/test_window_sinks.py)
    seed: int = 0

    def lens(self) -> tuple[int, ...]:
        w = self.window_size
        return self.seq_lens or (1, max(1, w - 1), w, w + 1, 3 * w + 5, 100)

    def id(self) -> str:
        bits = [self.kv, "win-" + str(self.window_dtype).removeprefix("torch."), f"W{self.window_size}",
                f"d{self.head_size}", f"bs{self.block_size}", f"h{self.heads}/{self.kv_heads}",
                "q-" + str(self.dtype).removeprefix("torch."), "x".join(map(str, self.lens())),
                "-".join(self.starts)] + ([f"S{self.window_sinks}"] if self.window_sinks else [])
        return "-".join(bits + [flag for flag, on in (("perhead", self.per_head_scale), ("alibi", self.alibi),
                                                        ("strided", self.strided_query)) if on])


def window_start(kind: str, seq_len: int, window_size: int) -> int:
    low, high = max(0, seq_len - window_size), seq_len
    value = {"low": low, "high": high, "mid": (low + high) // 2, "low+1": low + 1, "high-1": high - 1}[kind]
    return min(high, max(low, value))


bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
CASES = [
    WindowCase("fp8_e4m3", bf16, 32, 128, 16, 8, 2, bf16),
    WindowCase("fp8_e5m2", f32, 7, 64, 8, 4, 4, f32, per_head_scale=True),
    WindowCase("fp8_e4m3fnuz", f16, 33, 80, 32, 8, 1, f16, alibi=True),
    WindowCase("fp8_e4m3", f16, 16, 112, 32, 16, 2, f32, starts=("low+1", "high-1", "mid"), alibi=True,
               per_head_scale=True),
    WindowCase("fp8_e5m2", bf16, 33, 256, 8, 32, 8, bf16, starts=("mid", "low")),
    WindowCase("fp8_e4m3fnuz", f32, 1, 96, 16, 9, 3, f32, strided_query=True),
    WindowCase("fp8", bf16, 16, 64, 16, 6, 6, f32, starts=("high", "low+1")),
    WindowCase("auto", bf16, 16, 256, 16, 4, 1, bf16),
    WindowCase("auto", f32, 1, 96, 8, 12, 2, f32, alibi=True),
    WindowCase("auto", f16, 7, 80, 32, 8, 8, f16, starts=("high-1", "mid", "low"), per_head_scale=True),
    # long contexts: several FP8 partitions merged with the window, one of them with ALiBi
    WindowCase("fp8_e4m3", bf16, 32, 128, 16, 8, 2, f32, seq_lens=(1300, 513, 32), per_head_scale=True),
    WindowCase("fp8_e4m3fnuz", f16, 33, 64, 32, 4, 1, f16, seq_lens=(1300, 1030, 33), starts=("mid", "high", "low"),
               alibi=True),
    WindowCase("fp8_e5m2", f32, 7, 80, 8, 8, 2, f32, seq_lens=(1300, 0, 600), starts=("low", "low", "mid")),
    # a window longer than a partition: the ring runs are split too
    WindowCase("fp8_e4m3", bf16, 700, 128, 16, 8, 2, bf16, seq_lens=(1300, 650, 700, 1401),
               starts=("low", "mid", "low+1", "high-1"), alibi=True),
]


def fill_with_nan(cache: torch.Tensor, kv: str) -> None:
    """Slots nobody writes hold NaN (the FP8 NaN code for uint8 caches): reading one shows in the output."""
    if cache.dtype == torch.uint8:
        cache.fill_(0x80 if kv == "fp8_e4m3fnuz" else 0x7F)
    else:
        cache.fill_(float("nan"))


def build(case: WindowCase):
    g = torch.Generator().manual_seed(case.seed)
    bs, hk, d, w = case.block_size, case.kv_heads, case.head_size, case.window_size
    lens = case.lens()
    n = len(lens)
    blocks_per_seq = [(length + bs - 1) // bs for length in lens]
    num_blocks = sum(blocks_per_seq) + 3
    sinks = case.window_sinks
    ring_blocks = (sinks + w + bs - 1) // bs
    num_window_blocks = n * ring_blocks + 2

    ids = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(n, max(1, max(blocks_per_seq)), dtype=torch.int32)
    window_ids = torch.randperm(num_window_blocks, generator=g).to(torch.int32)
    window_table = torch.full((n, ring_blocks + 1), -1, dtype=torch.int32)  # a last column never read
    slots, window_slots, window_tokens, used = [], [], [], 0
    for s, length in enumerate(lens):
        table[s, :blocks_per_seq[s]] = ids[used:used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        window_table[s, :ring_blocks] = window_ids[s * ring_blocks:(s + 1) * ring_blocks]
        slots += [int(table[s, t // bs]) * bs + t % bs for t in range(length)]
        # the positions the ring holds: the sinks and the newest window_size
        ring = torch.cat([torch.arange(min(sinks, max(0, length - w))), torch.arange(max(0, length - w), length)])
        window_slots.append(ref.window_slots(window_table[s], ring, w, bs, sinks))
        window_tokens.append(ring + (len(slots) - length))  # rows of the sequence's tokens below
    n_tok = len(slots)
    key = torch.randn(n_tok, hk, d, generator=g).to(case.dtype)
    value = torch.randn(n_tok, hk, d, generator=g).to(case.dtype)
    # the ring's own K/V, independent of the paged cache's (see the module docstring)
    window_key = torch.randn(n_tok, hk, d, generator=g).to(case.window_dtype)
    window_value = torch.randn(n_tok, hk, d, generator=g).to(case.window_dtype)
    n_scales = hk if case.per_head_scale else 1
    k_scale = torch.rand(n_scales, generator=g) * 0.03 + 0.004
    v_scale = torch.rand(n_scales, generator=g) * 0.03 + 0.004

    caches = ref.allocate_kv_cache(num_blocks, bs, hk, d, case.kv, case.dtype)
    window_caches = ref.allocate_kv_cache(num_window_blocks, bs, hk, d, "auto", case.window_dtype)
    for cache in (*caches, *window_caches):
        fill_with_nan(cache, case.kv)
    ref.reshape_and_cache(key, value, *caches, torch.tensor(slots, dtype=torch.long), case.kv, k_scale, v_scale)
    rows = torch.cat(window_tokens)
    ref.reshape_and_cache(window_key[rows], window_value[rows], *window_caches, torch.cat(window_slots), "auto",
                          k_scale, v_scale)

    wide = torch.randn(n, case.heads, 2 * d, generator=g).to(case.dtype)
    query = wide[..., :d] if case.strided_query else wide[..., :d].contiguous()
    starts = [window_start(case.starts[s % len(case.starts)], length, w) for s, length in enumerate(lens)]
    return {"query": query, "caches": caches, "window_caches": window_caches, "table": table,
            "window_table": window_table, "seq_lens": torch.tensor(lens, dtype=torch.int32),
            "window_starts": torch.tensor(starts, dtype=torch.int32), "k_scale": k_scale, "v_scale": v_scale,
            "alibi": torch.randn(case.heads, generator=g) * 0.05 if case.alibi else None}


def attention(impl, case: WindowCase, b, window_size: int | None = None, **features) -> torch.Tensor:
    """paged_attention_window over build()'s batch; features: its keyword arguments after v_scale
    (sliding_window, logit_softcap, sinks, k_scale_cache, v_scale_cache); window_sinks is the case's."""
    out = torch.full_like(b["query"], 7.0)  # garbage: every row must be written
    if case.window_sinks:
        features["window_sinks"] = case.window_sinks
    impl.paged_attention_window(
        out, b["query"], *b["caches"], *b["window_caches"], case.kv_heads, case.head_size ** -0.5, b["table"],
        b["window_table"], b["seq_lens"], b["window_starts"], case.window_size if window_size is None else window_size, case.block_size,
        max(case.lens()), b["alibi"], format_code(case.kv, b["query"].device), b["k_scale"], b["v_scale"], **features)
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    assert not torch.isnan(want).any() and not torch.isnan(got).any()
    err = attention_error(got, want)
    assert err <= tolerance(dtype), f"max error {err:.2e} of the output scale"


@pytest.mark.parametrize("case", CASES, ids=WindowCase.id)
def test_window_attention_matches_reference(ops, case):
    b = build(case)
    assert_close(attention(ops, case, b), attention(ref, case, b), case.dtype)


def test_empty_window_is_paged_attention(ops):
    """window_start == seq_len reads only the paged cache: the same partitions as paged_attention."""
    case = WindowCase("fp8_e4m3", bf16, 32, 64, 16, 8, 2, f32, seq_lens=(1300, 40, 0), starts=("high",))
    b = build(case)
    want = torch.full_like(b["query"], 7.0)
    ops.paged_attention(want, b["query"], *b["caches"], case.kv_heads, case.head_size ** -0.5, b["table"],
                        b["seq_lens"], case.block_size, 1300, None, format_code(case.kv, b["query"].device),
                        b["k_scale"], b["v_scale"])
    assert torch.equal(attention(ops, case, b), want)


SMALL = WindowCase("fp8_e4m3", bf16, 16, 64, 16, 4, 2, f32, seq_lens=(40, 10))


@pytest.mark.parametrize("seq, start", [(0, 23), (0, 41), (1, -1), (1, 11)])
def test_window_start_out_of_range_raises(ops, seq, start):
    b = build(SMALL)
    b["window_starts"][seq] = start
    with pytest.raises(RuntimeError, match=rf"window_starts\[{seq}\] = {start} must lie in"):
        attention(ops, SMALL, b)


@pytest.mark.parametrize("bad_id", [-1, 10_000])
def test_out_of_range_window_block_id_raises(ops, bad_id):
    b = build(SMALL)
    b["window_starts"][0] = 24  # positions 24..39 fill the ring's only block
    b["window_table"][0, 0] = bad_id
    with pytest.raises(RuntimeError, match="outside the window cache's blocks"):
        attention(ops, SMALL, b)


def test_out_of_range_paged_block_id_raises(ops):
    b = build(SMALL)
    b["table"][0, 1] = 10_000  # positions 16..31, read from the paged cache below window_start 30
    b["window_starts"][0] = 30
    with pytest.raises(RuntimeError, match="outside the cache's blocks"):
        attention(ops, SMALL, b)


@pytest.mark.parametrize("window_size", [0, -3])
def test_window_size_below_one_raises(ops, window_size):
    b = build(SMALL)
    with pytest.raises(RuntimeError, match="window_size"):
        attention(ops, SMALL, b, window_size=window_size)


def test_window_table_narrower_than_ring_raises(ops):
    b = build(SMALL)
    with pytest.raises(RuntimeError, match="window_block_tables has 2 columns"):
        attention(ops, SMALL, b, window_size=33)  # 33 ring slots need 3 blocks of 16


def test_mismatched_window_cache_raises(ops):
    b = build(SMALL)

    def call(window_caches):
        ops.paged_attention_window(
            torch.empty_like(b["query"]), b["query"], *b["caches"], *window_caches, SMALL.kv_heads, 0.1,
            b["table"], b["window_table"], b["seq_lens"], b["window_starts"], 16, 16, 40, None,
            format_code(SMALL.kv, b["query"].device), b["k_scale"], b["v_scale"])

    with pytest.raises(RuntimeError, match="window_key_cache must be float32, bfloat16 or float16"):
        call(b["caches"])  # the FP8 caches
    with pytest.raises(RuntimeError, match="must have the cache's num_kv_heads = 2, head_size = 64 and block_size = 16"):
        call(ref.allocate_kv_cache(4, 8, SMALL.kv_heads, SMALL.head_size, "auto", torch.bfloat16))
