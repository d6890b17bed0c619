"""Tensor parallelism on CPU over gloo: N ranks give the same greedy tokens as one process, each rank takes
its own slice of the KV scales, and `fp8kv run --num-shard N` keeps its ranks alive and stopped together."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from server_process import ServerProcess

from fp8cache import LLM, SamplingParams
from fp8cache.distributed import sharding

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Two cores here: one thread per rank.
RANK_ENV = {"OMP_NUM_THREADS": "1"}
TINY_PROMPTS = ["the city of the river was", "a house by the water"]
DEFAULT_PROMPTS = ["What is the capital of France?", "The tower is 324 metres tall and"]
MAX_NEW_TOKENS = 8


def one_rank_tokens(model: str, prompts: list[str], monkeypatch, **engine) -> list[list[int]]:
    llm = LLM(model=model, kv_cache_memory="16MiB", log=lambda msg: None, **engine)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS))
    return [o.outputs[0].token_ids for o in outs]


def served_tokens(server: ServerProcess, prompts: list[str]) -> list[list[int]]:
    tokens = []
    with server.client() as c:
        for prompt in prompts:
            r = c.post("/generate", json={"inputs": prompt, "parameters": {
                "max_new_tokens": MAX_NEW_TOKENS, "do_sample": False, "details": True}})
            r.raise_for_status()
            tokens.append([t["id"] for t in r.json()["details"]["tokens"]])
    return tokens


def rank_pids(output: str) -> dict[int, int]:
    return {int(r): int(p) for r, p in re.findall(r"rank (\d+) started \(pid (\d+)\)", output)}


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def scales_file(path, per_rank: list[list[float]] | None = None, per_head: list[list[float]] | None = None,
                dtype: str = "float8_e4m3fn") -> str:
    """per_rank[r][layer]: one scale per rank and layer; per_head[layer]: a list over the model's KV heads."""
    if per_rank is not None:
        table = {str(r): {str(i): s for i, s in enumerate(layers)} for r, layers in enumerate(per_rank)}
    else:
        table = {"0": {str(i): heads for i, heads in enumerate(per_head)}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"model_type": "llama", "kv_cache": {"dtype": dtype, "scaling_factor": table}}, f)
    return str(path)


def serve_and_compare(model: str, num_shard: int, kv_cache_dtype: str, prompts: list[str], tmp_path,
                      monkeypatch, scales: str | None = None, stop: str = "sigterm") -> None:
    """Serve with num_shard ranks, compare greedy tokens with one process, then stop the launcher with
    SIGTERM (stop="sigterm") or by killing the last rank (stop="kill") and check how everything ended."""
    args = [model, "--num-shard", str(num_shard), "--kv-cache-dtype", kv_cache_dtype, "--kv-cache-memory",
            "16MiB", "--no-access-log", "--dtype", "float32"] + (["--quantization-param-path", scales] if scales else [])
    server = ServerProcess(args, str(tmp_path / "server.log"), env=RANK_ENV)
    try:
        got = served_tokens(server, prompts)
        pids = rank_pids(server.output())
        if stop == "kill":
            os.kill(pids[num_shard - 1], signal.SIGKILL)
            server.proc.wait(60)
    finally:
        code = server.stop()
    output = server.output()
    assert sorted(pids) == list(range(num_shard)), output[-3000:]
    assert all(gone(pid) for pid in pids.values()), "a rank outlived the launcher"
    if stop == "kill":
        # The launcher noticed, stopped the other ranks, and failed naming the rank.
        assert code != 0
        assert f"rank {num_shard - 1} was killed by SIGKILL" in output
        assert f" ERROR   fp8kv: tensor-parallel rank {num_shard - 1}" in output
    else:
        # SIGTERM reached every rank: rank 0 drained and released the workers, and all exited 0.
        assert code == 0, output[-3000:]
        assert "stopped (cleanly)" in output
        for rank in range(1, num_shard):
            assert f"rank {rank}: stopped by rank 0" in output
    expected = one_rank_tokens(model, prompts, monkeypatch, kv_cache_dtype=kv_cache_dtype,
                               quantization_param_path=scales)
    assert got == expected


# ---- end to end: fp8kv run --num-shard N ----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize(("kv_cache_dtype", "stop"), [("auto", "sigterm"), ("fp8", "kill")])
def test_two_ranks_tiny_llama_greedy_equals_one_rank(tiny_llama_path, kv_cache_dtype, stop, tmp_path,
                                                     monkeypatch):
    serve_and_compare(tiny_llama_path, 2, kv_cache_dtype, TINY_PROMPTS, tmp_path, monkeypatch, stop=stop)


@pytest.mark.slow
def test_three_ranks_default_model_greedy_equals_one_rank(default_model_path, tmp_path, monkeypatch):
    # 3 KV heads over 3 ranks: one KV head (and its per-head scale) per rank. FP8 only: the auto cache's sharding
    # is the same code, run end to end by the two-rank test (four processes here cost 40 CPU-seconds a dtype).
    scales = scales_file(tmp_path / "scales.json",
                         per_head=[[0.02 + 0.01 * h + 0.001 * i for h in range(3)] for i in range(30)])
    serve_and_compare(default_model_path, 3, "fp8", DEFAULT_PROMPTS, tmp_path, monkeypatch, scales)


@pytest.mark.slow
def test_a_failing_rank_at_start_shows_its_error(tiny_llama_path, tmp_path):
    # A cache budget below one block is found by each rank once its model is loaded (heads a shard count does
    # not divide are refused before any rank starts: tests/launcher/test_launcher_hardening.py).
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "run", tiny_llama_path, "--num-shard", "2",
                           "--port", "0", "--kv-cache-memory", "1KiB"], cwd=REPO, env=dict(os.environ, **RANK_ENV),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0
    assert "holds no block" in proc.stderr
    assert re.search(r" ERROR   fp8kv: tensor-parallel rank \d exited with status 2", proc.stderr)


# ---- the runner on each rank: scale slices and logits -------------------------------------------------------

RANK_SCRIPT = r"""
import json, sys
from fp8cache.config import EngineConfig
from fp8cache.distributed import parallel_state, worker
from fp8cache.model.batch import SeqChunk, StepBatch
from fp8cache.model.runner import ModelRunner

model, kv_cache_dtype, scales, size, out, batches = sys.argv[1:7]
BATCHES = json.loads(batches)
config = EngineConfig(model=model, kv_cache_dtype=kv_cache_dtype, quantization_param_path=scales or None,
                      kv_cache_memory="8MiB", tensor_parallel_size=int(size), kv_recent_window=0, dtype="float32")
runner = ModelRunner(config, log=lambda msg: None)
result = {"k": [t.tolist() for t in runner._k_scales], "v": [t.tolist() for t in runner._v_scales],
          "num_kv_heads": runner.num_kv_heads, "cache_heads": runner.kv_caches[0][0].shape[1]}
if parallel_state.get().is_driver:
    result["logits"] = [runner.execute(StepBatch(*b[:3], [SeqChunk(*b[3])])).tolist() for b in BATCHES]
    worker.stop_workers()
else:
    worker.serve_steps(runner.execute)
with open(out, "w") as f:
    json.dump(result, f)
# As fp8kv's own worker ranks do: torch's gloo can abort a process in interpreter teardown.
parallel_state.exit_rank(0)
"""


# (token_ids, positions, slot_mapping, SeqChunk args): a 10-token prefill, then one decode step.
BATCHES = [([5, 9, 14, 3, 22, 7, 11, 30, 4, 17], list(range(10)), list(range(10)), (10, 10, [0])),
           ([8], [10], [10], (1, 11, [0]))]


def one_rank_logits(model: str, kv_cache_dtype: str, scales: str | None, monkeypatch) -> list[torch.Tensor]:
    from fp8cache.config import EngineConfig
    from fp8cache.model.batch import SeqChunk, StepBatch
    from fp8cache.model.runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=model, kv_cache_dtype=kv_cache_dtype, quantization_param_path=scales,
                                      kv_cache_memory="8MiB", kv_recent_window=0, dtype="float32"),
                         log=lambda msg: None)
    return [runner.execute(StepBatch(*b[:3], [SeqChunk(*b[3])])) for b in BATCHES]


def run_ranks(model: str, kv_cache_dtype: str, scales: str | None, size: int, tmp_path) -> list[dict]:
    from launcher.supervisor import free_port

    port = free_port()
    procs, outs = [], []
    for rank in range(size):
        out = str(tmp_path / f"rank{rank}.json")
        env = dict(os.environ, **RANK_ENV, RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        args = [model, kv_cache_dtype, scales or "", str(size), out, json.dumps(BATCHES)]
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, *args], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs.append(out)
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-3000:]
    results = []
    for out in outs:
        with open(out, encoding="utf-8") as f:
            results.append(json.load(f))
    return results


@pytest.mark.slow
def test_each_rank_takes_its_entry_of_a_per_rank_scales_file(tiny_llama_path, tmp_path):
    # Two layers; rank r's scale for layer i is distinct from every other rank's and layer's.
    per_rank = [[0.5 + 0.25 * r + 0.0625 * i for i in range(2)] for r in range(2)]
    scales = scales_file(tmp_path / "per_rank.json", per_rank=per_rank)
    results = run_ranks(tiny_llama_path, "fp8", scales, 2, tmp_path)
    for rank, result in enumerate(results):
        assert result["num_kv_heads"] == result["cache_heads"] == 1  # 2 KV heads over 2 ranks
        assert result["k"] == [[s] for s in per_rank[rank]]
        assert result["v"] == [[s] for s in per_rank[rank]]


@pytest.mark.slow
def test_each_rank_takes_its_heads_of_a_per_head_scales_file(tiny_llama_path, tmp_path, monkeypatch):
    per_head = [[0.5 + 0.25 * h + 0.0625 * i for h in range(2)] for i in range(2)]
    scales = scales_file(tmp_path / "per_head.json", per_head=per_head)
    results = run_ranks(tiny_llama_path, "fp8", scales, 2, tmp_path)
    for rank, result in enumerate(results):
        assert result["k"] == [[layer[rank]] for layer in per_head]
        assert result["v"] == [[layer[rank]] for layer in per_head]
    # The sharded model with sliced scales computes what one process with the whole vector computes.
    expected = one_rank_logits(tiny_llama_path, "fp8", scales, monkeypatch)
    for got, want in zip(results[0]["logits"], expected):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-4)


# ---- clear errors ------------------------------------------------------------------------------------------

def test_head_counts_that_do_not_divide_are_refused_with_the_fix():
    config = type("Cfg", (), {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536})
    with pytest.raises(ValueError, match=r"does not divide this model's 9 attention heads and 3 KV heads.*"
                                         r"--num-shard \(tensor_parallel_size\) 1 or 3"):
        sharding.check_divisible(config, 2)
    sharding.check_divisible(config, 3)


def test_tensor_parallel_without_the_environment_names_the_variables(monkeypatch):
    from fp8cache.config import EngineConfig
    from fp8cache.distributed import parallel_state

    for name in parallel_state.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE.*--num-shard 2"):
        parallel_state.initialize(EngineConfig(tensor_parallel_size=2))


def test_supervisor_is_not_started_by_a_process_that_already_has_a_rank(monkeypatch):
    # With RANK set (torchrun, several machines), `fp8kv run --num-shard N` is one rank, not a launcher.
    from fp8cache.distributed import parallel_state

    monkeypatch.setenv("RANK", "1")
    assert parallel_state.env_rank() == 1
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK='one' is not an integer"):
        parallel_state.env_rank()

