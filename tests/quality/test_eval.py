"""fp8cache.quality.eval.evaluate: decode-faithful quality of an FP8 cache against the auto cache."""

from __future__ import annotations

import math

import pytest
import torch

from fp8cache.config import EngineConfig
from fp8cache.quality.eval import evaluate, locate_eval_text, read_text

KEYS = {"kv_cache_dtype", "device", "ppl", "baseline_ppl", "kl", "top1_agreement", "tokens", "windows", "scales_source",
        "kv_recent_window", "kv_recent_window_sinks", "kv_recent_window_dtype", "kv_cache_dtype_skip_layers",
        "saturation"}


def transformers_ppl(model_path: str, windows: int, window_len: int) -> float:
    """Perplexity of the same windows from transformers' own forward (no cache involved)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    ids = tokenizer(read_text(locate_eval_text()))["input_ids"]
    nll, count = 0.0, 0
    for w in range(windows):
        window = torch.tensor([ids[w * window_len:(w + 1) * window_len]])
        with torch.no_grad():
            logits = model(window).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum").item()
        count += window_len - 1
    return math.exp(nll / count)


@pytest.mark.slow
def test_fp8_e4m3_eval_is_close_to_baseline(default_model_path):
    result = evaluate(EngineConfig(model=default_model_path, kv_cache_dtype="fp8_e4m3"), windows=2,
                      window_len=96, progress=False)
    assert set(result) == KEYS
    assert result["kv_cache_dtype"] == "fp8_e4m3" and result["windows"] == 2 and result["tokens"] == 2 * 95
    assert result["scales_source"] == "default 1.0"
    assert result["baseline_ppl"] == pytest.approx(transformers_ppl(default_model_path, 2, 96), rel=1e-4)
    assert result["ppl"] == pytest.approx(result["baseline_ppl"], rel=0.05)
    assert 0 < result["kl"] < 0.05
    assert 0.85 <= result["top1_agreement"] <= 1


@pytest.mark.slow
def test_recent_window_as_long_as_the_text_has_no_divergence(default_model_path):
    """Every position then reads all of its context in full precision: the FP8 copies are never read."""
    whole = evaluate(EngineConfig(model=default_model_path, kv_cache_dtype="fp8_e5m2", kv_recent_window=64),
                     windows=1, window_len=64, progress=False)
    part = evaluate(EngineConfig(model=default_model_path, kv_cache_dtype="fp8_e5m2", kv_recent_window=8),
                    windows=1, window_len=64, progress=False)
    plain = evaluate(EngineConfig(model=default_model_path, kv_cache_dtype="fp8_e5m2", kv_recent_window=0),
                     windows=1, window_len=64, progress=False)
    assert whole["kv_recent_window"] == 64 and abs(whole["kl"]) < 1e-6 and whole["top1_agreement"] == 1
    assert 0 < part["kl"] < plain["kl"]


@pytest.mark.slow
def test_eval_reads_the_sinks_it_reports(default_model_path):
    """The window's attention sinks (the default 1) change what the rows past the window read, and eval says how
    many it kept; a window as long as the text leaves none to read (its first positions are in it already)."""
    config = EngineConfig(model=default_model_path, kv_cache_dtype="fp8_e5m2", kv_recent_window=8)
    sinks = evaluate(config, windows=1, window_len=48, progress=False)
    none = evaluate(EngineConfig(**{**config.__dict__, "kv_recent_window_sinks": 0}), windows=1, window_len=48,
                    progress=False)
    assert (sinks["kv_recent_window_sinks"], none["kv_recent_window_sinks"]) == (1, 0)
    assert sinks["kl"] != none["kl"] and 0 < sinks["kl"]


def test_eval_sizes_the_window_a_scales_file_records(tmp_path, default_model_path):
    """A scales file made for a window wider than the default: eval uses it, and the cache has room for it."""
    from fp8cache.kvcache.scale_files import write_scales_file
    from fp8cache.kvcache.scales import KVScales

    ones = [torch.ones(3) for _ in range(30)]  # the default model: 30 layers, 3 KV heads
    path = tmp_path / "scales.json"
    write_scales_file(path, KVScales(ones, ones, "fp8_e4m3", "test", recent_window=48), "llama", 3)
    config = EngineConfig(model=default_model_path, kv_cache_dtype="fp8_e4m3", quantization_param_path=str(path))
    recorded = evaluate(config, windows=1, window_len=64, progress=False)
    given = evaluate(EngineConfig(model=default_model_path, kv_cache_dtype="fp8_e4m3", kv_recent_window=48),
                     windows=1, window_len=64, progress=False)
    assert recorded["kv_recent_window"] == 48 and recorded["scales_source"] == f"file {path}"
    assert recorded["kl"] == pytest.approx(given["kl"], rel=1e-6, abs=1e-9)


def test_auto_against_auto_has_no_divergence(default_model_path):
    result = evaluate(EngineConfig(model=default_model_path), windows=1, window_len=64, progress=False)
    assert result["kv_cache_dtype"] == "auto"
    assert abs(result["kl"]) < 1e-6 and result["top1_agreement"] == 1
    assert result["ppl"] == pytest.approx(result["baseline_ppl"], rel=1e-6)


def test_eval_with_calculated_scales_reports_them(default_model_path):
    result = evaluate(EngineConfig(model=default_model_path, kv_cache_dtype="fp8_e5m2", calculate_kv_scales=True),
                      windows=1, window_len=64, progress=False)
    assert result["scales_source"].startswith("calculated")
    assert 0 < result["kl"] < 0.2


def test_eval_refuses_bad_input(tmp_path, default_model_path):
    with pytest.raises(ValueError, match="windows"):
        evaluate(EngineConfig(model=default_model_path), windows=0, progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        evaluate(EngineConfig(model=default_model_path), text_path=str(tmp_path / "none.txt"), progress=False)
    short = tmp_path / "short.txt"
    short.write_text("Too short for a window.")
    with pytest.raises(ValueError, match="fewer than windows"):
        evaluate(EngineConfig(model=default_model_path), text_path=str(short), windows=1, window_len=64,
                 progress=False)


def test_eval_command_takes_the_sinks_flag(tiny_llama_path, tmp_path):
    """`fp8kv eval --kv-recent-window-sinks`: the JSON says how many sinks were kept (the default 1, or none)."""
    import json

    from click.testing import CliRunner

    from launcher.cli import main

    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 37} and more{i % 11}" for i in range(400)))
    args = ["eval", tiny_llama_path, "--text", str(text), "--windows", "1", "--window-len", "48", "--device", "cpu",
            "--kv-recent-window", "8", "--json"]
    results = {}
    for extra in ([], ["--kv-recent-window-sinks", "0"], ["--kv-recent-window-sinks", "3"]):
        run = CliRunner().invoke(main, args + extra)
        assert run.exit_code == 0, run.output
        results[tuple(extra)] = json.loads(run.stdout.strip().splitlines()[-1])
    assert [r["kv_recent_window_sinks"] for r in results.values()] == [1, 0, 3]
    assert len({r["kl"] for r in results.values()}) == 3  # the sinks change what rows past the window read
