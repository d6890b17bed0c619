"""torch.ops.fp8kv.hadamard_transform (fast Walsh-Hadamard transform, csrc/cpu/hadamard.cpp and the GPU kernel
of csrc/cuda/hadamard.cuh) against x @ H with rotation.py's matrix, and rotation.apply_rotation's choice of path.

The reference is float64 x @ H rounded once to x's dtype; the op computes in float32, so it may differ by
float32 rounding, which after a bfloat16/float16 rounding can be one unit in the last place."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8cache.kvcache import rotation
from fp8cache.kvcache.rotation import apply_rotation, hadamard_matrix, rotate

REPO = Path(__file__).resolve().parents[2]
HEAD_SIZES = [64, 80, 96, 112, 128, 256]  # docs/design.md section 4; 80/96/112 are block-diagonal
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


@pytest.fixture(scope="module")
def ops():
    from fp8cache.ops import load

    return load()


def activations(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Random rows with a few large channels, like post-RoPE K."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    x[..., 3] *= 20
    x[..., -5] *= -12
    return x.to(dtype)


def reference(x: torch.Tensor) -> torch.Tensor:
    """float64 x @ H, not yet rounded to x's dtype."""
    return x.double() @ hadamard_matrix(x.shape[-1]).double()


def assert_matches_reference(y: torch.Tensor, x: torch.Tensor) -> None:
    exact = reference(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    # one unit in the last place of x's dtype, plus float32 rounding of sums of d values
    tol = ULP[x.dtype] * exact.abs() + 1e-6 * float(x.double().abs().max()) * x.shape[-1] ** 0.5
    diff = (y.double() - exact).abs()
    assert bool((diff <= tol).all()), f"max difference {float(diff.max()):.3g} (worst tolerance {float(tol.min()):.3g})"


# ---- the op against x @ H --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_op_equals_x_times_hadamard(ops, head_size, dtype):
    x = activations(37, 4, head_size, dtype=dtype)
    y = ops.hadamard_transform(x)
    assert_matches_reference(y, x)
    # and agrees with the torch matmul the reference path uses, to the same tolerance
    assert_matches_reference(rotate(x, hadamard_matrix(head_size)), x)


@pytest.mark.parametrize("head_size", [8, 24, 40, 512, 1024])
def test_other_head_sizes_and_widths(ops, head_size):
    """Blocks of 8 (odd multiples of 8: the 8-lane path of an AVX-512 build) and rows longer than 16
    registers (the buffered path)."""
    x = activations(9, head_size, seed=head_size)
    assert_matches_reference(ops.hadamard_transform(x), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hadamard_is_its_own_inverse_through_the_op(ops, dtype):
    x = activations(16, 3, 128, dtype=torch.float32)
    back = ops.hadamard_transform(ops.hadamard_transform(x.to(dtype)).to(dtype))
    torch.testing.assert_close(back.float(), x.to(dtype).float(), rtol=4 * ULP[dtype], atol=4 * ULP[dtype] * 20)
    if dtype == torch.float32:
        torch.testing.assert_close(back, x, rtol=0, atol=1e-5)


def strided_views() -> dict[str, torch.Tensor]:
    base = activations(6, 5, 4, 128, seed=3)
    return {
        # [tokens, heads, d] seen from [heads, tokens, d], as attention's query[0].transpose(0, 1)
        "transposed heads": base[0].transpose(0, 1),
        "every other token": base[:, ::2, 1],
        "three scattered leading dims": base[:, ::2, 1:3],
        "last dim strided": activations(128, 8, seed=4).t(),
        "storage offset": base.reshape(-1, 128)[1:],
        "size-1 dims": base[:1, :, :1],
    }


@pytest.mark.parametrize("name", list(strided_views()))
def test_non_contiguous_input(ops, name):
    x = strided_views()[name]
    assert not x.is_contiguous() or x.storage_offset() > 0
    before = x.clone()
    y = ops.hadamard_transform(x)
    assert y.is_contiguous()
    assert torch.equal(y, ops.hadamard_transform(x.contiguous()))
    assert_matches_reference(y, x)
    assert torch.equal(x, before)  # the input is not written


def test_empty_input(ops):
    assert ops.hadamard_transform(torch.empty(0, 4, 64)).shape == (0, 4, 64)


def test_bad_input_is_refused(ops):
    with pytest.raises(RuntimeError, match=r"head size 100 allows Hadamard blocks of 4.*kv rotation 'none'"):
        ops.hadamard_transform(torch.randn(3, 100))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 x, got Double"):
        ops.hadamard_transform(torch.randn(3, 64, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="0-dim"):
        ops.hadamard_transform(torch.tensor(1.0))


# ---- apply_rotation: which path ------------------------------------------------------------------------

def test_apply_rotation_uses_the_op_once_loaded(ops):
    x = activations(8, 2, 96, dtype=torch.bfloat16)
    assert rotation.uses_compiled_op(x)
    assert torch.equal(apply_rotation(x, "hadamard"), ops.hadamard_transform(x))
    assert_matches_reference(apply_rotation(x, "hadamard"), x)
    assert not rotation.uses_compiled_op(x.double())  # float64 takes the matmul
    assert torch.equal(apply_rotation(x.double(), "hadamard"), rotate(x.double(), hadamard_matrix(96)))


def test_apply_rotation_without_the_op_library_is_the_matmul():
    """In a process that never loaded the op library, apply_rotation is the matmul (and loads nothing)."""
    import subprocess

    code = ("import torch\n"
            "from fp8cache.kvcache.rotation import apply_rotation, hadamard_matrix, rotate, uses_compiled_op\n"
            "x = torch.randn(16, 2, 64)\n"
            "assert not uses_compiled_op(x)\n"
            "assert torch.equal(apply_rotation(x, 'hadamard'), rotate(x, hadamard_matrix(64)))\n"
            "import sys; assert not any(m.startswith('fp8cache.ops') for m in sys.modules), 'ops imported'\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_apply_rotation_names_and_sizes():
    x = torch.randn(2, 64)
    assert apply_rotation(x, "none") is x
    with pytest.raises(ValueError, match="unknown kv rotation 'givens'; valid: none, hadamard"):
        apply_rotation(x, "givens")
    with pytest.raises(ValueError, match="head size 36.*kv rotation 'none'"):
        apply_rotation(torch.randn(2, 36), "hadamard")


# ---- the GPU kernel, run on the host -----------------------------------------------------------------------

EMULATED_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@pytest.fixture(scope="module")
def gpu_emulation(tmp_path_factory) -> ctypes.CDLL:
    """csrc/cuda/hadamard_kernels.cu built as a host library: the GPU kernel body with each GPU thread a
    fiber and warp shuffles through memory."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ not found: the host emulation of the GPU kernel needs g++ >= 12")
    lib = tmp_path_factory.mktemp("hadamard_emulation") / "hadamard.so"
    cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-DFP8KV_HOST_EMULATION", "-x", "c++",
           str(REPO / "csrc" / "cuda" / "hadamard_kernels.cu"), "-o", str(lib)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr}"
    emu = ctypes.CDLL(str(lib))
    emu.fp8kv_hadamard_transform_emulated.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                      *[ctypes.c_int64] * 5]
    return emu


def emulated_transform(emu: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """x [outer, inner, d] (any strides with a contiguous last dim, as the binding passes them)."""
    outer, inner, d = x.shape
    out = torch.empty(outer * inner, d, dtype=x.dtype)
    rc = emu.fp8kv_hadamard_transform_emulated(EMULATED_DTYPES[x.dtype], x.data_ptr(), out.data_ptr(),
                                               outer * inner, inner, x.stride(0), x.stride(1), d)
    assert rc == 0
    return out.view(outer, inner, d)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", [24, 80, 128, 512, 1024])  # 8, 8, 8, 16 and 32 values per thread
def test_gpu_kernel_on_the_host_equals_x_times_hadamard(gpu_emulation, head_size, dtype):
    x = activations(3, 5, head_size, dtype=dtype, seed=head_size)  # 15 rows: the last thread block is partial
    assert_matches_reference(emulated_transform(gpu_emulation, x), x)


def test_gpu_kernel_on_the_host_reads_strided_rows(gpu_emulation):
    base = activations(4, 6, 128, dtype=torch.bfloat16, seed=7)
    x = base.transpose(0, 1)  # [6, 4, 128] with outer stride 128, inner stride 6 * 128
    assert_matches_reference(emulated_transform(gpu_emulation, x), x)
