"""scripts/profile_attention.py, the call gpu_check.sh's `stalls` step profiles, on the CPU: every cache format
gives the reference's attention (--check), so the call a profiler catches computes the right thing."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from script_module import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_attention.py"


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "auto"])
def test_the_profiled_call_matches_the_reference(kv, monkeypatch, capsys):
    script = load_script("profile_attention.py")
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--device", "cpu", "--batch", "3", "--context", "77",
                                      "--heads", "6/2/64", "--kv-cache-dtype", kv, "--check"])
    script.main()
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"3 calls, 3 x 77, 6/2/64, {kv}; max error "), line
    error = float(re.search(r"max error (\S+) of the output scale", line).group(1))
    assert error <= 1.6e-2  # bfloat16 queries and outputs (tests/ops/test_ops_cpu.py's tolerance)
