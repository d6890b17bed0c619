"""The GPU sources compile: CUDA kernels for sm_80 and sm_90, the CUDA torch bindings, the kernels as HIP for
gfx90a (gfx940 analysed), and the kernels as torch's hipify rewrites them for a ROCm build.

Nothing is run on a GPU (there is none here); scripts/compile_check.sh does the compiling and prints the
commands it ran. A target is skipped, with the script's reason, only when its compiler (or, for the
bindings, a CUDA torch wheel to take headers from; for hipify, torch) is missing.
Also here: the tensor-core kernels' registers and shared memory from ptxas's report, held to the plan.
"""

from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import compile_ahead
import pytest
import torch
from test_cuda_host_emulation import load_emulation
from test_cuda_tensor_core_emulation import tc_plan

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compile_check.sh"
SKIPPED = 77


TARGETS = ["cuda-kernels", "cuda-bindings", "hip-kernels", "hip-hipify"]  # longest first (about 240, 65, 100, 10 s)


def _compile(target: str) -> subprocess.CompletedProcess:
    ahead = compile_ahead.result(target, timeout=2400)  # started with the run (tests/compile_ahead.py)
    if ahead is not None:
        return subprocess.CompletedProcess([str(SCRIPT), target], ahead[0], ahead[1], "")
    # One stream, as compile-ahead keeps it: a unit's report follows the command line echoed before it.
    done = subprocess.run(["bash", str(SCRIPT), target], check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=1500)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout, "")


@pytest.fixture(scope="module")
def compiles(request) -> dict[str, Future]:
    """The selected targets' compiles, started together, as many at a time as there are cores: each is one
    single-threaded compiler after another, so on 2 cores the four take ~200 s instead of ~365 s one by one.
    The targets share nothing but the unzipped CUDA torch headers, which only cuda-bindings uses."""
    wanted = {item.callspec.params.get("target", "cuda-kernels") for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(wanted), len(os.sched_getaffinity(0)))))
    futures = {target: pool.submit(_compile, target) for target in TARGETS if target in wanted}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_gpu_sources_compile(target: str, compiles: dict[str, Future]) -> None:
    done = compiles[target].result()
    output = done.stdout + done.stderr
    if done.returncode == SKIPPED:
        reason = next((ln for ln in output.splitlines() if ln.startswith("SKIP")), output.strip())
        pytest.skip(reason)
    assert done.returncode == 0, f"compile check {target!r} failed:\n{output[-20000:]}"
    assert f"ok: {target}" in output


def test_unknown_target_is_refused() -> None:
    done = subprocess.run(["bash", str(SCRIPT), "metal"], check=False, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "usage:" in done.stderr


# ---- the tensor-core kernels' resources, from ptxas's report in cuda-kernels' output ----------------------

_UNIT = re.compile(r"^\+ .*/(kernels_\w+\.cu) ")  # the command line run_timed echoes before each compile
_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
_CONFIG = re.compile(r"TcConfigI(\w+?)LNS_9Fp8FormatE(\d)ELi(\d+)ELi(\d+)ELb(\d)E")
_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STATIC_SMEM = re.compile(r"(\d+) bytes smem")


def resource_report(output: str, unit: str) -> dict[tuple[int, int, bool], dict[str, int]]:
    """{(dims, head slots, float32 halves): registers, spilled bytes, static shared memory} of one unit's
    tensor-core kernels for sm_90."""
    report, current, in_unit = {}, None, False
    for line in output.splitlines():
        if m := _UNIT.search(line):
            in_unit, current = m.group(1) == unit, None
        elif not in_unit:
            continue
        elif m := _ENTRY.search(line):
            config = _CONFIG.search(m.group(1))
            current = None
            if config and m.group(2) == "sm_90":
                current = (int(config.group(3)), int(config.group(4)), config.group(5) == "1")
                report[current] = {}
        elif current is not None and (m := _SPILL.search(line)):
            report[current]["spilled"] = int(m.group(1)) + int(m.group(2))
        elif current is not None and (m := _USED.search(line)):
            report[current]["registers"] = int(m.group(1))
            smem = _STATIC_SMEM.search(line)
            report[current]["static_smem"] = int(smem.group(1)) if smem else 0
    return report


# Registers the design leaves each kernel (dims, head slots, split float32 halves): enough that registers never
# hold fewer blocks an SM than the shared memory does (at 128 threads: 65536 / (128 * regs)).
REGISTER_CEILINGS = {(64, 8, False): 168, (64, 16, False): 168, (64, 8, True): 168, (64, 16, True): 168,
                     (128, 8, False): 168, (128, 16, False): 255, (128, 8, True): 168, (128, 16, True): 255,
                     (256, 8, False): 255}


@pytest.mark.slow
@pytest.mark.parametrize("unit,kv", [("kernels_attention_tc_e4m3.cu", "fp8_e4m3"),
                                     ("kernels_attention_tc_bf16.cu", "auto")])
def test_compiled_kernels_fit_the_plan(unit: str, kv: str, compiles: dict[str, Future]) -> None:
    """docs/design.md section 9: no spills, no static shared memory, and registers that keep as many blocks an
    SM as the plan's shared memory does (the plan from the host emulation, the same code the GPU runs)."""
    done = compiles["cuda-kernels"].result()
    if done.returncode == SKIPPED:
        pytest.skip("nvcc not found: the kernels' resources come from its report")
    assert done.returncode == 0, f"compile check cuda-kernels failed:\n{(done.stdout + done.stderr)[-20000:]}"
    report = resource_report(done.stdout + done.stderr, unit)
    assert report, f"no tensor-core kernel of {unit} for sm_90 in nvcc's report"
    emu = load_emulation("shared")
    for (dims, heads, precise), used in report.items():
        assert used["spilled"] == 0, (dims, heads, precise, used)
        assert used["static_smem"] == 0, "all shared memory is the plan's dynamic memory"
        assert used["registers"] <= REGISTER_CEILINGS[(dims, heads, precise)], (dims, heads, precise, used)
        plan = tc_plan(emu, torch.float32 if precise else torch.bfloat16, kv, dims, heads)
        if plan["stages"] == 0:
            continue
        per_thread = (used["registers"] + 7) // 8 * 8
        by_registers = 65536 // (per_thread * 128)
        assert by_registers >= plan["blocks_per_sm"], (dims, heads, precise, used, plan)


# ---- a check that passed is replayed for the same inputs, never a failure --------------------------------------

STUB_NVCC = """#!/bin/sh
echo "$*" >> "$STUB_LOG"
[ "$1" = "--version" ] && { echo "stub nvcc $STUB_VERSION"; exit 0; }
exit "$STUB_STATUS"
"""


def test_a_check_is_compiled_again_only_when_its_inputs_change(tmp_path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(STUB_NVCC)
    nvcc.chmod(0o755)
    log = tmp_path / "calls.log"

    def check(archs: str = "90", status: int = 0, version: str = "1.0", cache: str = "1") -> tuple[int, str, int]:
        env = {**os.environ, "NVCC": str(nvcc), "STUB_LOG": str(log), "STUB_STATUS": str(status),
               "STUB_VERSION": version, "CUDA_ARCHS": archs, "FP8KV_CACHE_DIR": str(tmp_path / "cache"),
               "FP8KV_COMPILE_CHECK_CACHE": cache}
        before = log.read_text().count("-c ") if log.exists() else 0
        done = subprocess.run(["bash", str(SCRIPT), "cuda-kernels"], env=env, capture_output=True, text=True,
                              timeout=120, check=False)
        return done.returncode, done.stdout, log.read_text().count("-c ") - before

    units = len(list((SCRIPT.parents[1] / "csrc" / "cuda").glob("kernels_*.cu"))) + 1  # and hadamard_kernels.cu
    assert check(status=1)[::2] == (1, units)          # a failure is not kept: compiled again next time
    code, out, compiled = check()
    assert (code, compiled) == (0, units) and "cached:" not in out
    code, replayed, compiled = check()
    assert (code, compiled) == (0, 0) and replayed.startswith("cached: check_cuda_kernels passed on these inputs")
    assert out in replayed and "ok: cuda-kernels" in replayed  # what the tests read, as it was
    assert check(archs="80 90")[::2] == (0, units + 1)  # other settings (sm_80: one unit), another compiler
    assert check(version="2.0")[::2] == (0, units)
    assert check(cache="0")[::2] == (0, units)
