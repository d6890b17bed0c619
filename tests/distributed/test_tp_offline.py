"""Offline tensor parallelism: LLM(tensor_parallel_size=N), `fp8kv generate --num-shard N` and
`fp8kv bench throughput --num-shard N` start ranks 1..N-1 themselves, compute what one process computes,
and leave no worker behind (close, context manager, interpreter exit, or a worker's death)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from transformers import AutoConfig

from fp8cache import LLM, SamplingParams
from fp8cache.config import EngineConfig
from fp8cache.distributed.group import WorkerDiedError
from fp8cache.model.cpu import packed_linear

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["the city of the river was", "a house by the water"]
MAX_NEW_TOKENS = 8
# With a recent-token window every token of these short prompts would stay full precision: 0 makes the
# FP8 cache hold (and attention read) all of them.
CONFIG_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
PLAIN_FP8 = {"kv_recent_window": 0} if "kv_recent_window" in CONFIG_FIELDS else {}


pytestmark = pytest.mark.usefixtures("one_thread_per_rank")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def greedy_tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS))
    return [o.outputs[0].token_ids for o in outs]


def quiet(msg: str) -> None:
    pass


# ---- LLM(tensor_parallel_size=2) --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype,skip_layers", [("auto", ()), ("fp8", ()), ("fp8", (1,))])
def test_two_ranks_give_the_greedy_tokens_of_one(tiny_llama_path, kv_cache_dtype, skip_layers):
    engine = dict(model=tiny_llama_path, kv_cache_dtype=kv_cache_dtype, kv_cache_memory="16MiB", log=quiet,
                  **(PLAIN_FP8 if kv_cache_dtype == "fp8" else {}),
                  **({"kv_cache_dtype_skip_layers": skip_layers} if skip_layers else {}))
    with LLM(tensor_parallel_size=2, **engine) as llm:
        workers = list(llm.tp_group.workers)
        assert [w.rank for w in workers] == [1]
        runner = llm.engine.runner
        # Rank 0 holds half of the 2 KV heads, so its cache does too.
        assert runner.num_kv_heads == 1 and runner.kv_caches[0][0].shape[1] == 1
        if kv_cache_dtype == "fp8":  # layers kept in 16 bits (the workers' configs travel as JSON) hold floats
            assert [k.dtype == torch.uint8 for k, _ in runner.kv_caches] == [i not in skip_layers for i in range(2)]
        got = greedy_tokens(llm, PROMPTS)
    # Closing sent the stop message: the worker left its loop and exited cleanly.
    assert all(w.proc.returncode == 0 and gone(w.proc.pid) for w in workers)
    assert llm.tp_group is None
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS[0])
    single = LLM(**engine)
    assert greedy_tokens(single, PROMPTS) == got
    assert all(len(t) == MAX_NEW_TOKENS for t in got)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["between steps", "inside a step"])
def test_a_dead_worker_is_a_clear_error(tiny_llama_path, where):
    llm = LLM(model=tiny_llama_path, tensor_parallel_size=2, kv_cache_memory="16MiB", log=quiet)
    try:
        group = llm.tp_group
        (worker,) = group.workers
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(60)
        if where == "inside a step":
            # Skip the check before each step: rank 0 then meets the dead worker in the step's collectives.
            group.check_usable = lambda: None
        when = " during a step" if where == "inside a step" else ""
        with pytest.raises(WorkerDiedError, match=r"tensor-parallel rank 1 \(pid \d+\) was killed by "
                                                  rf"SIGKILL{when}; .*close it and start a new one"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2))
        vars(group).pop("check_usable", None)
        with pytest.raises(RuntimeError, match="rank 1 .* was killed by SIGKILL"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2))
    finally:
        llm.close()
    assert not dist.is_initialized()


EXIT_SCRIPT = r"""
import json, sys
from fp8cache import LLM, SamplingParams
llm = LLM(model=sys.argv[1], tensor_parallel_size=2, kv_cache_memory="16MiB", log=print)
# One write: the worker's log relay prints from another thread, between print()'s text and its newline.
sys.stdout.write("WORKERS " + json.dumps([w.proc.pid for w in llm.tp_group.workers]) + "\n")
sys.stdout.flush()
llm.generate("the city of the river was", SamplingParams(max_tokens=2))
# No close(): leaving the interpreter must stop the worker.
"""


@pytest.mark.slow
def test_workers_stop_when_the_process_exits_without_close(tiny_llama_path):
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, tiny_llama_path], cwd=REPO,
                          env=dict(os.environ), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pids = json.loads(re.search(r"WORKERS (\[[\d, ]*\])", proc.stdout).group(1))
    assert len(pids) == 1 and all(gone(pid) for pid in pids)
    assert "[rank 1] rank 1: stopped by rank 0 after" in proc.stdout  # stopped by message, not killed


def test_tensor_parallel_size_that_does_not_divide_the_heads_is_refused(make_tiny_model):
    model = make_tiny_model(num_attention_heads=6, num_key_value_heads=3, hidden_size=384)
    with pytest.raises(ValueError, match=r"does not divide this model's .*3 KV heads"):
        LLM(model=model, tensor_parallel_size=2, kv_cache_memory="16MiB", log=quiet)


# ---- fp8kv generate --num-shard 2 -------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_with_two_shards_prints_the_one_rank_text(tiny_llama_path):
    prompt = PROMPTS[0]
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "generate", tiny_llama_path, prompt,
                           "--num-shard", "2", "--no-chat", "--max-tokens", str(MAX_NEW_TOKENS),
                           "--kv-cache-memory", "16MiB"], cwd=REPO, env=dict(os.environ),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[rank 1] rank 1: stopped by rank 0 after" in proc.stderr
    single = LLM(model=tiny_llama_path, kv_cache_memory="16MiB", log=quiet)
    expected = single.generate(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS))[0]
    assert proc.stdout == expected.outputs[0].text + "\n"


# ---- fp8kv bench throughput --num-shard 2 -----------------------------------------------------------------


@pytest.fixture(params=["probe", "packed"])
def linear_packing(request, monkeypatch):
    """Whether the CPU linears are packed is decided by a timing probe at load; "packed" forces it. The engines
    of one bench share one loaded model, and a packed one holds shape-only meta buffers: the second engine's
    runner used to try to move them (and rank 0's failure then left the workers waiting in a collective)."""
    if request.param == "packed":
        monkeypatch.setattr(packed_linear, "packing_pays", lambda *a: True)
    return request.param


@pytest.mark.slow
def test_bench_throughput_over_two_shards_adds_up(tiny_llama_path, linear_packing):
    from launcher import bench as bench_commands

    num_prompts, input_len, output_len = 2, 8, 4
    result = CliRunner().invoke(bench_commands.throughput, [
        tiny_llama_path, "--num-prompts", str(num_prompts), "--input-len", str(input_len), "--output-len",
        str(output_len), "--kv-cache-dtype", "auto,fp8_e4m3", "--num-shard", "2", "--threads", "1",
        "--kv-cache-memory", "16MiB", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["engine"], r["kv_cache_dtype"], r["num_shard"]) for r in rows] == [
        ("fp8kv", "auto", 2), ("fp8kv", "fp8_e4m3", 2)]
    cfg = AutoConfig.from_pretrained(tiny_llama_path)
    # Per rank: half the KV heads, K and V, every layer; float32 for auto, one byte for FP8.
    kv_values = cfg.num_hidden_layers * 2 * (cfg.num_key_value_heads // 2) * cfg.head_dim
    expected_bytes = {"auto": kv_values * torch.finfo(torch.float32).bits // 8, "fp8_e4m3": kv_values}
    for row in rows:
        assert row["bytes_per_token"] == expected_bytes[row["kv_cache_dtype"]]
        assert row["elapsed_s"] > 0
        assert row["input_tokens"] == num_prompts * input_len
        assert row["output_tokens"] == num_prompts * output_len
        assert row["requests_per_s"] == pytest.approx(num_prompts / row["elapsed_s"])
        assert row["output_tokens_per_s"] == pytest.approx(row["output_tokens"] / row["elapsed_s"])
        assert row["total_tokens_per_s"] == pytest.approx((row["input_tokens"] + row["output_tokens"])
                                                          / row["elapsed_s"])
    assert "[rank 1] rank 1: stopped by rank 0 after" in result.stderr
