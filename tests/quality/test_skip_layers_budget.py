"""`fp8kv calibrate --skip-layers-kl-budget`: on a tiny model whose layer 1 has K and V in the thousands (outlier
channels, as Qwen2-family checkpoints have) and static scales of 1.0, which clip them, the layer to keep in 16 bits
is layer 1; the KL it reports is what `fp8kv eval` measures with that layer skipped."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from click.testing import CliRunner
from outlier_models import add_kv_outliers, random_words_file

from fp8cache.config import EngineConfig
from fp8cache.quality.eval import evaluate
from fp8cache.quality.skip_layers import suggest_skip_layers
from launcher.calibrate import calibrate as calibrate_command

WINDOW = 96
OUTLIER_LAYER = 1


@pytest.fixture(scope="module")
def outlier_model(make_tiny_model) -> str:
    path = make_tiny_model("llama", seed=5, num_hidden_layers=3)
    add_kv_outliers(path, [OUTLIER_LAYER])
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    return random_words_file(tmp_path_factory.mktemp("text"), 4 * WINDOW)


def config(model: str, **fields) -> EngineConfig:
    return EngineConfig(**{"model": model, "kv_cache_dtype": "fp8_e4m3", "dtype": "float32", "kv_recent_window": 0,
                           "device": "cpu", "enable_prefix_caching": False} | fields)


def test_the_outlier_layer_is_the_one_to_skip(outlier_model, text_file):
    suggestion = suggest_skip_layers(config(outlier_model), 0.01, text_path=text_file, windows=2, window_len=WINDOW)
    assert suggestion.ranking[0][0] == OUTLIER_LAYER  # its clipped K/V: the largest error
    assert suggestion.trials[0].skip_layers == () and suggestion.trials[0].kl > 0.01
    assert suggestion.skip_layers == (OUTLIER_LAYER,) and suggestion.within_budget
    assert suggestion.flag == f"--kv-cache-dtype-skip-layers {OUTLIER_LAYER}"
    for trial in suggestion.trials:  # each KL is what eval measures with those layers kept in 16 bits
        measured = evaluate(config(outlier_model, kv_cache_dtype_skip_layers=trial.skip_layers), text_path=text_file,
                            windows=2, window_len=WINDOW, progress=False)
        assert measured["kv_cache_dtype_skip_layers"] == list(trial.skip_layers)
        assert trial.kl == pytest.approx(measured["kl"], rel=1e-4, abs=1e-9)


@pytest.mark.slow
def test_ranking_by_each_layers_own_kl_names_the_outlier_layer(outlier_model, text_file):
    """rank_by="kl": each layer's KL with only it in FP8, which is what eval measures with the others skipped."""
    suggestion = suggest_skip_layers(config(outlier_model), 0.01, text_path=text_file, windows=1, window_len=WINDOW,
                                     rank_by="kl")
    assert suggestion.ranked_by == "kl" and suggestion.ranking[0][0] == OUTLIER_LAYER
    assert suggestion.skip_layers == (OUTLIER_LAYER,)
    alone = dict(suggestion.ranking)[0]
    measured = evaluate(config(outlier_model, kv_cache_dtype_skip_layers=(1, 2)), text_path=text_file, windows=1,
                        window_len=WINDOW, progress=False)
    assert alone == pytest.approx(measured["kl"], rel=1e-4, abs=1e-9)


def test_a_budget_already_met_skips_nothing_and_a_tight_one_skips_more(outlier_model, text_file):
    loose = suggest_skip_layers(config(outlier_model), 10.0, text_path=text_file, windows=1, window_len=WINDOW)
    assert loose.skip_layers == () and loose.flag == "" and len(loose.trials) == 1
    tight = suggest_skip_layers(config(outlier_model), 1e-12, text_path=text_file, windows=1, window_len=WINDOW)
    assert tight.trials[1].skip_layers == (OUTLIER_LAYER,) and OUTLIER_LAYER in tight.skip_layers
    assert [len(t.skip_layers) for t in tight.trials] == list(range(len(tight.trials)))  # one layer added a step
    assert tight.within_budget  # every layer skipped at worst: the auto cache itself


def test_dynamic_scales_are_ranked_by_their_own_error_and_each_kl_is_measured(outlier_model, text_file):
    """Dynamic scales do not clip the outliers, so their KL and ranking are their own: every trial is still what
    eval measures with those layers in 16 bits, and a budget below the first trial keeps adding layers."""
    dynamic = config(outlier_model, kv_scales="dynamic")
    suggestion = suggest_skip_layers(dynamic, 1e-12, text_path=text_file, windows=1, window_len=WINDOW)
    assert sorted(layer for layer, _ in suggestion.ranking) == [0, 1, 2]
    assert all(error > 0 for _, error in suggestion.ranking)
    assert len(suggestion.trials) >= 2 and suggestion.trials[1].skip_layers == (suggestion.ranking[0][0],)
    for trial in suggestion.trials[:2]:
        measured = evaluate(replace(dynamic, kv_cache_dtype_skip_layers=trial.skip_layers), text_path=text_file,
                            windows=1, window_len=WINDOW, progress=False)
        assert trial.kl == pytest.approx(measured["kl"], rel=1e-4, abs=1e-9)
    static = suggest_skip_layers(config(outlier_model), 10.0, text_path=text_file, windows=1, window_len=WINDOW)
    assert suggestion.trials[0].kl < static.trials[0].kl  # scale 1.0 clips the outlier layer; dynamic scales do not


@pytest.mark.parametrize(("budget", "fields", "says"), [
    (0, {}, "must be a number > 0"),
    (0.01, {"kv_cache_dtype": "auto"}, "is not an FP8 cache"),
])
def test_what_cannot_be_suggested_is_refused(outlier_model, text_file, budget, fields, says):
    with pytest.raises(ValueError, match=says):
        suggest_skip_layers(config(outlier_model, **fields), budget, text_path=text_file, windows=1,
                            window_len=WINDOW)


def test_the_command_prints_each_measured_set_and_the_flag(outlier_model, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("FP8KV_EVAL_TEXT", text_file)
    out = tmp_path / "scales.json"
    result = CliRunner().invoke(calibrate_command, [
        outlier_model, "--dataset", text_file, "--num-samples", "2", "--max-seq-len", str(WINDOW), "-o", str(out),
        "--dtype", "float32", "--device", "cpu", "--kv-recent-window", "0", "--skip-layers-kl-budget", "1e-12",
        "--skip-layers-windows", "1"])
    assert result.exit_code == 0, result.output
    measured = re.findall(r"layers in 16 bits: (\S+)\s+KL ([0-9.]+)", result.output)
    assert measured[0][0] == "none" and len(measured) >= 2
    last = measured[-1][0]
    assert f"--kv-cache-dtype-skip-layers {last}" in result.output
    assert re.search(rf"use it: fp8kv run .* --kv-cache-dtype-skip-layers {last}", result.output)


def test_the_command_measures_dynamic_scales_when_asked(outlier_model, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("FP8KV_EVAL_TEXT", text_file)
    args = [outlier_model, "--dataset", text_file, "--num-samples", "2", "--max-seq-len", str(WINDOW), "--dtype",
            "float32", "--device", "cpu", "--kv-recent-window", "0", "--skip-layers-kl-budget", "10",
            "--skip-layers-windows", "1"]
    kls = {}
    for scales in ("static", "dynamic"):
        result = CliRunner().invoke(calibrate_command, [*args, "-o", str(tmp_path / f"{scales}.json"),
                                                        "--skip-layers-kv-scales", scales])
        assert result.exit_code == 0, result.output
        assert f"{scales} scales, ranked by error" in result.output
        kls[scales] = float(re.search(r"layers in 16 bits: none\s+KL ([0-9.]+)", result.output).group(1))
    assert "use it: fp8kv run" in result.output and "--kv-scales dynamic" in result.output
    assert "--quantization-param-path" not in result.output.split("use it:")[1]
    assert kls["dynamic"] != kls["static"]  # measured with other scales, not the file's


@pytest.mark.slow
def test_eval_takes_the_flag_and_shows_the_skipped_layer(outlier_model, text_file):
    from launcher.eval import eval_command

    common = [outlier_model, "--text", text_file, "--windows", "1", "--window-len", str(WINDOW), "--device", "cpu",
              "--kv-recent-window", "0"]
    plain = CliRunner().invoke(eval_command, [*common, "--json"])
    skipped = CliRunner().invoke(eval_command, [*common, "--json", "--kv-cache-dtype-skip-layers", str(OUTLIER_LAYER)])
    assert plain.exit_code == skipped.exit_code == 0, plain.output + skipped.output
    plain, skipped = json.loads(plain.stdout), json.loads(skipped.stdout)
    assert skipped["kv_cache_dtype_skip_layers"] == [OUTLIER_LAYER] and plain["kv_cache_dtype_skip_layers"] == []
    assert skipped["kl"] < plain["kl"] / 4
    assert [r["written"] for r in skipped["saturation"] if r["layer"] == OUTLIER_LAYER] == [0, 0]
    table = CliRunner().invoke(eval_command, [*common, "--per-layer", "--kv-cache-dtype-skip-layers", "1"])
    assert table.exit_code == 0 and re.search(r"1 │\s+K │\s+model dtype", table.output), table.output
