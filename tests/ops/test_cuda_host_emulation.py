"""The GPU kernels' logic, run on the host and held to the pure-torch reference ops.

csrc/cuda/host_emulation.cpp compiles the kernel bodies of csrc/cuda/*.cuh as plain C++ (each GPU
thread a fiber, barriers for __syncthreads and warp shuffles) and this test calls them through ctypes. It checks
the index math, the FP8 conversions of the software path, the softmax and the partition merge; it cannot
check what only a GPU shows (the sm_89+ conversion instructions, timing, memory coalescing).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8cache.kvcache import formats
from fp8cache.ops import _build, reference
from fp8cache.platform import paths

# Compiles the kernels for the host first (two variants, ~10 s each at -O0, kept in the fp8kv cache), then runs
# each GPU thread as a fiber.
pytestmark = pytest.mark.slow

CSRC = Path(__file__).resolve().parents[2] / "csrc"
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
FORMAT_CODES = {name: int(code) for name, code in formats.FORMAT_CODES.items()}  # the ops' KVFormat codes
ERROR_SLOT, ERROR_BLOCK, ERROR_SEQ_LEN = 1, 2, 4


def _cuda_include() -> Path | None:
    for root in (Path("/usr/local/cuda/include"), *sorted(Path("/usr/local").glob("cuda-*/include"))):
        if (root / "cuda_fp8.h").is_file():
            return root
    return None


# "shared": the FP8 conversions of common/fp8.h, as on GPUs before sm_89, for E4M3FNUZ and on ROCm.
# "cuda_fp8": the sm_89+ path through cuda_fp8.h (here its host implementation of the same conversions).
EMULATION_VARIANTS = ["shared", "cuda_fp8"]


def load_emulation(variant: str) -> ctypes.CDLL:
    """The host emulation library (~10 s a variant to build; shared with tests/ops/test_cuda_window_emulation.py
    and test_cuda_tensor_core_emulation.py). Kept in the fp8kv cache under a key of csrc's contents, the flags and
    the compiler, as the compile checks' results are: a run after the first builds it only when one changed."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ not found: the host emulation of the GPU kernels needs g++ >= 12")
    flags = ["-std=c++20", "-O0", "-shared", "-fPIC", "-pthread", "-DFP8KV_HOST_EMULATION"]
    if variant == "cuda_fp8":
        include = _cuda_include()
        if include is None:
            pytest.skip("cuda_fp8.h not found under /usr/local/cuda*/include: no CUDA toolkit")
        flags += ["-DFP8KV_HOST_EMULATION_CUDA_FP8", "-I", str(include)]
    key = _build.sources_key(CSRC, True, " ".join(flags), cxx, _build._compiler_version(cxx))
    lib = Path(paths.cache_root()) / "host-emulation" / key / f"{variant}.so"
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker or run waits for this build instead of making its own
        if not lib.is_file():
            partial = lib.with_suffix(f".partial-{os.getpid()}")
            cmd = [cxx, *flags, str(CSRC / "cuda" / "host_emulation.cpp"), "-o", str(partial)]
            done = subprocess.run(cmd, check=False, capture_output=True, text=True)
            assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr}"
            partial.rename(lib)  # whole or not at all
    return ctypes.CDLL(str(lib))


@pytest.fixture(scope="module", params=EMULATION_VARIANTS)
def emu(request: pytest.FixtureRequest) -> ctypes.CDLL:
    return load_emulation(request.param)


def _p(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def emu_reshape_and_cache(emu: ctypes.CDLL, key, value, key_cache, value_cache, slots, kv_cache_dtype,
                          k_scale, v_scale, k_scale_cache=None, v_scale_cache=None) -> int:
    """k_scale_cache / v_scale_cache: bfloat16 [num_blocks, num_kv_heads, block_size], dynamic scales."""
    num_blocks, num_kv_heads, _, block_size, _ = key_cache.shape
    return emu.fp8kv_emu_reshape_and_cache(
        DTYPE_CODES[key.dtype], FORMAT_CODES[kv_cache_dtype], _p(key), _p(value), _p(key_cache),
        _p(value_cache), _p(slots), _p(k_scale), _p(v_scale), ctypes.c_int64(key.shape[0]), num_kv_heads,
        value_cache.shape[2], num_blocks, block_size, int(k_scale.numel() > 1), int(v_scale.numel() > 1),
        _p(k_scale_cache), _p(v_scale_cache))


def emu_paged_attention(emu: ctypes.CDLL, out, query, key_cache, value_cache, block_tables, seq_lens,
                        max_seq_len, alibi, kv_cache_dtype, k_scale, v_scale, scale, sliding_window: int = 0,
                        logit_softcap: float = 0.0, sinks: torch.Tensor | None = None,
                        k_scale_cache: torch.Tensor | None = None, v_scale_cache: torch.Tensor | None = None) -> int:
    num_blocks, num_kv_heads, _, block_size, _ = key_cache.shape
    num_seqs, num_heads, head_size = query.shape
    sinks = None if sinks is None else sinks.to(torch.float32).contiguous()
    return emu.fp8kv_emu_paged_attention(
        DTYPE_CODES[query.dtype], FORMAT_CODES[kv_cache_dtype], _p(out), _p(query), _p(key_cache),
        _p(value_cache), _p(block_tables), _p(seq_lens), _p(alibi), _p(k_scale), _p(v_scale), num_seqs,
        num_heads, num_kv_heads, head_size, num_blocks, block_size, block_tables.shape[1], max_seq_len,
        ctypes.c_float(scale), int(k_scale.numel() > 1), int(v_scale.numel() > 1), sliding_window,
        ctypes.c_float(logit_softcap), _p(sinks), _p(k_scale_cache), _p(v_scale_cache))


def _scales(per_head: bool, num_kv_heads: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    n = num_kv_heads if per_head else 1
    return torch.rand(n, generator=gen) * 0.5 + 0.05, torch.rand(n, generator=gen) * 0.5 + 0.05


def _kv_with_specials(num_tokens: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                      gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen) * 20
    flat = x.view(-1)
    specials = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e6, -1e6, 1e-9,
                             -1e-9, -0.0, 0.0, 3.0e-3, -7.5e-4])
    flat[: specials.numel()] = specials
    return x.to(dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "auto"])
@pytest.mark.parametrize("dtype,head_size,per_head", [
    (torch.float32, 64, False), (torch.float16, 80, True), (torch.bfloat16, 128, True)])
def test_reshape_and_cache_matches_reference_bit_for_bit(emu, kv_cache_dtype, dtype, head_size, per_head):
    gen = torch.Generator().manual_seed(head_size)
    num_kv_heads, num_blocks, block_size, num_tokens = 2, 5, 16, 14
    key = _kv_with_specials(num_tokens, num_kv_heads, head_size, dtype, gen)
    value = _kv_with_specials(num_tokens, num_kv_heads, head_size, dtype, gen).flip(0).contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[3] = slots[9] = -1  # padding
    k_scale, v_scale = _scales(per_head, num_kv_heads, gen)
    caches = [reference.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, kv_cache_dtype,
                                          dtype) for _ in range(2)]

    reference.reshape_and_cache(key, value, *caches[0], slots, kv_cache_dtype, k_scale, v_scale)
    error = emu_reshape_and_cache(emu, key, value, *caches[1], slots, kv_cache_dtype, k_scale, v_scale)

    assert error == 0
    for expected, got in zip(caches[0], caches[1]):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # NaN bits included


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz"])
@pytest.mark.parametrize("dtype,head_size,num_kv_heads", [
    (torch.float32, 64, 2), (torch.float16, 80, 5), (torch.bfloat16, 128, 3)])
def test_reshape_and_cache_with_dynamic_scales_matches_reference_bit_for_bit(emu, kv_cache_dtype, dtype, head_size,
                                                                             num_kv_heads):
    gen = torch.Generator().manual_seed(head_size + 1)
    num_blocks, block_size, num_tokens = 4, 16, 11
    key = _kv_with_specials(num_tokens, num_kv_heads, head_size, dtype, gen)
    # rows of very different magnitudes, a zero row and one whose only non-zero is NaN: each token and head its scale
    key[:, 0] *= torch.logspace(-6, 4, num_tokens)[:, None].to(dtype)
    key[5, -1] = 0.0
    value = _kv_with_specials(num_tokens, num_kv_heads, head_size, dtype, gen).flip(0).contiguous()
    value[2, 0] = 0.0
    value[2, 0, 7] = float("nan")
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[4] = -1  # padding
    unused = torch.ones(1)
    caches = [reference.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, kv_cache_dtype,
                                          dtype) for _ in range(2)]
    scale_caches = [[torch.full((num_blocks, num_kv_heads, block_size), 7.0, dtype=torch.bfloat16)
                     for _ in range(2)] for _ in range(2)]

    reference.reshape_and_cache(key, value, *caches[0], slots, kv_cache_dtype, unused, unused, *scale_caches[0])
    error = emu_reshape_and_cache(emu, key, value, *caches[1], slots, kv_cache_dtype, unused, unused,
                                  *scale_caches[1])

    assert error == 0
    for expected, got in zip([*caches[0], *scale_caches[0]], [*caches[1], *scale_caches[1]]):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # NaN bits included
    assert (scale_caches[1][0] != 7.0).sum() == (num_tokens - 1) * num_kv_heads  # every written slot, nothing else


def test_reshape_and_cache_skips_and_reports_an_out_of_range_slot(emu):
    gen = torch.Generator().manual_seed(1)
    num_kv_heads, head_size, num_blocks, block_size = 2, 64, 3, 8
    key = torch.randn(5, num_kv_heads, head_size, generator=gen)
    value = torch.randn(5, num_kv_heads, head_size, generator=gen)
    slots = torch.tensor([0, num_blocks * block_size, 7, 10**9, 23])
    scale = torch.ones(1)
    geometry = (num_blocks, block_size, num_kv_heads, head_size, "fp8", torch.float32)
    expected = reference.allocate_kv_cache(*geometry)
    got = reference.allocate_kv_cache(*geometry)
    valid = torch.tensor([0, 2, 4])
    reference.reshape_and_cache(key[valid], value[valid], *expected, slots[valid], "fp8", scale, scale)

    error = emu_reshape_and_cache(emu, key, value, *got, slots, "fp8_e4m3", scale, scale)

    assert error == ERROR_SLOT
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def _filled_cache(num_blocks, block_size, num_kv_heads, head_size, kv_cache_dtype, dtype, k_scale, v_scale,
                  gen):
    key_cache, value_cache = reference.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size,
                                                         kv_cache_dtype, dtype)
    n = num_blocks * block_size
    key = (torch.randn(n, num_kv_heads, head_size, generator=gen) * 0.5).to(dtype)
    value = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
    reference.reshape_and_cache(key, value, key_cache, value_cache, torch.arange(n), kv_cache_dtype, k_scale,
                                v_scale)
    return key_cache, value_cache


def _block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                  gen: torch.Generator) -> torch.Tensor:
    width = max(1, max((s + block_size - 1) // block_size for s in seq_lens))
    return torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in seq_lens]).to(torch.int32)


TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

ATTENTION_CASES = [
    # head_size, block_size, num_heads, num_kv_heads, dtype, kv_cache_dtype, alibi, per_head, seq_lens
    (64, 16, 4, 4, torch.float32, "fp8_e4m3", False, False, [1, 37, 600]),  # MHA, 2 partitions
    (80, 8, 6, 2, torch.float16, "fp8_e5m2", True, True, [5, 130]),  # GQA, ALiBi
    (96, 32, 4, 1, torch.bfloat16, "fp8_e4m3fnuz", False, True, [0, 64, 513]),  # MQA, empty sequence
    (112, 16, 2, 2, torch.float32, "auto", True, False, [100, 1100]),  # 3 partitions
    (128, 32, 8, 2, torch.bfloat16, "fp8_e4m3", False, True, [33, 1025]),
    (256, 8, 2, 1, torch.float16, "auto", False, False, [17, 300]),
    (128, 8, 2, 2, torch.float16, "fp8_e4m3", False, False, [512, 1024]),  # partition-sized
    # Head sizes and GQA groups beyond the usual (any multiple of 16 up to 256, any group):
    (32, 16, 3, 1, torch.float32, "fp8_e4m3", False, False, [300, 17]),  # group 3 in 4 head slots
    (48, 8, 14, 2, torch.bfloat16, "fp8_e5m2", True, True, [90, 1]),  # group 7 in 8 slots
    (160, 16, 12, 1, torch.float16, "fp8_e4m3", False, True, [700]),  # group 12: blocks of 4 heads (d > 128)
    (192, 32, 4, 2, torch.bfloat16, "auto", False, False, [260, 9]),
    (256, 16, 8, 2, torch.bfloat16, "fp8_e4m3", False, False, [1500]),  # group 4 at d256, many splits
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"d{c[0]}-bs{c[1]}-h{c[2]}/{c[3]}-{c[5]}")
def test_paged_attention_matches_reference(emu, case):
    head_size, block_size, num_heads, num_kv_heads, dtype, kv_cache_dtype, alibi, per_head, lens = case
    gen = torch.Generator().manual_seed(head_size * block_size + num_heads)
    num_blocks = max(4, sum((s + block_size - 1) // block_size for s in lens))
    k_scale, v_scale = _scales(per_head, num_kv_heads, gen)
    key_cache, value_cache = _filled_cache(num_blocks, block_size, num_kv_heads, head_size, kv_cache_dtype,
                                           dtype, k_scale, v_scale, gen)
    query = torch.randn(len(lens), num_heads, head_size, generator=gen).to(dtype)
    tables = _block_tables(lens, block_size, num_blocks, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    slopes = torch.rand(num_heads, generator=gen) * 0.1 if alibi else None
    scale = head_size**-0.5
    expected = torch.empty(query.shape, dtype=torch.float32)
    reference.paged_attention(expected, query, key_cache, value_cache, num_kv_heads, scale, tables, seq_lens,
                              block_size, max(lens), slopes, kv_cache_dtype, k_scale, v_scale)
    out = torch.full(query.shape, float("nan"), dtype=dtype)

    error = emu_paged_attention(emu, out, query, key_cache, value_cache, tables, seq_lens, max(lens), slopes,
                                kv_cache_dtype, k_scale, v_scale, scale)

    assert error == 0
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def _filled_dynamic_cache(num_blocks, block_size, num_kv_heads, head_size, kv_cache_dtype, dtype, gen):
    """Caches and their dynamic scale caches: K with magnitudes from 1e-2 to 10 across tokens (logits within what
    the tensor cores' 16-bit queries keep to their tolerance), V from 1e-3 to 1e3."""
    key_cache, value_cache = reference.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size,
                                                         kv_cache_dtype, dtype)
    scale_caches = [torch.zeros(num_blocks, num_kv_heads, block_size, dtype=torch.bfloat16) for _ in range(2)]
    n = num_blocks * block_size
    order = torch.randperm(n, generator=gen)
    key_magnitude, value_magnitude = torch.logspace(-2, 1, n)[order], torch.logspace(-3, 3, n).flip(0)[order]
    key = (torch.randn(n, num_kv_heads, head_size, generator=gen) * key_magnitude[:, None, None]).to(dtype)
    value = (torch.randn(n, num_kv_heads, head_size, generator=gen) * value_magnitude[:, None, None]).to(dtype)
    unused = torch.ones(1)
    reference.reshape_and_cache(key, value, key_cache, value_cache, torch.arange(n), kv_cache_dtype, unused, unused,
                                *scale_caches)
    return key_cache, value_cache, *scale_caches


DYNAMIC_CASES = [
    # head_size, block_size, num_heads, num_kv_heads, dtype, kv_cache_dtype, seq_lens
    (64, 16, 8, 2, torch.bfloat16, "fp8_e4m3", [37, 300]),  # GQA 4
    (128, 32, 4, 1, torch.float16, "fp8_e5m2", [1, 200]),  # MQA
    (64, 32, 2, 2, torch.float32, "fp8_e4m3fnuz", [130, 17]),  # MHA, float32 queries
    (128, 16, 16, 1, torch.bfloat16, "fp8_e4m3", [260]),  # group 16: 16 head slots on tensor cores
]


@pytest.mark.parametrize("tensor_cores", [1, 0], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize("case", DYNAMIC_CASES, ids=lambda c: f"d{c[0]}-bs{c[1]}-h{c[2]}/{c[3]}-{c[5]}")
def test_paged_attention_with_dynamic_scales_matches_reference(emu, case, tensor_cores):
    head_size, block_size, num_heads, num_kv_heads, dtype, kv_cache_dtype, lens = case
    gen = torch.Generator().manual_seed(head_size + block_size + num_heads)
    num_blocks = sum((s + block_size - 1) // block_size for s in lens) + 1
    *caches, k_scales, v_scales = _filled_dynamic_cache(num_blocks, block_size, num_kv_heads, head_size,
                                                        kv_cache_dtype, dtype, gen)
    query = torch.randn(len(lens), num_heads, head_size, generator=gen).to(dtype)
    tables = _block_tables(lens, block_size, num_blocks, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    static = torch.full((1,), 3.0)  # not used with dynamic scales
    scale = head_size**-0.5
    expected = torch.empty(query.shape, dtype=torch.float32)
    reference.paged_attention(expected, query, *caches, num_kv_heads, scale, tables, seq_lens, block_size, max(lens),
                              None, kv_cache_dtype, static, static, k_scale_cache=k_scales, v_scale_cache=v_scales)
    out = torch.full(query.shape, float("nan"), dtype=dtype)

    previous = emu.fp8kv_emu_set_tensor_cores(tensor_cores)
    try:
        error = emu_paged_attention(emu, out, query, *caches, tables, seq_lens, max(lens), None, kv_cache_dtype,
                                    static, static, scale, k_scale_cache=k_scales, v_scale_cache=v_scales)
    finally:
        emu.fp8kv_emu_set_tensor_cores(previous)

    assert error == 0
    # relative to each row's size: the outputs span the values' 1e-3 .. 1e3
    size = expected.abs().amax(dim=-1, keepdim=True)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float() / size, expected / size, rtol=tol, atol=tol)


def test_paged_attention_reports_bad_block_ids_and_lengths(emu):
    gen = torch.Generator().manual_seed(7)
    head_size, block_size, num_kv_heads, num_blocks = 64, 16, 1, 6
    scale = torch.ones(1)
    key_cache, value_cache = _filled_cache(num_blocks, block_size, num_kv_heads, head_size, "fp8_e4m3",
                                           torch.float32, scale, scale, gen)
    query = torch.randn(3, 2, head_size, generator=gen)
    tables = torch.tensor([[0, num_blocks], [1, -1], [2, 3]], dtype=torch.int32)

    def run(lens: list[int], max_seq_len: int) -> tuple[int, torch.Tensor]:
        out = torch.zeros(query.shape)
        error = emu_paged_attention(emu, out, query, key_cache, value_cache, tables,
                                    torch.tensor(lens, dtype=torch.int32), max_seq_len, None, "fp8_e4m3",
                                    scale, scale, 0.125)
        return error, out

    error, out = run([20, 30, 32], 32)  # rows 0 and 1 reach their bad second block
    assert error == ERROR_BLOCK and torch.isfinite(out).all()
    assert run([16, 16, 32], 32)[0] == 0  # bad ids past seq_len are never read
    assert run([16, 16, 33], 40)[0] == ERROR_SEQ_LEN  # longer than its block table row
    assert run([16, 16, 32], 20)[0] == ERROR_SEQ_LEN  # max_seq_len below a length
    assert run([16, -1, 32], 32)[0] == ERROR_SEQ_LEN


@pytest.mark.parametrize("sm_count", [1, 100_000])
def test_paged_attention_is_the_same_with_few_or_many_splits(emu, sm_count):
    """The split count follows the GPU's size (attention_splits): one split per sequence on a small GPU, a
    split per 256 positions on a huge one; the merge must give the same attention either way."""
    gen = torch.Generator().manual_seed(sm_count)
    head_size, block_size, num_heads, num_kv_heads, lens = 64, 16, 6, 2, [2000, 255, 257, 16]
    num_blocks = sum((s + block_size - 1) // block_size for s in lens)
    k_scale, v_scale = _scales(True, num_kv_heads, gen)
    caches = _filled_cache(num_blocks, block_size, num_kv_heads, head_size, "fp8_e4m3", torch.bfloat16,
                           k_scale, v_scale, gen)
    query = torch.randn(len(lens), num_heads, head_size, generator=gen).to(torch.bfloat16)
    tables = _block_tables(lens, block_size, num_blocks, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = torch.empty(query.shape, dtype=torch.float32)
    reference.paged_attention(expected, query, *caches, num_kv_heads, 0.125, tables, seq_lens, block_size, max(lens),
                              None, "fp8_e4m3", k_scale, v_scale)
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    previous = emu.fp8kv_emu_set_sm_count(sm_count)
    try:
        error = emu_paged_attention(emu, out, query, *caches, tables, seq_lens, max(lens), None, "fp8_e4m3",
                                    k_scale, v_scale, 0.125)
    finally:
        emu.fp8kv_emu_set_sm_count(previous)
    assert error == 0
    torch.testing.assert_close(out.float(), expected, rtol=1.6e-2, atol=1.6e-2)


def test_an_emulated_block_passes_its_barrier_together_and_reports_a_thread_that_skips_it(emu):
    """The emulated GPU threads are fibers on one OS thread: every thread sees every other's write after the
    block's barrier, and a thread that returns before a barrier the others wait at (undefined on a GPU) ends the
    process with a report instead of hanging the test run."""
    assert emu.fp8kv_emu_barrier_check(256, -1) == 256
    child = subprocess.run(
        [sys.executable, "-c", f"import ctypes; ctypes.CDLL({emu._name!r}).fp8kv_emu_barrier_check(128, 5)"],
        capture_output=True, text=True, timeout=60, check=False)
    assert child.returncode != 0
    assert "deadlock, 127 of 128 GPU threads wait on barriers" in child.stderr
