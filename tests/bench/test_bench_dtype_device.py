"""The benches resolve a kv-cache-dtype for the device they run on: plain "fp8" is the format that device's
hardware converts (vLLM's convention: e4m3fn on CPUs and NVIDIA GPUs, e4m3fnuz on AMD's), not the CPU's."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from fp8cache.bench.throughput import check_kv_cache_dtypes
from launcher.cli import main


def test_fp8_is_the_cpus_native_format_on_the_cpu():
    assert check_kv_cache_dtypes(["fp8", "auto", "fp8_e4m3", "fp8_e5m2"], "cpu") == ["fp8_e4m3", "auto", "fp8_e5m2"]


@pytest.mark.parametrize(("hip", "native"), [(None, "fp8_e4m3"), ("6.2", "fp8_e4m3fnuz")])
def test_fp8_is_the_gpus_native_format_on_a_gpu(monkeypatch, hip, native):
    monkeypatch.setattr(torch.version, "hip", hip)
    assert check_kv_cache_dtypes(["fp8"], torch.device("meta")) == [native]  # meta stands in for a GPU


def test_an_unknown_dtype_names_the_valid_ones():
    with pytest.raises(ValueError, match="fp8_e5m2"):
        check_kv_cache_dtypes(["fp9"], "cpu")


def test_the_bench_command_refuses_an_unknown_dtype_before_loading():
    result = CliRunner().invoke(main, ["bench", "throughput", "--device", "cpu", "--kv-cache-dtype", "fp9"])
    assert result.exit_code == 2 and "fp9" in result.output and "--kv-cache-dtype" in result.output
