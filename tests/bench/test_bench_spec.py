"""Speculative decoding's surfaces: `bench throughput --speculative-config/--workload`, the CLI flag of run,
generate and systemd-unit, and the /metrics counters (vLLM's names)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from fp8cache.bench import throughput
from fp8cache.bench.prompts import REPEAT_CUE, PromptSource
from fp8cache.server.metrics import ServerMetrics
from launcher import bench as bench_commands
from launcher.cli import main
from launcher.options import ENGINE_DEFAULTS, engine_config

SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_repeat_prompts_repeat_the_start_of_their_passage(default_tokenizer):
    prompts = PromptSource(default_tokenizer).take_repeat(3, 80)
    windows = PromptSource(default_tokenizer).take(3, 80 - REPEAT_CUE - 1)
    gap = default_tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    assert len(gap) == 1
    assert prompts == [w + gap + w[:REPEAT_CUE] for w in windows]
    with pytest.raises(ValueError, match="needs more than"):
        PromptSource(default_tokenizer).take_repeat(1, 12)


def test_spec_rows_pair_with_their_plain_rows():
    variants = throughput.cache_variants(["auto", "fp8_e4m3"], [32], {"num_speculative_tokens": 2})
    assert list(variants) == ["auto", "auto ngram", "fp8_e4m3", "fp8_e4m3 ngram"]
    assert variants["fp8_e4m3 ngram"]["speculative_config"] == {"num_speculative_tokens": 2}
    assert "speculative_config" not in variants["fp8_e4m3"]
    rows = [{"engine": "fp8kv", "kv_cache_dtype": k, "variant": v, "output_tokens_per_s": s, "kv_recent_window": 32}
            for k, v, s in [("auto", "auto", 10.0), ("auto", "auto ngram", 25.0), ("fp8_e4m3", "fp8_e4m3", 8.0),
                            ("fp8_e4m3", "fp8_e4m3 ngram", 20.0)]]
    throughput.add_ratios(rows)
    assert [r.get("vs_no_spec") for r in rows] == [None, 2.5, None, 2.5]
    assert [r["vs_auto"] for r in rows] == [1.0, 2.5, 0.8, 2.0]


def test_a_bad_speculative_config_fails_before_loading_anything():
    for command, args in ((bench_commands.throughput, []), (main, ["generate", "hi"]), (main, ["run"])):
        result = CliRunner().invoke(command, [*args, "--speculative-config", '{"method": "eagle"}'])
        assert result.exit_code == 2, result.output
        assert "--speculative-config" in result.output and "ngram" in result.output
    result = CliRunner().invoke(bench_commands.throughput, ["--workload", "poetry"])
    assert result.exit_code == 2 and "repeat" in result.output


def test_the_flag_reaches_the_engine_config_and_a_unit_file():
    kw = ENGINE_DEFAULTS | {"device": "cpu", "speculative_config": SPEC}  # the flags at their defaults
    assert engine_config(None, kw).speculative_config == SPEC
    result = CliRunner().invoke(main, ["systemd-unit", "--device", "cpu", "--speculative-config", SPEC])
    assert result.exit_code == 0, result.output
    exec_line = next(line for line in result.output.splitlines() if line.startswith("ExecStart="))
    assert "--speculative-config" in exec_line and "num_speculative_tokens" in exec_line


def test_metrics_counters_follow_the_engine_totals():
    metrics = ServerMetrics("m", "fp8")
    for drafted, accepted in ((10, 4), (10, 4), (17, 9)):
        metrics.observe_engine({"spec_decode_num_draft_tokens": drafted, "spec_decode_num_accepted_tokens": accepted})
    text = metrics.render().decode()
    assert 'fp8kv_spec_decode_num_draft_tokens_total{kv_cache_dtype="fp8",model_name="m"} 17.0' in text
    assert 'fp8kv_spec_decode_num_accepted_tokens_total{kv_cache_dtype="fp8",model_name="m"} 9.0' in text


@pytest.mark.slow
def test_throughput_with_speculation_reports_acceptance(default_model_path):
    args = [default_model_path, "--num-prompts", "2", "--input-len", "64", "--output-len", "16", "--threads", "1",
            "--kv-cache-dtype", "fp8_e4m3", "--kv-cache-memory", "32MiB", "--workload", "repeat",
            "--speculative-config", SPEC, "--json"]
    result = CliRunner().invoke(bench_commands.throughput, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["variant"] for r in rows] == ["fp8_e4m3", "fp8_e4m3 ngram"]
    plain, spec = rows
    assert plain["output_tokens"] == spec["output_tokens"] == 2 * 16
    assert "spec_acceptance_rate" not in plain
    assert 0 < spec["spec_accepted_tokens"] <= spec["spec_draft_tokens"]
    assert spec["spec_acceptance_rate"] == pytest.approx(spec["spec_accepted_tokens"] / spec["spec_draft_tokens"])
    assert spec["vs_no_spec"] == pytest.approx(spec["output_tokens_per_s"] / plain["output_tokens_per_s"])
