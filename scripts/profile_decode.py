"""Where a decode step's time goes: the engine's host work (scheduling, metadata, sampling, detokenizing) and
the device's, for a batch of equal prompts.

    python scripts/profile_decode.py [MODEL] [--device cuda] [--num-seqs 64] [--kv-cache-dtype fp8]

Prints milliseconds per decode step: the whole step, then its parts (each the mean over the timed steps).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fp8cache import LLM, SamplingParams
from fp8cache.bench import machine


def _timed(obj, name: str, spent: list[float]):
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--kv-recent-window", type=int, default=0)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              kv_recent_window=args.kv_recent_window, max_num_seqs=args.num_seqs, log=lambda m: None)
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=args.steps + 20, ignore_eos=True)
    for n in range(args.num_seqs):
        vocab = runner.hf_config.vocab_size
        engine.add_request(str(n), [3 + (n + i) % min(97, vocab - 3) for i in range(args.input_len)], params)
    while engine.stats.num_generated_tokens < args.num_seqs:  # prefill
        engine.step()
    for _ in range(5):
        engine.step()
    parts: dict[str, list[float]] = {"schedule": [], "execute (host)": [], "sample (incl. wait)": []}
    _timed(engine.scheduler, "schedule", parts["schedule"])
    _timed(runner, "execute", parts["execute (host)"])
    _timed(engine, "sampler", parts["sample (incl. wait)"])
    gpu: list[float] = []
    steps: list[float] = []
    for _ in range(args.steps):
        begin = torch.cuda.Event(enable_timing=True) if runner.device.type == "cuda" else None
        end = torch.cuda.Event(enable_timing=True) if begin is not None else None
        if begin is not None:
            begin.record()
        start = time.perf_counter()
        engine.step()
        if end is not None:
            end.record()
        machine.synchronize(runner.device)
        steps.append(time.perf_counter() - start)
        if begin is not None:
            gpu.append(begin.elapsed_time(end) / 1e3)
    ms = statistics.mean(steps) * 1e3
    print(f"decode step of {args.num_seqs} sequences: {ms:.2f} ms ({args.num_seqs / ms * 1e3:.0f} tok/s)")
    for name, spent in parts.items():
        print(f"  {name:22} {statistics.mean(spent) * 1e3:7.2f} ms")
    rest = ms - sum(statistics.mean(s) * 1e3 for s in parts.values())
    print(f"  {'rest (outputs, stops)':22} {rest:7.2f} ms")
    if gpu:
        print(f"  device timeline        {statistics.mean(gpu) * 1e3:7.2f} ms (events around the step, idle gaps too)")
    graphs = getattr(runner, "_graphs", None)
    if graphs is not None and graphs.graphs:
        size, captured = max(graphs.graphs.items())
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(20):
            captured.graph.replay()
        end.record()
        end.synchronize()
        print(f"  one decode graph ({size} rows) replayed alone: {begin.elapsed_time(end) / 20:.2f} ms of device time")
    llm.close()


if __name__ == "__main__":
    main()
