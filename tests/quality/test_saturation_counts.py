"""Issue 54 item 2: the cache write's saturation counts (kvcache/saturation.py) on the outlier model of
test_dynamic_scales_outliers with scales 1.0, against counts computed independently in torch from the post-RoPE
K/V that transformers' own attention sees; the warning; /metrics; `fp8kv eval`'s per-layer report."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from test_dynamic_scales_outliers import outlier_model, text_file  # noqa: F401  (fixtures)

from fp8cache.config import EngineConfig
from fp8cache.kvcache.formats import FP8_FORMATS
from fp8cache.kvcache.saturation import SaturationCounter, count_lost
from fp8cache.model.batch import SeqChunk, StepBatch
from fp8cache.model.runner import ModelRunner
from fp8cache.ops import reference as reference_ops
from fp8cache.quality.eval import evaluate, window_batch

PROMPT = [1, 5, 9, 12, 30, 4, 7, 19, 23, 2, 16, 8]  # ids within the tiny vocabulary
E4M3_MAX = 448.0


def _runner(path: str, log: list[str], kv_cache_dtype: str = "fp8_e4m3", **config) -> ModelRunner:
    config = EngineConfig(model=path, kv_cache_dtype=kv_cache_dtype, dtype="float32", kv_recent_window=0,
                          enable_prefix_caching=False, device="cpu", max_num_seqs=1, max_model_len=64,
                          kv_cache_memory=1 << 20, **config)
    return ModelRunner(config, log=log.append)


def _reference_kv(path: str, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer the post-RoPE (K, V) [kv_heads, T, d] that transformers' eager attention is handed, when that
    attention reads them through an E4M3 round trip at scale 1.0 as our cache does (so that the layers after the
    first get the same inputs as ours)."""
    import transformers.models.llama.modeling_llama as llama
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    seen, original = [], llama.eager_attention_forward

    def record(module, query, key, value, *args, **kwargs):
        seen.append((key[0].clone(), value[0].clone()))
        key, value = (t.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(t.dtype) for t in (key, value))
        return original(module, query, key, value, *args, **kwargs)

    llama.eager_attention_forward = record
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        llama.eager_attention_forward = original
    return seen


def _reference_counts(x: torch.Tensor) -> tuple[int, int, int]:
    """(written, clipped, flushed to zero) at scale 1.0 in E4M3FN, straight from torch's float8 cast."""
    clipped = int((x.abs() > E4M3_MAX).sum())
    codes = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return x.numel(), clipped, int(((x != 0) & (codes == 0)).sum())


def _reference_relative_mse(x: torch.Tensor) -> float:
    back = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float64)
    return float((back - x.double()).square().sum() / x.double().square().sum())


def _close(ours: int, reference: int) -> bool:
    # Our fused projections and transformers' round differently in the last bit: a value sitting on 448 or on
    # the smallest subnormal's half may land either side.
    return abs(ours - reference) <= 1 + reference // 1000


def test_counts_match_torch_on_the_outlier_model_and_warn_once(outlier_model):  # noqa: F811
    log: list[str] = []
    runner = _runner(outlier_model, log)
    runner.saturation.sample_every = 1
    runner.saturation.measure_error = True
    runner.execute(window_batch(PROMPT, runner.kv_spec.block_size))
    rows = {(r.layer, r.kind): r for r in runner.saturation_counts()}
    reference = _reference_kv(outlier_model, PROMPT)
    assert len(reference) == runner.num_layers and len(rows) == 2 * runner.num_layers
    for layer, (k, v) in enumerate(reference):
        for kind, x in (("k", k), ("v", v)):
            written, clipped, flushed = _reference_counts(x)
            row = rows[layer, kind]
            assert row.written == written
            assert clipped > 0 and _close(row.saturated, clipped), (layer, kind, row, clipped)
            assert _close(row.underflow, flushed), (layer, kind, row, flushed)
            assert row.relative_mse == pytest.approx(_reference_relative_mse(x), rel=1e-3), (layer, kind)
    warnings = [m for m in log if m.startswith("warning: KV cache layer")]
    assert len(warnings) == runner.num_layers and "clip at the fp8_e4m3 maximum" in warnings[0]
    runner.execute(window_batch(PROMPT, runner.kv_spec.block_size))  # counts grow, the warning is not repeated
    assert all(r.written == 2 * rows[r.layer, r.kind].written for r in runner.saturation_counts())
    assert len([m for m in log if m.startswith("warning: KV cache layer")]) == runner.num_layers


def test_decode_steps_are_counted_and_unsampled_steps_are_not(outlier_model):  # noqa: F811
    runner = _runner(outlier_model, [])
    runner.saturation.sample_every = 2
    block = runner.kv_spec.block_size
    runner.execute(window_batch(PROMPT, block))  # step 0: counted
    first = {(r.layer, r.kind): r.written for r in runner.saturation_counts()}
    n = len(PROMPT)

    def decode(position: int) -> StepBatch:
        chunk = SeqChunk(query_len=1, context_len=position + 1, block_table=list(range(-(-(position + 1) // block))))
        return StepBatch(token_ids=[3], positions=[position], slot_mapping=[position], seqs=[chunk])

    runner.execute(decode(n))  # step 1: not counted
    assert {(r.layer, r.kind): r.written for r in runner.saturation_counts()} == first
    runner.execute(decode(n + 1))  # step 2: counted, though the CPU would take it as one whole-layer op
    per_token = runner.num_kv_heads * runner.head_size
    assert all(r.written == first[r.layer, r.kind] + per_token for r in runner.saturation_counts())


def test_a_model_within_its_scales_counts_no_clipping_and_no_warning(tiny_llama_path):
    log: list[str] = []
    runner = _runner(tiny_llama_path, log)
    runner.saturation.sample_every = 1
    runner.execute(window_batch(PROMPT, runner.kv_spec.block_size))
    rows = runner.saturation_counts()
    assert rows and all(r.written > 0 and r.saturated == 0 for r in rows)
    assert not [m for m in log if m.startswith("warning: KV cache layer")]


def test_dynamic_scales_count_no_clipping_and_the_flushes_of_their_own_cache(outlier_model):  # noqa: F811
    """With a scale per token and head nothing clips, but values far below their vector's maximum flush to zero:
    the counts and the error match what the cache itself holds (its codes read back with its own scales)."""
    log: list[str] = []
    runner = _runner(outlier_model, log, kv_scales="dynamic", kv_rotation="none")
    runner.saturation.sample_every, runner.saturation.measure_error = 1, True
    reference = _reference_kv(outlier_model, PROMPT)
    runner.execute(window_batch(PROMPT, runner.kv_spec.block_size))
    rows = {(r.layer, r.kind): r for r in runner.saturation_counts()}
    n = len(PROMPT)
    for layer in range(runner.num_layers):
        key_cache, value_cache = runner.kv_caches[layer]
        k_scales, v_scales = runner.scale_caches[layer]
        k, v = reference_ops.gather_kv(key_cache, value_cache, torch.tensor([0]), n, "fp8_e4m3", torch.ones(1),
                                       torch.ones(1), 0, k_scales, v_scales)  # [T, heads, d], dequantized
        for kind, stored in (("k", k), ("v", v)):
            row = rows[layer, kind]
            assert row.written == stored.numel() and row.saturated == 0, (layer, kind, row)
            exact = reference[layer][0 if kind == "k" else 1].transpose(0, 1)  # [T, heads, d], transformers'
            assert exact.shape == stored.shape
            if layer == 0:  # later layers' inputs went through transformers' own scale-1.0 round trip
                flushed = int(((exact != 0) & (stored == 0)).sum())
                assert flushed > 0 and _close(row.underflow, flushed), (kind, row, flushed)
                error = float((stored.double() - exact.double()).square().sum() / exact.double().square().sum())
                assert row.relative_mse == pytest.approx(error, rel=2e-2), kind
    assert not [m for m in log if m.startswith("warning: KV cache layer")]


def test_the_auto_cache_counts_nothing(outlier_model):  # noqa: F811
    assert _runner(outlier_model, [], kv_cache_dtype="auto").saturation_counts() == []


def test_counter_rejects_a_zero_sample_rate():
    with pytest.raises(ValueError, match="sample_every"):
        SaturationCounter(2, FP8_FORMATS["fp8_e4m3"], "cpu", sample_every=0)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_count_lost_per_head_scales(name):
    fmt = FP8_FORMATS[name]
    x = torch.tensor([[[fmt.max * 3, 1.0, 0.0, -1e-30]], [[fmt.max * 0.5, -fmt.max * 5, 2.0, 0.0]]])  # [2, 1, 4]
    written, clipped, flushed = count_lost(x, torch.tensor([2.0]), fmt).tolist()
    assert (written, clipped, flushed) == (8, 2, 1)  # 3max/2 and -5max/2 clip; -1e-30/2 becomes a zero code


def test_metrics_expose_the_runner_counts(outlier_model):  # noqa: F811
    from fp8cache.server.metrics import ServerMetrics

    runner = _runner(outlier_model, [])
    runner.execute(window_batch(PROMPT, runner.kv_spec.block_size))  # the first step is always counted
    metrics = ServerMetrics("outliers", "fp8_e4m3")
    metrics.watch_saturation(runner.saturation_counts)
    text = metrics.render().decode()
    for row in runner.saturation_counts():
        labels = f'kind="{row.kind}",kv_cache_dtype="fp8_e4m3",layer="{row.layer}",model_name="outliers"'
        assert f"fp8kv_kv_cache_saturated_total{{{labels}}} {float(row.saturated)}" in text
        assert f"fp8kv_kv_cache_written_total{{{labels}}} {float(row.written)}" in text
        assert f"fp8kv_kv_cache_underflow_total{{{labels}}} {float(row.underflow)}" in text
    assert any(row.saturated for row in runner.saturation_counts())


def test_eval_reports_saturation_per_layer(outlier_model, text_file, caplog):  # noqa: F811
    config = EngineConfig(model=outlier_model, kv_cache_dtype="fp8_e4m3", dtype="float32", kv_recent_window=0,
                          enable_prefix_caching=False, device="cpu")
    with caplog.at_level(logging.WARNING):
        result = evaluate(config, text_path=text_file, windows=2, window_len=48, progress=False)
    rows = result["saturation"]
    assert {(r["layer"], r["kind"]) for r in rows} == {(layer, kind) for layer in range(2) for kind in "kv"}
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(outlier_model)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    # every position of both windows, each KV head's whole vector
    assert all(r["written"] == 2 * 48 * hf.num_key_value_heads * head_dim and r["saturated"] > 0 for r in rows)
    assert any("values clip at the fp8_e4m3 maximum" in rec.getMessage() for rec in caplog.records)
    dynamic = evaluate(EngineConfig(model=outlier_model, kv_cache_dtype="fp8_e4m3", dtype="float32",
                                    kv_recent_window=0, kv_scales="dynamic", enable_prefix_caching=False,
                                    device="cpu"), text_path=text_file, windows=1, window_len=48, progress=False)
    assert dynamic["saturation"] and all(r["saturated"] == 0 for r in dynamic["saturation"])  # they cannot clip


def test_eval_command_prints_the_layers_that_lose_values(outlier_model, text_file):  # noqa: F811
    from click.testing import CliRunner

    from launcher.cli import main

    result = CliRunner().invoke(main, ["eval", outlier_model, "--text", text_file, "--windows", "1",
                                       "--window-len", "48", "--device", "cpu", "--kv-recent-window", "0"])
    assert result.exit_code == 0, result.output
    assert "K/V values lost by the cache write" in result.output
    rows = re.findall(r"│\s+(\d+) │\s+([KV]) │\s+(\d+) │\s+(\d+) │", result.output)
    assert sorted((layer, kind) for layer, kind, _, _ in rows) == [("0", "K"), ("0", "V"), ("1", "K"), ("1", "V")]
    assert all(int(clipped) > 0 for *_, clipped in rows)  # both layers, K and V, clip


def test_eval_per_layer_shows_every_layers_error(outlier_model, tiny_llama_path, text_file):  # noqa: F811
    from click.testing import CliRunner

    from launcher.cli import main

    outputs = {}
    for name, path in (("outliers", outlier_model), ("plain", tiny_llama_path)):
        result = CliRunner().invoke(main, ["eval", path, "--text", text_file, "--windows", "1", "--window-len", "48",
                                           "--device", "cpu", "--kv-recent-window", "0", "--per-layer"])
        assert result.exit_code == 0, result.output
        assert "Per layer: K/V quantization error and saturation" in result.output
        rows = re.findall(r"│\s+(\d+) │\s+([KV]) │\s+([0-9.e+-]+) │\s+([0-9.]+)% │", result.output)
        assert sorted((layer, kind) for layer, kind, _, _ in rows) == [("0", "K"), ("0", "V"), ("1", "K"), ("1", "V")]
        outputs[name] = {(layer, kind): (float(mse), float(clipped)) for layer, kind, mse, clipped in rows}
    # values in the thousands clipped at 448 lose far more than a model within its scales
    for key, (mse, clipped) in outputs["outliers"].items():
        assert clipped > 0 and mse > 10 * outputs["plain"][key][0]
    assert all(clipped == 0 for _, clipped in outputs["plain"].values())
