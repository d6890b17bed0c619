"""The figures of scripts/gpu_check.sh's steps, each as a table for its log and a one-line note for the run's
summary, with the issue's targets marked met or MISSED (docs/design.md section 7: the ratios come from rows
measured side by side in one run).

    python -m fp8cache.bench.summary kernels|throughput|capacity|scale OUT   # reads OUT/STEP.json
    python -m fp8cache.bench.summary eval OUT MODEL DEVICE             # measures, then reads
    python -m fp8cache.bench.summary sweep OUT                         # reads OUT/sweep-*.json

writes OUT/STEP.txt (the table) and OUT/STEP.note (the line) and prints the table; `eval` exits 1 when the
KL on DEVICE and on the CPU differ by more than EVAL_TOLERANCE.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

# Decode attention targets (issue 37), at these shapes of every measured attention shape.
TARGET_SHAPES = ((8, 8192), (32, 4096), (1, 16384))
TARGET_BANDWIDTH_SHARE = 0.80  # of the copy bandwidth measured in the same run
TARGET_VS_SDPA = 1.6  # fp8_e4m3 at least this much faster than torch SDPA on a dense bfloat16 cache
TARGET_VS_BF16 = 0.55  # fp8_e4m3 at most this share of our own bfloat16 kernel's time
TARGET_FORMAT_SPREAD = 0.10  # e5m2 and e4m3fnuz within this of e4m3
TARGET_SHORT_US = 10.0  # 1 x 512
# End to end (the throughput step's command) and at scale (the capacity step)
TARGET_OUTPUT_TOK_S = 30_000
TARGET_VS_TRANSFORMERS = 20.0
TARGET_CAPACITY_SEQS = 1.9  # fp8_e4m3's concurrent sequences over auto's, same KV budget
TARGET_CAPACITY_TOK_S = 1.5  # and its output tokens/s over auto's
EVAL_TOLERANCE = 0.05  # relative KL difference, the GPU against the CPU
EVAL_DTYPES = ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz")


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# ---- kernels ---------------------------------------------------------------------------------------


def _kernel_groups(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """(heads, KV heads, head size, batch, context) -> case name -> row, in the order measured."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["num_heads"], r["num_kv_heads"], r["head_size"], r["batch"], r["context"])
        name = "sdpa" if r["impl"] == "torch_sdpa" else (
            r["kv_cache_dtype"] if r["kv_cache_dtype"] != "auto" else f"auto {r['dtype']}")
        groups.setdefault(key, {})[name] = r
    return groups


def kernels_report(rows: list[dict]) -> tuple[str, str]:
    """(table, note) of `fp8kv bench kernels --json` rows: per shape fp8_e4m3's time and share of the measured
    bandwidth, SDPA's time over it, its time over our bfloat16 kernel's, the other FP8 formats against it."""
    if not rows:
        return "no rows", "no rows"
    probe, bandwidth = rows[0]["bandwidth_probe"], rows[0]["read_bw_gbps"]
    header = (f"{'heads':9} {'impl':10} {'kv':13} {'dtype':9} {'batch':>5} {'ctx':>6} {'us':>9} "
              f"{'KV GB/s':>8} {'% bw':>5}")
    table = [f"{probe} bandwidth {bandwidth:.0f} GB/s", header]
    for r in rows:
        heads = f"{r['num_heads']}/{r['num_kv_heads']} d{r['head_size']}"
        table.append(f"{heads:9} {r['impl']:10} {r['kv_cache_dtype']:13} {r['dtype']:9} {r['batch']:5} "
                     f"{r['context']:6} {1000 * r['ms']:9.1f} {r['kv_gbps']:8.0f} "
                     f"{100 * r['kv_gbps'] / r['read_bw_gbps']:5.0f}")
    parts, counts, short = [], {"bw": [0, 0], "sdpa": [0, 0], "bf16": [0, 0], "spread": [0, 0]}, []

    def count(name: str, ok: bool) -> None:
        counts[name][0] += ok
        counts[name][1] += 1

    for (h, kv, d, batch, context), case in _kernel_groups(rows).items():
        e4m3 = case.get("fp8_e4m3")
        if e4m3 is None:
            continue
        us, share = 1000 * e4m3["ms"], e4m3["kv_gbps"] / e4m3["read_bw_gbps"]
        text = f"{h}/{kv} d{d} {batch}x{context}: e4m3 {us:.1f} us {100 * share:.0f}% bw"
        sdpa, bf16 = case.get("sdpa"), case.get("auto bfloat16")
        if sdpa is not None:
            text += f", SDPA {1000 * sdpa['ms']:.1f} us = {sdpa['ms'] / e4m3['ms']:.2f}x e4m3"
        if bf16 is not None:
            text += f", e4m3/bf16 {e4m3['ms'] / bf16['ms']:.2f}"
        spreads = {f: case[f]["ms"] / e4m3["ms"] - 1 for f in ("fp8_e5m2", "fp8_e4m3fnuz") if f in case}
        text += "".join(f", {f.removeprefix('fp8_')} {100 * x:+.0f}%" for f, x in spreads.items())
        parts.append(text)
        if (batch, context) in TARGET_SHAPES:
            count("bw", share >= TARGET_BANDWIDTH_SHARE)
            if sdpa is not None:
                count("sdpa", sdpa["ms"] / e4m3["ms"] >= TARGET_VS_SDPA)
            if bf16 is not None:
                count("bf16", e4m3["ms"] / bf16["ms"] <= TARGET_VS_BF16)
            if spreads:
                count("spread", max(spreads.values()) <= TARGET_FORMAT_SPREAD)
        if (batch, context) == (1, 512):
            short.append(us <= TARGET_SHORT_US)
    labels = {"bw": f">={100 * TARGET_BANDWIDTH_SHARE:.0f}% bw", "sdpa": f">={TARGET_VS_SDPA}x SDPA",
              "bf16": f"<={TARGET_VS_BF16}x bf16",
              "spread": f"e5m2/fnuz within {100 * TARGET_FORMAT_SPREAD:.0f}%"}
    targets = [f"{labels[name]} {met}/{total}" for name, (met, total) in counts.items() if total]
    if short:
        targets.append(f"1x512 <= {TARGET_SHORT_US:.0f} us {verdict(all(short))}")
    note = (f"{probe} {bandwidth:.0f} GB/s; " + "; ".join(parts)
            + (f"; targets met at {'/'.join(f'{b}x{c}' for b, c in TARGET_SHAPES)}: " + ", ".join(targets)
               if targets else ""))
    return "\n".join(table), note


# ---- throughput and capacity -------------------------------------------------------------------------


def _fmt(value, spec: str = ".1f", unit: str = "") -> str:
    return "-" if value is None else f"{format(value, spec)}{unit}"


def _steps(r: dict) -> str:
    """Where a row's time went: its decode step, batch, prefill and decode seconds."""
    if r.get("steps") is None:
        return ""
    return (f", decode step {_fmt(r.get('decode_step_ms'), '.2f', ' ms')} at batch "
            f"{_fmt(r.get('decode_batch'))} (peak {r.get('peak_running')}), "
            f"prefill {_fmt(r.get('prefill_s'), '.2f', ' s')}"
            f" / decode {_fmt(r.get('decode_s'), '.2f', ' s')} of {r['elapsed_s']:.2f} s")


def throughput_report(rows: list[dict], scale: bool = False) -> tuple[str, str]:
    """(table, note) of `fp8kv bench throughput --json` rows (add_ratios applied or not). The targets: the
    end-to-end ones of the default model's run, or (scale) those of a KV budget that binds at a real model's
    size, where fp8_e4m3 runs more sequences at once than auto."""
    lines, parts = [], []
    peer = next((r for r in rows if r["engine"] == "transformers"), None)
    auto = next((r for r in rows if r["engine"] == "fp8kv" and r["kv_cache_dtype"] == "auto"), None)
    for r in rows:
        name = "transformers" if r["engine"] == "transformers" else r.get("variant", r["kv_cache_dtype"])
        text = f"{name} {r['output_tokens_per_s']:.0f} tok/s"
        ratios = [f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x {label}"
                  for base, label in ((peer, "transformers"), (auto, "auto"))
                  if r["engine"] == "fp8kv" and base is not None and base is not r]
        text += f" ({', '.join(ratios)})" if ratios else ""
        parts.append(text + _steps(r))
        lines.append(parts[-1])
    fp8 = next((r for r in rows if r["engine"] == "fp8kv" and r["kv_cache_dtype"] == "fp8_e4m3"), None)
    targets = []
    if scale and fp8 is not None and auto is not None:
        if fp8.get("peak_running") and auto.get("peak_running"):
            seqs = fp8["peak_running"] / auto["peak_running"]
            targets.append(f"{seqs:.2f}x auto's peak sequences (>= {TARGET_CAPACITY_SEQS}x "
                           f"{verdict(seqs >= TARGET_CAPACITY_SEQS)})")
        tok = fp8["output_tokens_per_s"] / auto["output_tokens_per_s"]
        met = verdict(tok >= TARGET_CAPACITY_TOK_S)
        targets.append(f"{tok:.2f}x auto's tok/s (>= {TARGET_CAPACITY_TOK_S}x {met})")
    elif fp8 is not None:
        tok_s = fp8["output_tokens_per_s"]
        targets.append(f">= {TARGET_OUTPUT_TOK_S} tok/s {verdict(tok_s >= TARGET_OUTPUT_TOK_S)}")
        if peer is not None:
            targets.append(f">= {TARGET_VS_TRANSFORMERS:.0f}x transformers "
                           f"{verdict(tok_s >= TARGET_VS_TRANSFORMERS * peer['output_tokens_per_s'])}")
        if auto is not None:
            targets.append(f"not slower than auto {verdict(tok_s >= auto['output_tokens_per_s'])}")
    note = "; ".join(parts) + (f"; fp8_e4m3 targets: {', '.join(targets)}" if targets else "")
    return "\n".join(lines), note


def capacity_report(rows: list[dict]) -> tuple[str, str]:
    """(table, note) of `fp8kv bench capacity --json` rows: per context each dtype's batch (what fits the
    budget and the peak that ran), output tokens/s and step figures, and fp8_e4m3 against auto."""
    parts, lines = [], []
    contexts = list(dict.fromkeys(r["context"] for r in rows))
    for context in contexts:
        at = [r for r in rows if r["context"] == context]
        first = at[0]
        head = (f"context {context} ({first['input_len']} in + {first['output_len']} out), "
                f"KV {first['kv_cache_memory']}")
        cells = []
        for r in at:
            cell = f"{r['kv_cache_dtype']} {r['max_batch']} seqs fit"
            if "output_tokens_per_s" in r:
                cell += (f", ran {r['batch']}, {r['output_tokens_per_s']:.0f} tok/s, "
                         f"{r['num_preemptions']} preemptions{_steps(r)}")
            else:
                cell += f" ({r.get('note', 'not run')})"
            cells.append(cell)
        auto = next((r for r in at if r["kv_cache_dtype"] == "auto"), None)
        fp8 = next((r for r in at if r["kv_cache_dtype"] == "fp8_e4m3"), None)
        if auto is not None and fp8 is not None and auto["max_batch"]:
            seqs = fp8["max_batch"] / auto["max_batch"]
            met = verdict(seqs >= TARGET_CAPACITY_SEQS)
            text = f"fp8_e4m3/auto {seqs:.2f}x seqs (>= {TARGET_CAPACITY_SEQS}x {met})"
            if "output_tokens_per_s" in fp8 and "output_tokens_per_s" in auto:
                tok = fp8["output_tokens_per_s"] / auto["output_tokens_per_s"]
                met = verdict(tok >= TARGET_CAPACITY_TOK_S)
                text += f", {tok:.2f}x tok/s (>= {TARGET_CAPACITY_TOK_S}x {met})"
            cells.append(text)
        parts.append(head + ": " + "; ".join(cells))
        lines += [head, *(f"  {c}" for c in cells)]
    return "\n".join(lines), "; ".join(parts)


# ---- eval ------------------------------------------------------------------------------------------


def eval_devices(model: str | None, device: str, out: Path, windows: int = 2, window_len: int = 1024,
                 evaluate: Callable[..., dict] | None = None) -> tuple[str, str, bool]:
    """Each FP8 format's KL on `device` and on the CPU, same model, scales (1.0) and windows, all in this one
    process (a process each cost seconds of start-up apiece): (table, note, whether every pair agrees within
    EVAL_TOLERANCE). The device's runs come first: an op library loaded for a GPU holds the CPU kernels
    too, while one loaded for the CPU alone could not run the GPU."""
    if evaluate is None:
        from fp8cache.quality.eval import evaluate
    from fp8cache.config import EngineConfig

    results = {}
    for where in (device, "cpu"):
        for dtype in EVAL_DTYPES:
            config = EngineConfig(model=model, kv_cache_dtype=dtype, dtype="float32", device=where,
                                  enable_prefix_caching=False)
            results[dtype, where] = evaluate(config, windows=windows, window_len=window_len, progress=False)
            (out / f"eval-{dtype}-{where}.json").write_text(json.dumps(results[dtype, where]))
    lines, worst = [], 0.0
    for dtype in EVAL_DTYPES:
        there, cpu = results[dtype, device], results[dtype, "cpu"]
        rel = abs(there["kl"] - cpu["kl"]) / cpu["kl"] if cpu["kl"] else float(there["kl"] != cpu["kl"])
        worst = max(worst, rel)
        lines.append(f"{dtype} KL {device} {there['kl']:.5f} cpu {cpu['kl']:.5f} ({100 * rel:.1f}%), "
                     f"ppl {there['ppl']:.2f}/{cpu['ppl']:.2f}")
    ok = worst <= EVAL_TOLERANCE
    worst_line = f"worst {100 * worst:.1f}% (tolerance {100 * EVAL_TOLERANCE:.0f}%: {verdict(ok)})"
    note = "; ".join([*lines, worst_line])
    return "\n".join(lines), note, ok


# ---- sweep: the tensor-core plan against fixed depths and splits ----------------------------------------

def sweep_report(runs: dict[str, list[dict]]) -> tuple[str, str]:
    """(table, note) of `bench kernels` runs under each setting ("plan": none; "STAGES=2": FP8KV_TC_STAGES=2, ...):
    fp8_e4m3's microseconds per shape and setting, and per shape the fastest setting against the plan's."""
    times: dict[tuple, dict[str, float]] = {}
    for setting, rows in runs.items():
        for key, cases in _kernel_groups(rows).items():
            if "fp8_e4m3" in cases:
                times.setdefault(key, {})[setting] = cases["fp8_e4m3"]["ms"] * 1e3
    if not times:
        return "no rows", "no rows"
    settings = list(runs)
    lines = [f"{'shape':24} " + " ".join(f"{s:>10}" for s in settings)]
    notes = []
    for (h, kv, d, b, c), row in times.items():
        shape = f"{h}/{kv} d{d} {b}x{c}"
        lines.append(f"{shape:24} " + " ".join(f"{row[s]:10.1f}" if s in row else f"{'-':>10}" for s in settings))
        best = min(row, key=row.get)
        if "plan" in row:
            notes.append(f"{shape}: plan {row['plan']:.1f} us, best {best} {row[best]:.1f}")
    return "\n".join(lines), "; ".join(notes)


def _sweep_runs(out: Path) -> dict[str, list[dict]]:
    """OUT/sweep-SETTING.json, the plan's own run first, then in the order they were measured."""
    paths = sorted(out.glob("sweep-*.json"), key=lambda p: (p.stem != "sweep-plan", p.stat().st_mtime_ns))
    return {p.stem.removeprefix("sweep-"): json.loads(p.read_text()) for p in paths}


# ---- the script's entry point ----------------------------------------------------------------------

REPORTS = {"kernels": kernels_report, "throughput": throughput_report, "capacity": capacity_report,
           "scale": lambda rows: throughput_report(rows, scale=True)}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in (*REPORTS, "eval", "sweep"):
        print(__doc__, file=sys.stderr)
        return 2
    step, out = argv[0], Path(argv[1])
    ok = True
    if step == "eval":
        model = argv[2] if len(argv) > 2 and argv[2] else None
        table, note, ok = eval_devices(model, argv[3] if len(argv) > 3 else "cuda", out)
    elif step == "sweep":
        table, note = sweep_report(_sweep_runs(out))
    else:
        table, note = REPORTS[step](json.loads((out / f"{step}.json").read_text()))
    (out / f"{step}.txt").write_text(table + "\n")
    (out / f"{step}.note").write_text(note + "\n")
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
