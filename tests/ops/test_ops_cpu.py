"""CPU reshape_and_cache / paged_attention against the pure-torch reference (fp8cache.ops.reference).

The case list is lean rather than a cross product, but every value of every axis appears: formats, head
sizes, block sizes, MHA/GQA/MQA, per-tensor/per-head scales, query dtypes, padding slots, strided
inputs, ALiBi, partitioned long contexts and batches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from numerics import attention_error

import fp8cache.ops
from fp8cache.ops import format_code
from fp8cache.ops import reference as ref

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops():
    from fp8cache.ops import load

    return load()


@dataclass
class Case:
    kv: str
    head_size: int = 128
    block_size: int = 16
    heads: int = 8
    kv_heads: int = 2
    dtype: torch.dtype = torch.float32
    seq_lens: tuple[int, ...] = (1, 37, 300)
    per_head_scale: bool = False
    alibi: bool = False
    strided: bool = False
    padding: int = 3  # padding tokens (slot -1) mixed into the batch
    seed: int = 0
    extra_blocks: int = 5
    nan_token: str | None = field(default=None)  # "key" or "value": put a NaN into one cached token

    def id(self) -> str:
        bits = [self.kv, f"d{self.head_size}", f"bs{self.block_size}", f"h{self.heads}/{self.kv_heads}",
                str(self.dtype).removeprefix("torch."), "x".join(map(str, self.seq_lens))]
        bits += [flag for flag, on in (("perhead", self.per_head_scale), ("alibi", self.alibi),
                                       ("strided", self.strided)) if on]
        return "-".join(bits + ([f"nan{self.nan_token}"] if self.nan_token else []))


CASES = [
    Case("fp8_e4m3", 128, 16, 8, 2, torch.float32),
    Case("fp8_e5m2", 64, 8, 4, 4, torch.bfloat16, per_head_scale=True),
    Case("fp8_e4m3fnuz", 80, 32, 8, 1, torch.float16),
    Case("fp8", 96, 16, 9, 3, torch.float32, alibi=True, strided=True),
    Case("auto", 112, 8, 12, 2, torch.float32, per_head_scale=True),
    Case("auto", 256, 32, 4, 1, torch.bfloat16, strided=True),
    Case("auto", 64, 16, 16, 16, torch.float16, alibi=True),
    Case("fp8_e4m3", 256, 8, 32, 8, torch.bfloat16, per_head_scale=True, alibi=True),
    Case("fp8_e5m2", 112, 16, 16, 2, torch.float32, strided=True),
    Case("fp8_e4m3fnuz", 64, 16, 6, 6, torch.float32, per_head_scale=True, alibi=True),
    Case("fp8_e4m3", 80, 8, 5, 1, torch.float16, strided=True),
    Case("fp8_e5m2", 96, 32, 24, 3, torch.bfloat16),
    # head sizes that are not a multiple of 16 (16-bit and float32 caches allow them; the portable kernel runs them)
    Case("auto", 40, 16, 6, 2, torch.bfloat16, seq_lens=(1, 37, 600)),
    Case("auto", 36, 8, 4, 1, torch.float32, alibi=True),
    # long contexts: several 512-token partitions merged
    Case("fp8_e4m3", 128, 16, 8, 2, torch.float32, seq_lens=(1300, 513, 7), per_head_scale=True),
    Case("fp8_e4m3fnuz", 64, 32, 4, 1, torch.bfloat16, seq_lens=(2100,), alibi=True),
    Case("auto", 128, 8, 4, 2, torch.bfloat16, seq_lens=(1030, 1)),
    # a batch of many short sequences, one of them empty
    Case("fp8_e5m2", 64, 16, 4, 2, torch.float32, seq_lens=(0, 1, 2, 15, 16, 17, 31, 33, 64, 65, 100, 200)),
    # a NaN in the cache must come out as NaN exactly where the reference puts it
    Case("fp8_e4m3", 64, 16, 8, 2, torch.float32, seq_lens=(40, 50), nan_token="key"),
    Case("fp8_e4m3fnuz", 64, 8, 8, 2, torch.float32, seq_lens=(40, 50), nan_token="value"),
    Case("fp8_e5m2", 64, 32, 8, 8, torch.float32, seq_lens=(600, 50), nan_token="value"),
]


def build(case: Case):
    """Caches filled through both implementations, plus the attention inputs."""
    g = torch.Generator().manual_seed(case.seed)
    bs, hk, d = case.block_size, case.kv_heads, case.head_size
    blocks_per_seq = [(n + bs - 1) // bs for n in case.seq_lens]
    num_blocks = sum(blocks_per_seq) + case.extra_blocks
    ids = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(len(case.seq_lens), max(1, max(blocks_per_seq)), dtype=torch.int32)
    slots, used = [], 0
    for s, n in enumerate(case.seq_lens):
        table[s, :blocks_per_seq[s]] = ids[used:used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        slots += [int(table[s, t // bs]) * bs + t % bs for t in range(n)]
    for i in range(case.padding):  # padding tokens scattered through the batch
        slots.insert((i * 7919) % (len(slots) + 1), -1)
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    n_tok = len(slots)
    if case.strided:  # key/value as views into a packed qkv tensor, with a transposed layout
        qkv = torch.randn(n_tok, d, 3, hk, generator=g).to(case.dtype)
        key, value = qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
        assert not key.is_contiguous()
    else:
        key = torch.randn(n_tok, hk, d, generator=g).to(case.dtype)
        value = torch.randn(n_tok, hk, d, generator=g).to(case.dtype)
    if case.nan_token:
        target = key if case.nan_token == "key" else value
        valid = [i for i, slot in enumerate(slots) if slot >= 0]
        target[valid[5], 0, 3] = float("nan")
    n_scales = hk if case.per_head_scale else 1
    k_scale = torch.rand(n_scales, generator=g) * 0.03 + 0.004
    v_scale = torch.rand(n_scales, generator=g) * 0.03 + 0.004
    model_dtype = case.dtype
    ref_caches = ref.allocate_kv_cache(num_blocks, bs, hk, d, case.kv, model_dtype)
    op_caches = ref.allocate_kv_cache(num_blocks, bs, hk, d, case.kv, model_dtype)
    ref.reshape_and_cache(key, value, *ref_caches, slot_mapping, case.kv, k_scale, v_scale)
    wide = torch.randn(len(case.seq_lens), case.heads, 2 * d, generator=g).to(case.dtype)
    query = wide[..., :d] if case.strided else wide[..., :d].contiguous()
    alibi = torch.randn(case.heads, generator=g) * 0.05 if case.alibi else None
    return {"key": key, "value": value, "slot_mapping": slot_mapping, "k_scale": k_scale,
            "v_scale": v_scale, "ref_caches": ref_caches, "op_caches": op_caches, "table": table,
            "query": query, "alibi": alibi, "seq_lens": torch.tensor(case.seq_lens, dtype=torch.int32)}


def attention(impl, case: Case, caches, b) -> torch.Tensor:
    out = torch.full_like(b["query"], 7.0)  # garbage: every row must be written
    impl.paged_attention(out, b["query"], caches[0], caches[1], case.kv_heads, case.head_size ** -0.5,
                         b["table"], b["seq_lens"], case.block_size, max(case.seq_lens), b["alibi"],
                         format_code(case.kv, b["query"].device), b["k_scale"], b["v_scale"])
    return out


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_ops_match_reference(ops, case):
    b = build(case)
    ops.reshape_and_cache(b["key"], b["value"], *b["op_caches"], b["slot_mapping"], format_code(case.kv, CPU),
                          b["k_scale"], b["v_scale"])
    for mine, theirs in zip(b["op_caches"], b["ref_caches"]):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), "cache bytes differ"
    want = attention(ref, case, b["ref_caches"], b)
    got = attention(ops, case, b["op_caches"], b)
    assert got.dtype == case.dtype
    if case.nan_token:
        assert torch.isnan(want).any()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    err = attention_error(got, want)
    assert err <= tolerance(case.dtype), f"max error {err:.2e} of the output scale"


def test_empty_sequence_writes_zeros(ops):
    case = Case("fp8_e4m3", 64, 16, 4, 2, seq_lens=(0, 5))
    b = build(case)
    out = attention(ops, case, b["ref_caches"], b)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_out_of_range_slot_raises_and_writes_nothing(ops):
    case = Case("fp8_e4m3", 64, 16, 4, 2, seq_lens=(20,))
    b = build(case)
    num_slots = b["op_caches"][0].shape[0] * case.block_size
    bad = b["slot_mapping"].clone()
    bad[-1] = num_slots
    before = [c.clone() for c in b["op_caches"]]
    with pytest.raises(RuntimeError, match="out of range"):
        ops.reshape_and_cache(b["key"], b["value"], *b["op_caches"], bad, format_code(case.kv, CPU), b["k_scale"],
                              b["v_scale"])
    assert all(torch.equal(x, y) for x, y in zip(before, b["op_caches"]))


@pytest.mark.parametrize("bad_id", [-1, 10_000])
def test_out_of_range_block_id_raises(ops, bad_id):
    case = Case("fp8_e5m2", 64, 16, 4, 2, seq_lens=(40,))
    b = build(case)
    b["table"][0, 1] = bad_id
    with pytest.raises(RuntimeError, match="outside the cache's blocks"):
        attention(ops, case, b["ref_caches"], b)


def test_seq_len_longer_than_block_table_raises(ops):
    case = Case("auto", 64, 16, 4, 2, seq_lens=(40,))
    b = build(case)
    b["seq_lens"][0] = 16 * b["table"].shape[1] + 1
    with pytest.raises(RuntimeError, match="block_tables has only"):
        attention(ops, case, b["ref_caches"], b)


def test_mismatched_arguments_raise(ops):
    case = Case("fp8_e4m3", 64, 16, 4, 2, seq_lens=(10,))
    b = build(case)
    with pytest.raises(RuntimeError, match="uint8"):
        ops.reshape_and_cache(b["key"], b["value"], b["op_caches"][0].float(), b["op_caches"][1].float(),
                              b["slot_mapping"], format_code(case.kv, CPU), b["k_scale"], b["v_scale"])
    with pytest.raises(RuntimeError, match="k_scale must have 1 or 2"):
        ops.reshape_and_cache(b["key"], b["value"], *b["op_caches"], b["slot_mapping"], format_code(case.kv, CPU),
                              torch.ones(3), b["v_scale"])
    with pytest.raises(RuntimeError, match="unknown kv_cache_format code 7"):
        ops.reshape_and_cache(b["key"], b["value"], *b["op_caches"], b["slot_mapping"], 7,
                              b["k_scale"], b["v_scale"])
    # The documented Python API takes the strings and refuses unknown ones as the compiled op used to.
    with pytest.raises(RuntimeError, match="valid choices"):
        fp8cache.ops.reshape_and_cache(b["key"], b["value"], *b["op_caches"], b["slot_mapping"], "fp16",
                                       b["k_scale"], b["v_scale"])


@pytest.mark.parametrize("kv", ["fp8_e4m3", "auto"])
def test_wide_logits_match_reference_and_leave_denormals_on(ops, kv):
    """Logits hundreds apart: most softmax weights (and their products with V) fall below float32's normal
    range, which the kernel flushes to zero for speed. The output must still match the reference, and the
    calling thread must get its own floating-point mode back (denormals still computed after the call)."""
    case = Case(kv, 64, 16, 9, 3, torch.float32, seq_lens=(300, 700, 33))
    b = build(case)
    b["query"] = b["query"] * 400.0
    want = attention(ref, case, b["ref_caches"], b)
    got = attention(ops, case, b["ref_caches"], b)
    assert attention_error(got, want) <= tolerance(case.dtype)
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # a float32 denormal
    assert (tiny * 3.0).item() == pytest.approx(3e-39, rel=1e-3, abs=0.0)


# bfloat16 queries over FP8 caches take their own kernel path where the CPU has AVX512-BF16 (bfloat16
# dot products; probabilities rounded to bfloat16 for P.V): every head size, block size and GQA width.
BF16_CASES = [
    Case("fp8_e4m3", 64, 8, 2, 2, torch.bfloat16, seq_lens=(3, 100, 515)),
    Case("fp8_e5m2", 80, 16, 6, 2, torch.bfloat16, seq_lens=(17, 1100), per_head_scale=True),
    Case("fp8_e4m3fnuz", 96, 32, 9, 3, torch.bfloat16, alibi=True),
    Case("fp8_e4m3", 112, 16, 5, 1, torch.bfloat16, seq_lens=(31, 529), strided=True),
    Case("fp8_e5m2", 128, 16, 32, 8, torch.bfloat16, seq_lens=(1, 16, 700)),
    Case("fp8_e4m3", 256, 32, 16, 2, torch.bfloat16, seq_lens=(45, 66)),
    Case("fp8_e4m3fnuz", 64, 16, 8, 2, torch.bfloat16, seq_lens=(40, 50), nan_token="value"),
    Case("fp8_e4m3", 64, 16, 8, 2, torch.bfloat16, seq_lens=(40, 50), nan_token="key"),
]


def float32_query_attention(ops, case: Case, b) -> torch.Tensor:
    """The op's output for the same query values given as float32 (the float path)."""
    f32 = Case(**{**case.__dict__, "dtype": torch.float32})
    return attention(ops, f32, b["op_caches"], {**b, "query": b["query"].float()})


def filled_by_ops(ops, case: Case):
    b = build(case)
    ops.reshape_and_cache(b["key"], b["value"], *b["op_caches"], b["slot_mapping"], format_code(case.kv, CPU),
                          b["k_scale"], b["v_scale"])
    return b


@pytest.mark.parametrize("case", BF16_CASES, ids=Case.id)
def test_bfloat16_queries_match_reference_and_the_float32_query_path(ops, case):
    """The same query values as bfloat16 and as float32 (the float path): both near the reference, and
    within the bfloat16 output's rounding of each other."""
    test_ops_match_reference(ops, case)
    b = filled_by_ops(ops, case)
    got_bf16 = attention(ops, case, b["op_caches"], b)
    got_f32 = float32_query_attention(ops, case, b)
    assert torch.equal(torch.isnan(got_bf16), torch.isnan(got_f32))
    assert attention_error(got_bf16, got_f32) <= 8e-3


def test_bf16_queries_take_the_dot_product_path(ops):
    """bfloat16 queries over an FP8 cache stay within bfloat16 rounding of the float32 query's result. On a
    CPU with AVX512-BF16 they take the dot-product path, whose bfloat16 probabilities change some outputs:
    the result is then not just the float32 one rounded."""
    case = BF16_CASES[4]
    b = filled_by_ops(ops, case)
    want = float32_query_attention(ops, case, b).to(torch.bfloat16)
    got = attention(ops, case, b["op_caches"], b)
    assert attention_error(got, want) <= 8e-3
    if ops.cpu_isa() == "avx512" and _cpu_has("avx512_bf16"):
        assert not torch.equal(got, want)
    else:
        assert torch.equal(got, want)


def test_isa_is_what_was_asked_for(ops, request):
    asked = request.config.getoption("--cpu-isa") or "native"
    if asked in ("scalar", "avx2", "avx512"):
        assert ops.cpu_isa() == asked


def _cpu_has(flag: str) -> bool:
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif("config.getoption('--cpu-isa')", reason="already inside an ISA run")
@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_other_isa_builds(isa):
    """The op library built for a lower CPU path (its own cache key) passes the FP8 conversion tests
    (fp8.h's scalar encoder there, the vector one in an AVX-512 build), every attention case, paged and
    window, with sinks too (AVX2's own FP8 kernel, attention_avx2.h, and the portable one run them all), the
    panel linear kernels' (AVX2's tiles, panel_tiles_avx2.h, and the portable loops) and the Hadamard op's.
    The library is registered per process, so this runs pytest in a child process (one per path: each pays
    ~8 CPU-s of imports)."""
    if isa == "avx2" and not (_cpu_has("avx2") and _cpu_has("avx512f")):
        pytest.skip("avx2 is only a separate path on an AVX-512 machine")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    files = [Path(__file__), Path(__file__).with_name("test_fp8_conversion.py"),
             Path(__file__).with_name("test_window_ops.py"), Path(__file__).with_name("test_dynamic_scales.py"),
             Path(__file__).with_name("test_window_sinks.py"),
             REPO / "tests" / "model" / "test_packed_linear.py"]
    assert all(f.is_file() for f in files), files
    hadamard = Path(__file__).with_name("test_hadamard_op.py")
    hadamard_ops = [f"{hadamard}::{name}" for name in (  # the op's tests, not its GPU emulation's
        "test_op_equals_x_times_hadamard", "test_other_head_sizes_and_widths",
        "test_hadamard_is_its_own_inverse_through_the_op", "test_non_contiguous_input")]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--cpu-isa", isa, *map(str, files),
         *hadamard_ops],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " passed" in result.stdout
