"""Where a bench run's time goes (bench throughput and capacity's step figures: prefill and decode steps, the
decode step's time and batch, the peak of sequences run at once), on random weights from a config alone.

No test reads a real clock's value: the step figures are checked against an injected clock, the engine's own
step and token counts, and what the requests asked for.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fp8cache.bench import capacity, throughput
from fp8cache.bench.throughput import StepTimes

REPO = Path(__file__).resolve().parents[2]
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 600, "max_position_embeddings": 512, "bos_token_id": 300, "eos_token_id": 301,
        "tie_word_embeddings": False}
THREADS = ["--threads", "1"]


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("config-only")
    (folder / "config.json").write_text(json.dumps(TINY))
    return str(folder)


def test_step_times_split_prefill_from_decode():
    steps = StepTimes()
    for seconds, prefill_tokens, generated in ((0.5, 64, 2), (0.25, 16, 3), (0.01, 0, 3), (0.03, 0, 3),
                                               (0.02, 0, 2), (0.04, 0, 1)):
        steps.add(seconds, prefill_tokens, generated)
    figures = steps.figures(elapsed_s=1.0)
    assert (figures["steps"], figures["prefill_steps"], figures["decode_steps"]) == (6, 2, 4)
    assert figures["prefill_s"] == pytest.approx(0.75) and figures["decode_s"] == pytest.approx(0.10)
    assert figures["decode_step_ms"] == pytest.approx(20.0)  # the lower middle of 10, 20, 30, 40 ms
    assert figures["decode_batch"] == pytest.approx(9 / 4)
    assert figures["other_s"] == pytest.approx(0.15)
    assert StepTimes().figures(0.0)["decode_step_ms"] is None


def _engine(tiny_config: str, **config):
    from fp8cache.config import EngineConfig
    from fp8cache.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=tiny_config, load_format="dummy", dtype="float32", device="cpu",
                                  kv_cache_memory="4MiB", **config), log=lambda m: None)


def _ticks():
    """A clock that advances one second a call."""
    now = iter(range(10_000))
    return lambda: float(next(now))


@pytest.mark.parametrize("budget", [4096, 16])
def test_run_batch_times_each_step_with_the_clock_it_is_given(tiny_config, budget):
    """Every step lasts one tick of the injected clock, so each kind's seconds are its step count; the counts
    are the engine's own, the tokens those asked for. With a 16-token step budget, two 24-token prompts take at
    least three prefill steps (chunked prefill)."""
    engine = _engine(tiny_config, max_num_batched_tokens=budget)
    prompts = [list(range(10, 34)), list(range(50, 74))]
    steps_before = engine.stats.num_steps
    result = throughput.run_batch(engine, prompts, 5, clock=_ticks())
    figures = throughput.step_figures(result)
    assert figures["steps"] == engine.stats.num_steps - steps_before
    assert figures["prefill_steps"] >= (1 if budget > 48 else 3)
    assert figures["prefill_s"] == figures["prefill_steps"] and figures["decode_s"] == figures["decode_steps"]
    assert figures["decode_step_ms"] == 1000.0
    assert result.elapsed_s == figures["steps"] + 1  # the ticks of the steps, and one for the submission
    assert figures["other_s"] == 1.0
    assert result.output_tokens == 2 * 5 and figures["peak_running"] == 2
    assert figures["decode_batch"] * figures["decode_steps"] <= result.output_tokens
    if budget > 48:  # one prefill step gave each its first token; every decode step ran both
        assert figures["decode_batch"] == 2.0 and figures["decode_steps"] == 4


def test_throughput_rows_say_where_the_time_went(tiny_config):
    from launcher import bench as bench_commands

    args = [tiny_config, "--load-format", "dummy", "--num-prompts", "3", "--input-len", "24", "--output-len", "6",
            "--kv-cache-dtype", "auto,fp8_e4m3", "--compare", "hf", "--kv-cache-memory", "4MiB", "--max-model-len",
            "64", "--device", "cpu", "--dtype", "float32", *THREADS, "--json"]
    result = CliRunner().invoke(bench_commands.throughput, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["engine"], r["kv_cache_dtype"]) for r in rows] == [
        ("fp8kv", "auto"), ("fp8kv", "fp8_e4m3"), ("transformers", "auto")]
    for r in rows[:2]:
        assert r["output_tokens"] == 3 * 6 and r["steps"] == r["prefill_steps"] + r["decode_steps"]
        assert r["prefill_s"] + r["decode_s"] + r["other_s"] == pytest.approx(r["elapsed_s"])
        assert 1 <= r["peak_running"] <= 3 and 0 < r["decode_batch"] <= 3
        assert r["decode_steps"] >= 6 - 1  # every token after a sequence's first comes from a step of its own
    assert "steps" not in rows[2] and "peak_running" not in rows[2]  # generate() reports no steps
    result = CliRunner().invoke(bench_commands.throughput, [*args[:-1], "--max-model-len", "16"])
    assert result.exit_code == 2 and "max_model_len=16 is shorter than a request (24 + 6 tokens)" in result.output


def test_capacity_at_a_budget_that_binds(tiny_config):
    """1 MiB of float32 cache (2 layers x 2 KV heads x 32 x K and V x 4 bytes = 1 KiB a token) holds 64 blocks of
    16: 8 sequences of 128 tokens; FP8 four times as many. Each batch runs whole, without preemption."""
    from launcher import bench as bench_commands

    args = [tiny_config, "--load-format", "dummy", "--kv-cache-memory", "1MiB", "--context", "128",
            "--output-len", "8", "--kv-recent-window", "0", "--device", "cpu", "--dtype", "float32", *THREADS,
            "--json"]
    result = CliRunner().invoke(bench_commands.capacity, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    auto, fp8 = json.loads(result.stdout)
    token_bytes = 2 * TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * TINY["head_dim"]
    for row, element in ((auto, 4), (fp8, 1)):
        assert row["bytes_per_token"] == token_bytes * element
        assert row["max_batch"] == row["batch"] == 2**20 // (16 * token_bytes * element) // (128 // 16)
        assert row["num_preemptions"] == 0 and 1 <= row["peak_running"] <= row["batch"]
        assert row["output_tokens"] == 8 * row["batch"]
        assert row["steps"] == row["prefill_steps"] + row["decode_steps"] and row["decode_step_ms"] > 0
    assert (auto["max_batch"], fp8["max_batch"]) == (8, 32)


def test_the_gpu_runs_capacity_budget_binds_at_the_8b_shape():
    """scripts/gpu_check.sh's capacity step: its KV budget holds 32 bfloat16 sequences of its context at
    Llama-3.1-8B's shape (32 layers x 8 KV heads x 128 x K and V x 2 bytes = 128 KiB a token), and FP8 twice
    as many, so the batch each reaches is set by memory."""
    from fp8cache.kvcache.sizing import parse_memory_size
    from fp8cache.model import shapes

    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    args = re.search(r'^CAPACITY_ARGS="\$\{CAPACITY_ARGS:-(.*)\}"$', script, re.MULTILINE).group(1).split()
    budget = parse_memory_size(args[args.index("--kv-cache-memory") + 1])
    context = int(args[args.index("--context") + 1])
    assert int(args[args.index("--output-len") + 1]) == 128 and context - 128 == 4096  # 4,096-token prompts
    cfg = json.loads((Path(shapes.shape_path("llama-3.1-8b")) / "config.json").read_text())
    token_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 128 * 2
    assert token_bytes == 128 * 2**10
    blocks = budget // (16 * token_bytes)
    assert capacity.max_batch(blocks, 16, context) == 32
    assert capacity.max_batch(2 * blocks, 16, context) == 64  # FP8: half the bytes, twice the blocks
    assert math.ceil(context / 16) * 16 == context


def test_capacity_warms_up_at_the_batch_sizes_it_will_time(tiny_config):
    """On a GPU the warm-up decodes every batch size the timed runs decode at (their CUDA graphs are captured
    before the clock starts): its prompts are short enough to prefill in one step, so the next step decodes
    the whole batch. On a CPU two prompts do."""
    from types import SimpleNamespace

    from fp8cache.bench.prompts import PromptSource

    def runner(kind: str, blocks: int = 16896):
        return SimpleNamespace(device=torch.device(kind), num_blocks=blocks, block_size=16,
                               cache_plan=SimpleNamespace(window_seats=0))

    # The GPU run's budget at Llama-3.1-8B's shape: 8448 bfloat16 blocks, 16896 FP8 ones; 264 blocks a sequence.
    assert capacity.warmup_batches(runner("cuda"), [4224], 256) == [64]
    assert capacity.warmup_batches(runner("cuda", 8448), [4224, 2112], 256) == [32, 64]
    assert capacity.warmup_batches(runner("cuda"), [4224], 48) == [48]  # max_num_seqs caps the batch
    assert capacity.warmup_batches(runner("cpu"), [4224], 256) == [2]

    engine = _engine(tiny_config, max_num_batched_tokens=64)
    before = engine.stats
    capacity._warm_up(engine, PromptSource(engine.tokenizer), 120, [8])
    after = engine.stats
    # 8 prompts of 64 // 8 tokens: one prefill step, then one step decoding all 8 (their second token).
    assert after.num_steps - before.num_steps == 2
    assert after.num_prefill_tokens_computed - before.num_prefill_tokens_computed == 8 * 8
    assert after.num_generated_tokens - before.num_generated_tokens == 8 * 2
