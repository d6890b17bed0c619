"""The portable CPU kernels as Arm machines build them, run under emulation.

csrc/cpu/standalone/runner.cpp (fp8.h's encoder and decoder, attention_generic.h) is cross-compiled for aarch64
as `-mcpu=native` would build it on a Graviton 2 (Neoverse N1: NEON) and a Graviton 3 (Neoverse V1: SVE,
BF16), and run with qemu-user. It answers against torch's float8 dtypes and the pure-torch reference ops on
this machine. What this checks: the kernels' results with Arm's code generation (its vectorizer, unsigned
`char`, fused multiply-adds). Not their speed: emulation says nothing of it.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from numerics import attention_error
from test_fp8_conversion import FORMATS, edge_values, random_values, torch_codes
from test_ops_cpu import CASES, Case, attention, build, tolerance
from torch.utils import cpp_extension

from fp8cache.ops import format_code
from fp8cache.ops import reference as ref

CSRC = Path(__file__).resolve().parents[2] / "csrc"
CPU = torch.device("cpu")
CROSS = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64")
PARTITION = 512  # kPartitionSize (attention_kernel.h): the runner answers per partition
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

pytestmark = pytest.mark.skipif(
    not (CROSS and QEMU),
    reason="needs an aarch64 cross compiler and qemu-user: apt-get install g++-aarch64-linux-gnu qemu-user "
           "(.ci/run installs them)")


@pytest.fixture(scope="module", params=["neoverse-n1", "neoverse-v1"])
def runner(request, tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("arm") / f"runner-{request.param}"
    includes = [arg for path in cpp_extension.include_paths() for arg in ("-isystem", path)]
    subprocess.run([CROSS, "-std=c++20", "-O3", "-Wall", f"-mcpu={request.param}", "-static", "-I", str(CSRC),
                    *includes, str(CSRC / "cpu" / "standalone" / "runner.cpp"), "-o", str(exe)],
                   check=True, capture_output=True, timeout=300)
    return exe


@pytest.mark.slow
def test_op_library_compiles_for_arm(tmp_path):
    """Every source of the op library compiles for aarch64 as the build compiles it there (-mcpu=native on a
    Neoverse V1): no x86 instruction or header outside the ISA guards. The sources are analysed as one
    translation unit, so that torch's headers are parsed once (8 s instead of 63): what this checks is the ISA
    guards, which a source's own includes decide either way."""
    includes = [arg for path in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
                for arg in ("-isystem", path)]
    sources = [CSRC / "torch_bindings.cpp", *sorted((CSRC / "cpu").glob("*.cpp"))]
    unity = tmp_path / "op_library.cpp"
    unity.write_text("".join(f'#include "{source}"\n' for source in sources))
    done = subprocess.run([CROSS, "-std=c++20", "-O2", "-mcpu=neoverse-v1", "-fopenmp", "-fsyntax-only", "-I",
                           str(CSRC), *includes, str(unity)], check=False, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def ask(runner: Path, request: bytes) -> bytes:
    done = subprocess.run([QEMU, str(runner)], input=request, capture_output=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout


def ints(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_code_decodes_like_torch(runner, fmt):
    got = torch.frombuffer(bytearray(ask(runner, ints(1, format_code(fmt.name, CPU)))), dtype=torch.float32)
    want = torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))  # -0 included


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("scale", [1.0, 0.0173, 2.0 ** -10])
def test_encoding_matches_torch_bit_for_bit(runner, fmt, scale):
    x = torch.cat([edge_values(fmt) * scale, random_values(20_000, seed=int(scale * 1000) + 3)])
    request = ints(0, format_code(fmt.name, CPU), x.numel()) + struct.pack("<f", scale) + raw(x)
    got = torch.frombuffer(bytearray(ask(runner, request)), dtype=torch.uint8)
    want = torch_codes(x, torch.tensor([scale]), fmt)
    mismatch = (got != want).nonzero().flatten()
    assert mismatch.numel() == 0, f"{mismatch.numel()} mismatches, e.g. x={x[mismatch[:5]].tolist()}"


def runner_attention(runner: Path, case: Case, caches, b) -> torch.Tensor:
    """paged_attention through the runner: its partitions merged as attention.cpp merges them."""
    key_cache, value_cache = caches
    num_seqs, num_heads, d = b["query"].shape
    # the op applies scales to FP8 caches only (model-dtype values are stored as they are)
    scales = [s.expand(case.kv_heads).float() if case.kv != "auto" else torch.ones(case.kv_heads)
              for s in (b["k_scale"], b["v_scale"])]
    request = ints(2, format_code(case.kv, CPU), CACHE_DTYPES[case.dtype], num_seqs, num_heads, case.kv_heads, d, case.block_size,
                   key_cache.shape[0], b["table"].shape[1], b["alibi"] is not None)
    request += struct.pack("<f", d ** -0.5) + raw(scales[0]) + raw(scales[1])
    if b["alibi"] is not None:
        request += raw(b["alibi"].float())
    request += raw(key_cache) + raw(value_cache) + raw(b["table"]) + raw(b["seq_lens"]) + raw(b["query"].float())
    answer = torch.frombuffer(bytearray(ask(runner, request)), dtype=torch.float32)
    out = torch.zeros(num_seqs, num_heads, d)
    at = 0
    for s, n in enumerate(case.seq_lens):
        parts = -(-n // PARTITION)
        if parts == 0:
            continue
        rows = answer[at:at + parts * num_heads * (d + 2)].view(parts, num_heads, d + 2)
        at += rows.numel()
        part_out, part_max, part_sum = rows[..., :d], rows[..., d], rows[..., d + 1]
        weight = part_sum * torch.exp(part_max - part_max.max(dim=0).values)
        out[s] = (weight[..., None] * part_out).sum(dim=0) / weight.sum(dim=0)[..., None]
    assert at == answer.numel()
    return out


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_attention_matches_reference(runner, case):
    b = build(case)
    want = attention(ref, case, b["ref_caches"], b)
    got = runner_attention(runner, case, b["ref_caches"], b)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    err = attention_error(got, want)
    assert err <= tolerance(case.dtype), f"max error {err:.2e} of the output scale"
