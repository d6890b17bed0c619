"""linear_bf16's AMX kernel (csrc/cpu/amx_tiles.h), which Xeons with AMX run for batches of 17 rows and more.

CPUs without AMX run it with the tile instructions emulated as Intel's SDM defines them
(csrc/cpu/standalone/amx_runner.cpp): its tiling over panels, the zero padding of rows and features, the
partial last B tile and panel, and the epilogue (bias, one rounding to bfloat16) answer against F.linear in
float32 over the same bfloat16 inputs. On an AMX CPU the real instructions answer too, and the op library
itself takes that path (test_packed_linear's linear_bf16 cases with 29 and 300 rows).
"""

from __future__ import annotations

import platform
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fp8cache import ops
from fp8cache.platform import cpu_info

CSRC = Path(__file__).resolve().parents[2] / "csrc"
CXX = shutil.which("g++")
FEATURES = cpu_info.cpu_feature_names()

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or CXX is None or "avx512_bf16" not in FEATURES,
    reason="the kernel's epilogue needs an x86-64 CPU with AVX512-BF16 (every AMX CPU has it) and g++")


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("amx") / "amx_runner"
    subprocess.run([CXX, "-std=c++20", "-O2", "-Wall", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512bf16", "-I", str(CSRC), str(CSRC / "cpu" / "standalone" / "amx_runner.cpp"),
                    "-o", str(exe)], check=True, capture_output=True, timeout=300)
    return exe


def amx_linear(runner: Path, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
               float32_out: bool, hardware: bool = False) -> torch.Tensor:
    rows, in_features = x.shape
    request = struct.pack("<5q", rows, in_features, out_features, bias is not None, float32_out)
    request += x.contiguous().view(torch.int16).numpy().tobytes() + packed.view(torch.int16).numpy().tobytes()
    if bias is not None:
        request += bias.float().numpy().tobytes()
    done = subprocess.run([str(runner), *(["--hardware"] if hardware else [])], input=request, capture_output=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr.decode()
    dtype = torch.float32 if float32_out else torch.bfloat16
    return torch.frombuffer(bytearray(done.stdout), dtype=torch.int32 if float32_out else torch.int16).view(
        dtype).view(rows, out_features)


# (rows, out_features, in_features): whole and partial 32-row blocks; 16-pair B tiles whole (576, 64) and
# partial (40: 20 pairs, 33: odd, 5: one short tile); an even and an odd number of panels, a partial last one.
SHAPES = [(17, 960, 576), (32, 48, 64), (33, 100, 40), (64, 17, 33), (100, 96, 5), (45, 112, 1536)]


@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
def test_emulated_amx_kernel_rounds_the_float32_linear_once(runner, rows, out_features, in_features):
    lib = ops.load()
    g = torch.Generator().manual_seed(rows * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    packed = lib.linear_bf16_pack(weight)
    for b in (None, bias):
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        exact = amx_linear(runner, x, packed, out_features, b, float32_out=True)
        torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-4)
        got = amx_linear(runner, x, packed, out_features, b, float32_out=False)
        assert torch.equal(got, exact.bfloat16())  # the same sums, rounded once to nearest even


def test_emulated_tiles_flush_denormals_as_amx_does(runner):
    """TDPBF16PS reads bfloat16 denormals as zero, unlike F.linear: a denormal weight adds nothing."""
    lib = ops.load()
    weight = torch.zeros(16, 32).bfloat16()
    weight[0, 0] = 2.0 ** -130  # a bfloat16 denormal
    weight[1, 0] = 1.0
    x = torch.zeros(17, 32).bfloat16()
    x[:, 0] = 1.0
    got = amx_linear(runner, x, lib.linear_bf16_pack(weight), 16, None, float32_out=True)
    assert (got[:, 0] == 0).all() and (got[:, 1] == 1).all()


@pytest.mark.skipif("amx_bf16" not in FEATURES, reason="the real tile instructions need an AMX CPU")
@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
def test_hardware_tiles_match_the_emulation(runner, rows, out_features, in_features):
    """Both within float32's rounding bound of the exact sums. Not bit for bit: one TDPBF16PS sums 16 pairs a
    row in an order the SDM leaves to the implementation (a Sapphire Rapids Xeon, 2026-11-27, differed from the
    SDM's sequential order by up to ~10 ulps at 1536 features); a wrong tile, pair or panel is off by far more."""
    lib = ops.load()
    g = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    packed = lib.linear_bf16_pack(weight)
    emulated = amx_linear(runner, x, packed, out_features, None, float32_out=True)
    hardware = amx_linear(runner, x, packed, out_features, None, float32_out=True, hardware=True)
    exact = F.linear(x.double(), weight.double())
    # |float32 sum of n products - exact| <= n * 2^-24 * sum |products| (the products are exact in float32)
    bound = in_features * 2.0**-24 * F.linear(x.double().abs(), weight.double().abs())
    assert ((hardware.double() - exact).abs() <= bound).all()
    assert ((emulated.double() - exact).abs() <= bound).all()
