"""Speculative decoding with tensor parallelism: rank 0 proposes and accepts, every rank runs the verify step
on its heads, and the recent window's repair after rejected drafts reaches every rank's ring, so two ranks
with speculation give one process's greedy tokens without it."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist
from server_process import ServerProcess

from fp8cache import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Token ids that repeat their context: the tiny model's greedy output falls into loops the proposer finds, and
# leaves them, so drafts are both accepted and rejected. A window of 8 is well inside 30-token prompts: every
# draft overwrites ring slots that later steps read.
PROMPTS = [[5 + i % 7 for i in range(30)], [20 + i % 5 * 3 for i in range(24)] + [9, 10, 11]]
WINDOW = 8


@pytest.fixture(autouse=True)
def _one_process_per_core(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two cores here: one torch thread per rank
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    assert not dist.is_initialized(), "a test left this process in a tensor-parallel group"


def greedy(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt's greedy tokens and their logprobs."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, logprobs=0))
    return ([o.outputs[0].token_ids for o in outs],
            [[entry[token].logprob for token, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
             for o in outs])


@pytest.mark.slow
def test_two_ranks_with_speculation_give_the_greedy_tokens_of_one_without(tiny_llama_path):
    engine = {"model": tiny_llama_path, "kv_cache_dtype": "fp8_e4m3", "kv_recent_window": WINDOW,
              "kv_cache_memory": "16MiB", "log": lambda msg: None}
    with LLM(tensor_parallel_size=2, speculative_config=NGRAM, **engine) as llm:
        assert llm.engine.runner.kv_recent_window == WINDOW and llm.engine.runner.window_caches
        tokens, logprobs = greedy(llm)
        speculation = llm.engine.speculation
        proposed, accepted = speculation.num_draft_tokens, speculation.num_accepted_tokens
    assert 0 < accepted < proposed  # drafts were accepted, and rejected ones had their ring slots restored
    assert tokens == greedy(LLM(**engine))[0]
    # Tokens alone barely see rank 1's ring: it holds one of two KV heads, and a wrong slot moves a logprob by
    # about 0.02 here. Two ranks without speculation read their rings as steps left them, and match closely
    # (two ranks and one differ by up to 0.005 in any case: the all-reduce can move an FP8 code).
    with LLM(tensor_parallel_size=2, **engine) as llm:
        plain_tokens, plain_logprobs = greedy(llm)
    assert plain_tokens == tokens
    for got, want in zip(logprobs, plain_logprobs):
        assert got == pytest.approx(want, abs=1e-3)


@pytest.mark.slow
def test_bench_throughput_over_two_shards_with_speculation(tiny_llama_path):
    """Four runners on each rank (auto and fp8, each without and with speculation): a window repair reaches the
    runner of the step just verified, or the worker would fail its check and the bench with it."""
    from click.testing import CliRunner

    from launcher import bench as bench_commands

    result = CliRunner().invoke(bench_commands.throughput, [
        tiny_llama_path, "--num-prompts", "2", "--input-len", "24", "--output-len", "24", "--workload", "repeat",
        "--kv-cache-dtype", "auto,fp8_e4m3", "--kv-recent-window", str(WINDOW), "--speculative-config",
        json.dumps(NGRAM), "--num-shard", "2", "--threads", "1", "--kv-cache-memory", "16MiB", "--json"],
        catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = {r["variant"]: r for r in json.loads(result.stdout)}
    assert list(rows) == ["auto", "auto ngram", "fp8_e4m3", "fp8_e4m3 ngram"]
    assert all(r["output_tokens"] == 2 * 24 for r in rows.values())
    spec = rows["fp8_e4m3 ngram"]
    assert 0 < spec["spec_accepted_tokens"] < spec["spec_draft_tokens"]  # so windows were repaired
    assert "[rank 1] rank 1: stopped by rank 0 after" in result.stderr


@pytest.mark.slow
def test_served_over_two_ranks_with_speculation(tiny_llama_path, tmp_path):
    """`fp8kv run --num-shard 2 --speculative-config`: the worker rank is run_worker's, not the offline group's."""
    prompt = "the city of the river was a house by the water " * 3 + "the city of the"
    args = [tiny_llama_path, "--num-shard", "2", "--kv-cache-dtype", "fp8_e4m3", "--kv-recent-window", str(WINDOW),
            "--speculative-config", json.dumps(NGRAM), "--kv-cache-memory", "16MiB", "--no-access-log"]
    server = ServerProcess(args, str(tmp_path / "server.log"), env={"OMP_NUM_THREADS": "1"})
    try:
        with server.client() as c:
            r = c.post("/generate", json={"inputs": prompt, "parameters": {
                "max_new_tokens": 40, "do_sample": False, "details": True}})
            r.raise_for_status()
            got = [t["id"] for t in r.json()["details"]["tokens"]]
            metrics = c.get("/metrics").text
    finally:
        code = server.stop()
    assert code == 0, server.output()[-3000:]
    proposed, accepted = (float(re.search(rf"^fp8kv_spec_decode_num_{name}_tokens_total\{{.*\}} (\S+)$", metrics,
                                          re.MULTILINE).group(1)) for name in ("draft", "accepted"))
    assert 0 < accepted < proposed
    engine = {"model": tiny_llama_path, "kv_cache_dtype": "fp8_e4m3", "kv_recent_window": WINDOW,
              "kv_cache_memory": "16MiB", "log": lambda msg: None}
    expected = LLM(**engine).generate(prompt, SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert got == expected.outputs[0].token_ids
