"""Dynamic KV scales (issue 54): the cache write computes a power-of-two scale per token and KV head and stores it
beside the codes; attention reads it. The compiled CPU ops against the pure-torch reference (fp8cache.ops.reference),
which dequantizes with torch's float8 dtypes, for every format, head and block size, GQA shape and query dtype of
tests/ops/test_ops_cpu.py, paged and with the recent-token window. test_ops_cpu.py::test_other_isa_builds runs this
file again on the AVX2 and portable builds.
"""

from __future__ import annotations

import pytest
import torch
from numerics import attention_error
from test_ops_cpu import Case, tolerance
from test_window_ops import CASES as WINDOW_CASES
from test_window_ops import WindowCase
from test_window_ops import build as build_window

from fp8cache.kvcache import dynamic_scales, formats
from fp8cache.ops import format_code
from fp8cache.ops import reference as ref

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops():
    from fp8cache.ops import load

    return load()


def bf16(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16).item()


def test_scale_is_the_smallest_bfloat16_that_never_clips():
    """amax / max rounded up to a bfloat16: the largest element fits and lands within 2^-7 of the format's max."""
    g = torch.Generator().manual_seed(0)
    amax = torch.cat([torch.exp(torch.randn(2000, generator=g) * 20), torch.tensor([0.0, 1e-45, 448.0, 224.0,
                      224.00002, 3.3e38, float("inf")]), 448.0 * torch.exp2(torch.arange(-130.0, 128.0))])
    smallest, largest = bf16(dynamic_scales.MIN_SCALE_BITS), bf16(dynamic_scales.MAX_SCALE_BITS)
    assert (smallest, largest) == (2.0 ** -126, float(torch.finfo(torch.bfloat16).max))
    for fmt in formats.FP8_FORMATS.values():
        scales = dynamic_scales.scales_of(amax, fmt.max)
        assert scales.dtype == torch.bfloat16
        for a, s, bits in zip(amax.tolist(), scales.float().tolist(), scales.view(torch.int16).tolist()):
            exact = torch.tensor(a, dtype=torch.float32) / fmt.max  # float32, as the kernels divide
            if not smallest <= float(exact) <= largest:
                assert s == (largest if float(exact) > largest else smallest), (fmt.name, a)
                continue
            assert bf16(bits - 1) < float(exact) <= s, (fmt.name, a)  # the next bfloat16 down would clip
            if a > 0:
                assert fmt.max * (1 - 2 ** -7) < a / s <= fmt.max * (1 + 2 ** -20)


DYNAMIC_CASES = [
    Case("fp8_e4m3", 128, 16, 8, 2, torch.float32),
    Case("fp8_e5m2", 64, 8, 4, 4, torch.bfloat16),
    Case("fp8_e4m3fnuz", 80, 32, 8, 1, torch.float16),
    Case("fp8", 96, 16, 9, 3, torch.float32, alibi=True, strided=True),
    Case("fp8_e4m3", 256, 8, 32, 8, torch.bfloat16, alibi=True),
    Case("fp8_e5m2", 112, 16, 16, 2, torch.float32, strided=True),
    Case("fp8_e4m3", 80, 8, 5, 1, torch.float16, strided=True),
    Case("fp8_e4m3", 64, 16, 9, 3, torch.bfloat16),
    # several 512-token partitions merged
    Case("fp8_e4m3", 128, 16, 8, 2, torch.float32, seq_lens=(1300, 513, 7)),
    Case("fp8_e4m3fnuz", 64, 32, 4, 1, torch.bfloat16, seq_lens=(2100,), alibi=True),
    Case("fp8_e5m2", 64, 16, 4, 2, torch.float32, seq_lens=(0, 1, 2, 15, 16, 17, 31, 33, 64, 65, 100, 200)),
    # a NaN element stays NaN, and its token's scale comes from the other elements
    Case("fp8_e4m3", 64, 16, 8, 2, torch.float32, seq_lens=(40, 50), nan_token="value"),
]


def token_magnitudes(n: int, g: torch.Generator) -> torch.Tensor:
    """Per token factors over ten orders of magnitude, as outlier tokens make them (within float16's range)."""
    return (torch.exp(torch.randn(n, 1, 1, generator=g) * 3) * torch.exp(torch.rand(1, 1, 1, generator=g) * 3)).clamp(
        1e-6, 1e3)


def build(case: Case) -> dict:
    g = torch.Generator().manual_seed(case.seed + 54)
    bs, hk, d = case.block_size, case.kv_heads, case.head_size
    blocks_per_seq = [(n + bs - 1) // bs for n in case.seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(len(case.seq_lens), max(1, max(blocks_per_seq)), dtype=torch.int32)
    slots, used = [], 0
    for s, n in enumerate(case.seq_lens):
        table[s, :blocks_per_seq[s]] = ids[used:used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        slots += [int(table[s, t // bs]) * bs + t % bs for t in range(n)]
    for i in range(case.padding):
        slots.insert((i * 7919) % (len(slots) + 1), -1)
    n_tok = len(slots)
    scale = token_magnitudes(n_tok, g)
    if case.strided:
        qkv = (torch.randn(n_tok, d, 3, hk, generator=g) * scale[..., None]).to(case.dtype)
        key, value = qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
    else:
        key = (torch.randn(n_tok, hk, d, generator=g) * scale).to(case.dtype)
        value = (torch.randn(n_tok, hk, d, generator=g) * token_magnitudes(n_tok, g)).to(case.dtype)
    if case.nan_token:
        target = key if case.nan_token == "key" else value
        target[[i for i, slot in enumerate(slots) if slot >= 0][5], 0, 3] = float("nan")
    query = (torch.randn(len(case.seq_lens), case.heads, d, generator=g) / scale.median()).to(case.dtype)
    return {"key": key, "value": value, "slots": torch.tensor(slots, dtype=torch.long), "table": table,
            "num_blocks": num_blocks, "query": query, "seq_lens": torch.tensor(case.seq_lens, dtype=torch.int32),
            "alibi": torch.randn(case.heads, generator=g) * 0.05 if case.alibi else None}


def write(impl, case: Case, b: dict) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    caches = ref.allocate_kv_cache(b["num_blocks"], case.block_size, case.kv_heads, case.head_size, case.kv,
                                   case.dtype)
    scale_caches = dynamic_scales.allocate_scale_caches(b["num_blocks"], case.block_size, case.kv_heads)
    ones = torch.ones(1)
    impl.reshape_and_cache(b["key"], b["value"], *caches, b["slots"], format_code(case.kv, CPU), ones, ones,
                           *scale_caches)
    return caches, scale_caches


def attention(impl, case: Case, b: dict, caches, scale_caches, **features) -> torch.Tensor:
    out = torch.full_like(b["query"], 7.0)
    # static scales far from 1: dynamic scales replace them, so they must not count
    k_scale, v_scale = torch.full((1,), 1e3), torch.full((case.kv_heads,), 1e-3)
    impl.paged_attention(out, b["query"], *caches, case.kv_heads, case.head_size ** -0.5, b["table"], b["seq_lens"],
                         case.block_size, max(case.seq_lens), b["alibi"], format_code(case.kv, CPU), k_scale, v_scale,
                         features.get("sliding_window", 0), features.get("logit_softcap", 0.0),
                         features.get("sinks"), *scale_caches)
    return out


@pytest.mark.parametrize("case", DYNAMIC_CASES, ids=Case.id)
def test_cache_write_and_attention_match_reference(ops, case):
    b = build(case)
    want_caches, want_scales = write(ref, case, b)
    got_caches, got_scales = write(ops, case, b)
    for got, want in zip((*got_caches, *got_scales), (*want_caches, *want_scales)):
        assert torch.equal(got, want), "cache or scale bytes differ"
    want = attention(ref, case, b, want_caches, want_scales)
    got = attention(ops, case, b, got_caches, got_scales)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert attention_error(got, want) <= tolerance(case.dtype)


@pytest.mark.parametrize("features", [{"sliding_window": 37}, {"logit_softcap": 5.0}, {"sinks": True}],
                         ids=["window", "softcap", "sinks"])
def test_model_features_with_dynamic_scales(ops, features):
    case = Case("fp8_e4m3", 64, 16, 8, 2, torch.float32, seq_lens=(1, 90, 700))
    b = build(case)
    if features.get("sinks"):
        features = {"sinks": torch.randn(case.heads, generator=torch.Generator().manual_seed(1))}
    caches, scale_caches = write(ref, case, b)
    want = attention(ref, case, b, caches, scale_caches, **features)
    got = attention(ops, case, b, caches, scale_caches, **features)
    assert attention_error(got, want) <= tolerance(case.dtype)


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
def test_partitions_that_start_inside_a_block(ops, block_size, query_dtype):
    """A sliding window starts sequences' partitions inside a block, so the AVX-512 kernel's tiles of 16 scales
    begin before the first token it attends to (block size 8: a tile spans two blocks, the second past the end of
    a short partition); passes of very different lengths follow each other (each fetches the next one's scales)."""
    case = Case("fp8_e5m2", 64, block_size, 6, 2, query_dtype, seq_lens=(1, 8, 9, 24, 600, 1100, 47))
    b = build(case)
    caches, scale_caches = write(ref, case, b)
    for window in (5, 300):
        want = attention(ref, case, b, caches, scale_caches, sliding_window=window)
        got = attention(ops, case, b, caches, scale_caches, sliding_window=window)
        assert attention_error(got, want) <= tolerance(case.dtype)


def test_largest_element_never_clips_and_outliers_keep_their_precision(ops):
    """A token three thousand times larger than its neighbours: a static scale fit to the neighbours saturates it;
    its own scale stores every token to FP8's relative precision, its largest element within 2^-7."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 2, 64, generator=g)
    x[10] *= 3000.0
    kc, vc = ref.allocate_kv_cache(4, 16, 2, 64, "fp8_e4m3", torch.float32)
    scales = dynamic_scales.allocate_scale_caches(4, 16, 2)
    ops.reshape_and_cache(x, x, kc, vc, torch.arange(64), format_code("fp8_e4m3", CPU), torch.ones(1),
                          torch.ones(1), *scales)
    k, _ = ref.gather_kv(kc, vc, torch.arange(4), 64, "fp8_e4m3", torch.ones(1), torch.ones(1), 0, *scales)
    amax = x.abs().amax(-1, keepdim=True)
    assert float((k.abs().amax(-1, keepdim=True) / amax - 1).abs().max()) <= 2 ** -7
    assert float(((k - x).abs() / amax).max()) <= 2 ** -4  # half a step of E4M3's top binade, relative
    static = ref.quantize(x, torch.full((1,), float(x[:10].abs().max()) / 448), formats.FP8_FORMATS["fp8_e4m3"])
    assert bool((static.view(torch.float8_e4m3fn).float().abs() == 448).any())  # what the static scale does


def write_dynamic(case: WindowCase, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewrites the paged cache of a test_window_ops batch with dynamic scales (tokens of token_magnitudes());
    returns the scale caches."""
    g = torch.Generator().manual_seed(7)
    bs, lens = case.block_size, case.lens()
    slots = torch.tensor([int(b["table"][s, t // bs]) * bs + t % bs for s, n in enumerate(lens) for t in range(n)],
                         dtype=torch.long)
    key = (torch.randn(len(slots), case.kv_heads, case.head_size, generator=g) * token_magnitudes(len(slots), g))
    value = torch.randn(len(slots), case.kv_heads, case.head_size, generator=g) * token_magnitudes(len(slots), g)
    scale_caches = dynamic_scales.allocate_scale_caches(b["caches"][0].shape[0], bs, case.kv_heads)
    ref.reshape_and_cache(key.to(case.dtype), value.to(case.dtype), *b["caches"], slots, case.kv, b["k_scale"],
                          b["v_scale"], *scale_caches)
    return scale_caches


@pytest.mark.parametrize("case", [c for c in WINDOW_CASES if c.kv != "auto"][:6] + [WINDOW_CASES[10]],
                         ids=WindowCase.id)
def test_window_attention_matches_reference(ops, case):
    b = build_window(case)
    caches, scale_caches = b["caches"], write_dynamic(case, b)
    bs, lens = case.block_size, case.lens()

    def run(impl) -> torch.Tensor:
        out = torch.full_like(b["query"], 7.0)
        impl.paged_attention_window(
            out, b["query"], *caches, *b["window_caches"], case.kv_heads, case.head_size ** -0.5, b["table"],
            b["window_table"], b["seq_lens"], b["window_starts"], case.window_size, bs, max(lens), b["alibi"],
            format_code(case.kv, CPU), b["k_scale"], b["v_scale"], 0, 0.0, None, *scale_caches)
        return out

    want, got = run(ref), run(ops)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert attention_error(got, want) <= tolerance(case.dtype)


def test_bad_scale_caches_raise(ops):
    kc, vc = ref.allocate_kv_cache(4, 16, 2, 64, "fp8_e4m3", torch.float32)
    k_sc, v_sc = dynamic_scales.allocate_scale_caches(4, 16, 2)
    x, slots, one = torch.randn(3, 2, 64), torch.arange(3), torch.ones(1)
    code = format_code("fp8_e4m3", CPU)
    with pytest.raises(RuntimeError, match="both k_scale_cache and v_scale_cache"):
        ops.reshape_and_cache(x, x, kc, vc, slots, code, one, one, k_sc, None)
    with pytest.raises(RuntimeError, match=r"k_scale_cache must be bfloat16 \[num_blocks=4"):
        ops.reshape_and_cache(x, x, kc, vc, slots, code, one, one, k_sc[:, :, :8].contiguous(), v_sc)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        ops.reshape_and_cache(x, x, kc, vc, slots, code, one, one, k_sc.float(), v_sc)
    auto = ref.allocate_kv_cache(4, 16, 2, 64, "auto", torch.float32)
    with pytest.raises(RuntimeError, match="'auto' cache"):
        ops.reshape_and_cache(x, x, *auto, slots, format_code("auto", CPU), one, one, k_sc, v_sc)
    out, q = torch.empty(1, 4, 64), torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match="both k_scale_cache"):
        ops.paged_attention(out, q, kc, vc, 2, 0.125, torch.zeros(1, 1, dtype=torch.int32),
                            torch.ones(1, dtype=torch.int32), 16, 1, None, code, one, one, 0, 0.0, None, None, v_sc)
    assert torch.count_nonzero(k_sc.float()) == 0  # nothing was written
