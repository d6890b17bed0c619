"""The faster CPU model dtype: the CPU's features pick bfloat16 where it multiplies bfloat16 natively; elsewhere
a measurement, kept per machine, decides. --dtype auto on a CPU is that choice, and the startup line says why."""

from __future__ import annotations

import pytest
import torch

from fp8cache.model.cpu import dtype_probe, packed_linear
from fp8cache.platform import model_dtype

pytestmark = pytest.mark.real_auto_dtype

EPYC_ZEN4 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vbmi"}
XEON_AMX = {"avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16"}
AVX2_ONLY = {"avx", "avx2", "fma"}
ARM_BF16 = {"fp", "asimd", "bf16", "sve"}
ARM_PLAIN = {"fp", "asimd"}


def never_measured() -> bool:
    pytest.fail("the features decide: nothing to measure")


@pytest.mark.parametrize("features,reason", [(XEON_AMX, "AMX-BF16"), (EPYC_ZEN4, "AVX512-BF16"),
                                             (ARM_BF16, "Arm BF16")])
def test_native_bfloat16_picks_bfloat16_without_measuring(features, reason):
    choice = model_dtype.choose(features, never_measured)
    assert choice.dtype == torch.bfloat16
    assert reason in choice.reason and reason in choice.describe()


@pytest.mark.parametrize("features", [AVX2_ONLY, ARM_PLAIN, set()])
@pytest.mark.parametrize("faster", [True, False])
def test_without_native_bfloat16_the_measurement_decides(features, faster):
    asked = []
    choice = model_dtype.choose(features, lambda: asked.append(1) or faster)
    assert asked == [1]
    assert choice.dtype == (torch.bfloat16 if faster else torch.float32)
    assert "measured" in choice.reason


def test_the_measurement_races_the_engines_kernels_for_each_dtype(monkeypatch):
    """measure_bfloat16_faster times, at the probe's shapes, what pack_linears would run for each dtype (fp8kv's
    panels where they run, else F.linear), and follows the times it sees."""
    seen = []

    def race(candidates, shapes):
        assert shapes == frozenset(dtype_probe._SHAPES)
        seen.append([dtype for _, dtype in candidates])
        linear = torch.nn.Linear(8, 4)
        for make, dtype in candidates:
            want = packed_linear.engine_linear(dtype)(linear.to(dtype))
            assert type(make(linear.to(dtype))) is type(want)
        return [slow if dtype == torch.float32 else 1.0 for _, dtype in candidates]

    monkeypatch.setattr(packed_linear, "race", race)
    slow = 2.0
    assert dtype_probe.measure_bfloat16_faster() is True
    slow = 0.5
    assert dtype_probe.measure_bfloat16_faster() is False
    assert seen == [[torch.float32, torch.bfloat16]] * 2


def test_this_machine_gets_an_answer_once(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(tmp_path))
    dtype_probe.cpu_auto_dtype.cache_clear()
    try:
        first = dtype_probe.cpu_auto_dtype()
        assert first.dtype in (torch.float32, torch.bfloat16)
        assert dtype_probe.cpu_auto_dtype() is first
    finally:
        dtype_probe.cpu_auto_dtype.cache_clear()


def test_auto_is_the_faster_dtype_and_the_startup_line_says_why(monkeypatch):
    from fp8cache.model.loader import resolve_dtype

    cpu = torch.device("cpu")
    zen4 = lambda: model_dtype.choose(EPYC_ZEN4, never_measured)
    assert model_dtype.auto_dtype(cpu, torch.float32, zen4) == torch.bfloat16
    assert model_dtype.auto_dtype(cpu, torch.bfloat16, zen4) == torch.bfloat16
    line = model_dtype.describe("auto", cpu, torch.bfloat16, zen4)
    assert line.startswith("bfloat16 (auto: this CPU multiplies bfloat16 natively") and "AVX512-BF16" in line
    assert model_dtype.describe("bfloat16", cpu, torch.bfloat16, zen4) == "bfloat16 (--dtype bfloat16)"
    slow_bf16 = lambda: model_dtype.choose(AVX2_ONLY, lambda: False)
    assert model_dtype.auto_dtype(cpu, torch.bfloat16, slow_bf16) == torch.float32
    assert "float32 measured faster" in model_dtype.describe("auto", cpu, torch.float32, slow_bf16)
    # The loader asks this machine's probe, at the time of the call.
    monkeypatch.setattr(dtype_probe, "cpu_auto_dtype", lambda: model_dtype.choose(AVX2_ONLY, lambda: True))
    assert resolve_dtype("auto", "cpu", torch.float32) == torch.bfloat16
    gpu = torch.device("meta")
    assert model_dtype.auto_dtype(gpu, torch.float16, never_measured) == torch.float16
    assert model_dtype.auto_dtype(gpu, torch.float32, never_measured) == torch.bfloat16
    with pytest.raises(ValueError, match="not supported on CPU"):
        resolve_dtype("float16", "cpu")


@pytest.mark.slow
def test_the_readme_question_with_this_machines_auto_dtype(default_model_path):
    """End to end with the dtype --dtype auto picks on this machine: the README's question gets the same greedy
    answer over an FP8 cache as over the model-dtype cache (bfloat16 logits once tied its first token)."""
    from fp8cache import LLM, SamplingParams

    question = [[{"role": "user", "content": "What is the capital of France?"}]]
    params = SamplingParams(temperature=0, max_tokens=12)
    answers = {}
    for cache in ("fp8", "auto"):
        with LLM(default_model_path, kv_cache_dtype=cache, device="cpu") as llm:
            assert llm.engine.runner.dtype == dtype_probe.cpu_auto_dtype().dtype
            answers[cache] = llm.chat(question, params, use_tqdm=False)[0].outputs[0].text
    assert answers["fp8"] == answers["auto"] and "Paris" in answers["fp8"]
