"""Hardware facts (the CPU's name and features, whether a GPU is there, its vendor and compute capability) are
read in fp8cache/platform/ only; the rest of the code asks it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fp8cache.kvcache import formats
from fp8cache.model import fp8_weights
from fp8cache.platform import cpu_info, device

ROOT = Path(__file__).resolve().parents[2]
# Code that reads a fact of the machine (comments and docstrings do not count: they are not code lines).
FACT_READS = re.compile(r'open\("/proc/cpuinfo"|torch\.cuda\.(is_available|get_device_capability|get_device_name)\('
                        r'|torch\.version\.hip')


def fact_reads(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if FACT_READS.search(line) and not line.lstrip().startswith("#")]


def test_device_facts_are_read_only_in_platform():
    found = {}
    for path in [*ROOT.glob("fp8cache/**/*.py"), *ROOT.glob("launcher/**/*.py")]:
        if "platform" not in path.relative_to(ROOT).parts and (lines := fact_reads(path.read_text())):
            found[str(path.relative_to(ROOT))] = lines
    assert not found, f"device facts read outside fp8cache/platform/ (ask platform.device/cpu_info): {found}"


def test_the_scan_sees_a_fact_read():
    assert fact_reads('x = torch.cuda.is_available()\n# torch.version.hip in a comment\nopen("/proc/cpuinfo")') == [
        "x = torch.cuda.is_available()", 'open("/proc/cpuinfo")']


def test_cpu_model_name_is_the_cpuinfo_line():
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    if match is None:
        pytest.skip("no `model name` line in /proc/cpuinfo here")
    assert cpu_info.cpu_model_name() == match.group(1).strip()


def test_kernel_backend_per_device_and_vendor(monkeypatch):
    assert device.kernel_backend(torch.device("cpu")) == formats.backend_of("cpu") == "cpu"
    monkeypatch.setattr(torch.version, "hip", None)
    assert device.kernel_backend(torch.device("meta")) == formats.backend_of(torch.device("meta")) == "cuda"
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert device.kernel_backend(torch.device("cuda", 0)) == formats.backend_of(torch.device("cuda", 0)) == "rocm"


@pytest.mark.parametrize(("capability", "rocm", "supported"), [((8, 9), False, True), ((9, 0), False, True),
                                                                ((8, 0), False, False), ((9, 0), True, False)])
def test_fp8_matmul_support_asks_the_platform(monkeypatch, capability, rocm, supported):
    monkeypatch.setattr(fp8_weights, "compute_capability", lambda d: capability)
    monkeypatch.setattr(fp8_weights, "gpu_name", lambda d: "a stand-in GPU")
    monkeypatch.setattr(fp8_weights, "is_rocm", lambda: rocm)
    ok, why = fp8_weights.fp8_matmul_support(torch.device("cuda", 0))
    assert ok is supported and (rocm or f"sm_{capability[0]}{capability[1]}" in why)
    assert fp8_weights.fp8_matmul_support(torch.device("cpu"))[0] is False
