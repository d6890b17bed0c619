"""The overlapped decode loop on a real model: step N+1 is scheduled, its metadata built and its forward pass queued
before step N's sampled tokens are read, and N+1 takes N's tokens as its input ids on the device. On the CPU the
device does its work inside the call, so nothing overlaps in time, but the same code runs: greedy tokens must be
transformers' own and the synchronous loop's. The decode graphs' path (feeding pending tokens into the graph's
input buffer) runs here with each replay emulated by an eager forward pass over the captured buffers.

The stand-in GPU's view (host syncs, copies) is in tests/model/test_gpu_paths.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from fp8cache.config import EngineConfig
from fp8cache.engine.llm_engine import LLMEngine
from fp8cache.engine.sampling_params import SamplingParams
from fp8cache.model import step_metadata
from fp8cache.model.cuda import cuda_graph
from fp8cache.model.loader import load_model
from fp8cache.model.runner import ModelRunner

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    from conftest import build_tiny_model

    # initializer_range wider than transformers' 0.02: decided logits, so float rounding picks no other token
    return build_tiny_model(str(tmp_path_factory.mktemp("overlap")), max_position_embeddings=512,
                            initializer_range=0.1)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (5, 23, 9, 40, 14)]


@pytest.fixture(scope="module")
def hf_greedy(tiny_path, prompts) -> list[list[int]]:
    """transformers' generate(do_sample=False), one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, pad_token_id=0)
        outs.append(gen[0, len(prompt):].tolist())
    return outs


def make_engine(path: str, overlap: bool, **overrides) -> LLMEngine:
    settings = {"model": path, "device": "cpu", "dtype": "float32", "kv_cache_dtype": "auto",
                "kv_cache_memory": "2MiB", "max_num_batched_tokens": 32, "max_num_seqs": 4} | overrides
    config = EngineConfig(**settings)
    runner = ModelRunner(config, log=lambda _: None, loaded=load_model(config, progress=False))
    return LLMEngine(config, log=lambda _: None, runner=runner, overlap=overlap)


def generate(engine: LLMEngine, prompts: list[list[int]], **params) -> list[list[int]]:
    settings = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True} | params
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(**settings))
    done = {}
    while engine.has_unfinished_requests():
        done.update({int(o.request_id): o.outputs[0].token_ids for o in engine.step() if o.finished})
        engine.block_manager.check_invariants()
    assert engine.stats.blocks_used == 0, "KV blocks leaked"
    return [done[i] for i in range(len(prompts))]


def order_log(engine: LLMEngine, monkeypatch) -> list[tuple[str, int | None]]:
    """The loop's events in order: the engine's ("schedule" | "launch" | "read", step) and ("metadata", None) for
    each host-to-device build of a step's metadata (the eager path's and the decode graphs')."""
    log: list[tuple[str, int | None]] = []
    engine.trace = lambda what, number: log.append((what, number))
    to_device = step_metadata.to_device

    def traced(*args, **kwargs):
        log.append(("metadata", None))
        return to_device(*args, **kwargs)

    monkeypatch.setattr(step_metadata, "to_device", traced)
    return log


def overlapped_steps(log: list[tuple[str, int | None]]) -> tuple[int, int]:
    """(steps N whose successor was scheduled and had its metadata built before N's tokens were read, steps N
    that have a successor)."""
    at = {entry: i for i, entry in enumerate(log)}
    steps = sorted(n for what, n in log if what == "read")
    pairs = [(n, at[("read", n)]) for n in steps if ("launch", n + 1) in at]
    early = 0
    for n, read in pairs:
        begin, launched = at[("schedule", n + 1)], at[("launch", n + 1)]
        built = any(what == "metadata" for what, _ in log[begin:launched])
        early += built and launched < read
    return early, len(pairs)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_overlapped_loop_builds_step_n_plus_1_before_reading_step_n(tiny_path, prompts, hf_greedy, kv_cache_dtype,
                                                                     monkeypatch):
    """Chunked prefill and decodes of five prompts, four at a time: with overlap every step's successor is
    scheduled, its metadata built and it is launched before the step's tokens are read; without, never. The
    tokens are the same, and with an auto cache transformers' own."""
    runs, counts = [], []
    for overlap in (False, True):
        engine = make_engine(tiny_path, overlap, kv_cache_dtype=kv_cache_dtype)
        log = order_log(engine, monkeypatch)
        runs.append(generate(engine, prompts))
        counts.append(overlapped_steps(log))
        monkeypatch.undo()
    (sync_early, sync_pairs), (early, pairs) = counts
    assert sync_pairs > 10 and sync_early == 0
    assert pairs > 10 and early == pairs
    assert runs[1] == runs[0]
    if kv_cache_dtype == "auto":
        assert runs[1] == hf_greedy


class EmulatedGraphs(cuda_graph.DecodeGraphs):
    """DecodeGraphs whose "graph" replays as an eager forward pass over the captured context and its buffer: what
    a CUDA graph reads, without CUDA. Counts the replays that fed tokens of the previous step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replays = 0
        self.fed_replays = 0

    def run(self, batch, prev_tokens=None):
        logits = super().run(batch, prev_tokens)
        if logits is not None:
            self.replays += 1
            self.fed_replays += bool(batch.future_rows)
        return logits

    def _record(self, ctx):
        ids, positions = ctx.extra["input_ids"], ctx.extra["positions"]
        logits = self.forward(ids, positions, ctx).to(torch.float32)

        class Replay:
            def replay(_) -> None:
                with torch.inference_mode():  # the logits are an inference tensor, as the forward made them
                    logits.copy_(self.forward(ids, positions, ctx))

        return Replay(), logits


def with_emulated_graphs(engine: LLMEngine) -> EmulatedGraphs:
    runner = engine.runner
    table_width = -(-runner.max_model_len // runner.block_size)
    runner._graphs = EmulatedGraphs(runner.device, runner.config.max_num_seqs, table_width, runner.max_model_len,
                                    runner._build_context,
                                    lambda ids, pos, ctx: runner._forward(ids, pos, None, ctx), lambda _: None)
    return runner._graphs


@pytest.mark.parametrize("window", [0, 8])
def test_decode_graphs_take_the_previous_steps_tokens(tiny_path, prompts, hf_greedy, window):
    """Decode steps through the graphs' buffers (padded batch sizes 1-4, pending tokens copied into the captured
    input ids): transformers' tokens with an auto cache, the eager loop's with FP8 and a recent window."""
    kv = {"kv_cache_dtype": "auto"} if not window else {"kv_cache_dtype": "fp8_e4m3", "kv_recent_window": window}
    eager = generate(make_engine(tiny_path, True, **kv), prompts)
    engine = make_engine(tiny_path, True, **kv)
    graphs = with_emulated_graphs(engine)
    got = generate(engine, prompts)
    assert graphs.fed_replays > 10 and sorted(graphs.graphs) == [1, 2, 4]
    assert got == eager
    if not window:
        assert got == hf_greedy


def test_sampled_and_stopping_requests_match_the_synchronous_loop(tiny_path, prompts):
    """Seeded sampling, min_tokens and logit bias (which overlap), stop token ids, stop strings and max_tokens
    (stops seen a step late): the same outputs with and without overlap."""
    greedy = generate(make_engine(tiny_path, False), prompts)
    text = make_engine(tiny_path, False).tokenizer.decode(greedy[4][5:7])
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=7, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[greedy[1][4]]),
              SamplingParams(temperature=0, max_tokens=10, min_tokens=3, logit_bias={greedy[2][1]: -3.0}),
              SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, stop=text)]
    runs = []
    for overlap in (False, True):
        engine = make_engine(tiny_path, overlap)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                         for o in engine.step() if o.finished})
        runs.append(outs)
    assert runs[1] == runs[0]
    assert [runs[0][str(i)][2] for i in range(5)] == ["length", "stop", "length", "length", "stop"]
    assert runs[0]["1"][0] == greedy[1][:5] and runs[0]["4"][0] == greedy[4][:7]


def test_profile_decode_reports_both_loops_and_their_phases(tiny_path, capsys):
    """scripts/profile_decode.py on the CPU (no graph to replay there): a step time for each loop and the host's
    phases; on a GPU it adds the replay time and the overlap ratio."""
    from script_module import load_script

    module = load_script("profile_decode.py")
    common = [tiny_path, "--device", "cpu", "--dtype", "float32", "--num-seqs", "4", "--input-len", "20", "--steps", "3"]
    module.main(common + ["--loop", "both"])
    out = capsys.readouterr().out
    assert out.startswith("decode step of 4 sequences: overlapped loop ") and "\n  sync loop " in out
    assert "no decode graph" in out
    for phase in ("schedule", "execute (host)", "sample (queue)", "wait for tokens", "stops, text", "rest"):
        assert phase in out
    module.main(common)  # the engine's own loop on a CPU: one rate, as scripts/cpu_check.sh reads it
    out = capsys.readouterr().out
    assert re.findall(r"\(([0-9.]+) tok/s\)", out) and len(re.findall("tok/s", out)) == 1
    assert out.startswith("decode step of 4 sequences: sync loop ")
