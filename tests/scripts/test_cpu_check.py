"""scripts/cpu_check.sh, the CPU acceptance run: its machine step reports the choices the library makes here,
its kernels step turns `bench kernels` into the two attention targets, its pattern step reports plain-read rates
of the kernels step's block pattern, and a step that fails shows in the summary and the exit status. (The throughput, single-stream and llama.cpp steps take minutes: not run here.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fp8cache import ops
from fp8cache.model.cpu import dtype_probe, packed_linear

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cpu_check.sh"

pytestmark = pytest.mark.slow


def _check(tmp_path: Path, *steps: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": python}
    return subprocess.run(["bash", str(SCRIPT), *steps], env=env, check=False, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.real_auto_dtype
def test_machine_and_kernels_steps(tmp_path):
    done = _check(tmp_path, "machine", "kernels")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (tmp_path / "summary.txt").read_text()
    machine = (tmp_path / "machine.log").read_text()
    assert f"--dtype auto: {dtype_probe.cpu_auto_dtype().describe()}" in machine
    ops.load("cpu")
    features = packed_linear.cpu_features()
    assert f"op library path {features.isa}, AVX512-BF16 dot {features.bf16_dot}, AMX {features.amx}" in machine
    assert re.search(r"^machine +ok ", summary, re.MULTILINE) and re.search(r"^kernels +ok ", summary, re.MULTILINE)

    rows = json.loads((tmp_path / "kernels.json").read_text())
    fp8 = next(r for r in rows if r["kv_cache_dtype"] == "fp8_e4m3")
    bf16 = next(r for r in rows if r["kv_cache_dtype"] == "auto" and r["dtype"] == "bfloat16")
    ratio, share = round(fp8["ms"] / bf16["ms"], 2), round(100 * fp8["kv_gbps"] / fp8["read_bw_gbps"])
    time_row = next(line for line in summary.splitlines() if line.startswith("kernels 8x8192: fp8 / bf16 time"))
    share_row = next(line for line in summary.splitlines() if line.startswith("kernels 8x8192: fp8 KV read"))
    assert f"{ratio:.2f}x" in time_row and time_row.endswith("met" if ratio <= 0.50 else "MISSED")
    assert f"{share}%" in share_row and share_row.endswith("met" if share >= 70 else "MISSED")


def test_pattern_step_reads_the_three_orders(tmp_path):
    """The pattern step builds scripts/block_read_probe.cpp and reports a plain-read rate for each order beside
    the read probe the kernels step divides by."""
    done = _check(tmp_path, "pattern")
    assert done.returncode == 0, done.stdout + done.stderr
    note = (tmp_path / "pattern.note").read_text()
    assert re.search(r"^read probe \(bench kernels\): [0-9.]+ GB/s$", note, re.MULTILINE)
    for order in ("a head's 2 KB slab at a time", "a whole 16 KB block at a time", "the same bytes in address order"):
        rate = re.search(rf"^([0-9.]+) GB/s .*{re.escape(order)}$", note, re.MULTILINE)
        assert rate and float(rate.group(1)) > 0, note


def test_a_failed_step_fails_the_run(tmp_path):
    done = _check(tmp_path, "machine", python=str(tmp_path / "no-such-python"))
    assert done.returncode == 1
    assert re.search(rf"^machine +FAIL .* see {re.escape(str(tmp_path / 'machine.log'))}$", done.stdout, re.MULTILINE)
