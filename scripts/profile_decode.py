"""Where a decode step's time goes, and how much of the host's work the device hides: the engine's host work
(scheduling, metadata, sampling, stops and text) and the device's, for a batch of equal prompts.

    python scripts/profile_decode.py [MODEL] [--device cuda] [--num-seqs 64] [--kv-cache-dtype fp8] [--loop both]

For each loop (overlapped: the default on a GPU, step N+1 is queued before step N's tokens are read; sync: each
step's tokens are read before the next is scheduled, the default on a CPU) it prints the milliseconds per decode
step (--steps steps timed as one block, the device synchronized only at its ends) and the host's milliseconds a
step in each phase. On a GPU it replays one decode graph alone: the device time of a step. Step / replay is the
overlap: 1.0 when the device never waits for the host (issue 37's target: <= 1.15x). --loop auto (the default)
runs both loops where the engine overlaps, else the engine's own; the first line is the first loop's figure
(scripts/cpu_check.sh reads its "(N tok/s)"). --cprofile N adds the N functions with the most host time in the
overlapped loop.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import time
from collections.abc import Iterator

import torch

from fp8cache import LLM, SamplingParams
from fp8cache.bench import machine
from fp8cache.engine import inflight, llm_engine

TARGET = 1.15  # issue 37: an overlapped decode step <= 1.15x one graph replay
WARMUP_STEPS = 5


@contextlib.contextmanager
def phase_timers(engine) -> Iterator[dict[str, list[float]]]:
    """Seconds spent in each phase of engine.step(), one entry a call, while the block runs."""
    spent: dict[str, list[float]] = {name: [] for name in
                                     ("schedule", "execute (host)", "sample (queue)", "wait for tokens", "stops, text")}
    targets = [(engine.scheduler, "schedule", "schedule"), (engine.runner, "execute", "execute (host)"),
               (engine.sampler, "sample", "sample (queue)"), (inflight.TokenReadback, "wait", "wait for tokens"),
               (llm_engine, "check_stops", "stops, text")]
    originals = [(obj, attr, obj.__dict__.get(attr)) for obj, attr, _ in targets]
    for obj, attr, name in targets:
        setattr(obj, attr, _timed(getattr(obj, attr), spent[name]))
    try:
        yield spent
    finally:
        for obj, attr, original in originals:
            if original is None:
                delattr(obj, attr)  # an instance's own wrapper over its class's method
            else:
                setattr(obj, attr, original)


def _timed(fn, spent: list[float]):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    return wrapper


def time_steps(engine, steps: int, profile: cProfile.Profile | None = None) -> tuple[float, dict[str, float]]:
    """(seconds a step, seconds a step in each phase) over `steps` steps timed as one block."""
    device = engine.runner.device
    with phase_timers(engine) as spent:
        machine.synchronize(device)
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        for _ in range(steps):
            engine.step()
        if profile is not None:
            profile.disable()
        machine.synchronize(device)
        elapsed = (time.perf_counter() - start) / steps
    phases = {name: sum(times) / steps for name, times in spent.items()}
    phases["rest (outputs, bookkeeping)"] = elapsed - sum(phases.values())
    return elapsed, phases


def graph_replay_ms(runner) -> tuple[int, float] | None:
    """(rows, ms of device time) of the largest captured decode graph replayed alone, None without graphs."""
    graphs = getattr(runner, "_graphs", None)
    if graphs is None or not graphs.graphs:
        return None
    size, captured = max(graphs.graphs.items())
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(20):
        captured.graph.replay()  # the last step's inputs again: it writes the K/V it wrote then
    end.record()
    end.synchronize()
    return size, begin.elapsed_time(end) / 20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--kv-recent-window", type=int, default=0)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--loop", choices=["auto", "overlapped", "sync", "both"], default="auto")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="print the N functions with the most host time in the overlapped loop")
    args = parser.parse_args(argv)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              kv_recent_window=args.kv_recent_window, max_num_seqs=args.num_seqs, log=lambda m: None)
    engine, runner = llm.engine, llm.engine.runner
    both = args.loop == "both" or (args.loop == "auto" and engine.overlap)
    loops = ["overlapped", "sync"] if both else ["sync"] if args.loop == "auto" else [args.loop]
    per_loop = WARMUP_STEPS + args.steps * (2 if args.cprofile else 1)
    params = SamplingParams(temperature=0, max_tokens=per_loop * len(loops) + 20, ignore_eos=True)
    vocab = runner.hf_config.vocab_size
    for n in range(args.num_seqs):
        engine.add_request(str(n), [3 + (n + i) % min(97, vocab - 3) for i in range(args.input_len)], params)
    while engine.stats.num_generated_tokens < args.num_seqs:  # prefill
        engine.step()
    results = {}
    for loop in loops:
        engine.overlap = loop == "overlapped"
        for _ in range(WARMUP_STEPS):  # graphs captured, the loop in its steady state
            engine.step()
        results[loop] = time_steps(engine, args.steps)
        if args.cprofile and loop == "overlapped":
            profile = cProfile.Profile()
            time_steps(engine, args.steps, profile)
    replay = graph_replay_ms(runner)
    report(args, results, replay)
    if args.cprofile and "overlapped" in results:
        print(f"\nhost time of the overlapped loop, {args.steps} steps, by function (cProfile):")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.cprofile)
    llm.close()


def report(args, results: dict[str, tuple[float, dict[str, float]]], replay: tuple[int, float] | None) -> None:
    for n, (loop, (step, _)) in enumerate(results.items()):
        ms = step * 1e3
        line = f"{loop} loop {ms:.2f} ms ({args.num_seqs / step:.0f} tok/s)"
        if replay:
            ratio = ms / replay[1]
            line += f", {ratio:.2f}x one graph replay"
            if loop == "overlapped":
                line += f" (target <= {TARGET}x: {'met' if ratio <= TARGET else 'missed'})"
        print(f"decode step of {args.num_seqs} sequences: {line}" if n == 0 else f"  {line}")
    if replay:
        print(f"  one decode graph ({replay[0]} rows) replayed alone: {replay[1]:.2f} ms of device time")
    else:
        print("  no decode graph on this device (CUDA graphs: a GPU without --enforce-eager)")
    print(f"  {args.input_len}-token prompts, {args.kv_cache_dtype} cache; host, ms a step:")
    print(f"    {'':27}{''.join(f'{loop:>12}' for loop in results)}")
    for phase in next(iter(results.values()))[1]:
        print(f"    {phase:27}{''.join(f'{phases[phase] * 1e3:12.2f}' for _, phases in results.values())}")


if __name__ == "__main__":
    main()
