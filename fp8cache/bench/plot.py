"""`--plot out.png` for the bench commands: one PNG of the figures a run measured.

matplotlib is an optional extra (`pip install fp8kv[plot]`); it is imported only when a plot is asked for.
"""

from __future__ import annotations

import math


class PlotUnavailable(RuntimeError):
    pass


def require_matplotlib() -> None:
    """Raise PlotUnavailable now, before a long run, if the plot could not be drawn after it."""
    _pyplot()


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable("--plot needs matplotlib, which is not installed; install it with "
                              "`pip install fp8kv[plot]` (or `pip install matplotlib`)") from exc
    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    return plt


def _label(row: dict) -> str:
    return row.get("variant", row["kv_cache_dtype"]) if row["engine"] == "fp8kv" else row["engine"]


def _bar_labels(ax, bars, texts: list[str]) -> None:
    for bar, text in zip(bars, texts):
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")


def plot_throughput(rows: list[dict], path: str) -> str:
    """Output tokens/s per engine and kv-cache dtype."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    values = [r["output_tokens_per_s"] for r in rows]
    colors = ["tab:blue" if r["engine"] == "fp8kv" else "tab:gray" for r in rows]
    bars = ax.bar([_label(r) for r in rows], values, color=colors)
    _bar_labels(ax, bars, [f"{v:.1f}" for v in values])
    first = rows[0]
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"offline throughput: {first['num_prompts']} prompts, {first['input_len']} in / "
                 f"{first['output_len']} out\n{first['machine']['cpu']}, {first['machine']['threads']} threads",
                 fontsize=9)
    return _save(plt, fig, path)


def plot_capacity(rows: list[dict], path: str) -> str:
    """Per context: output tokens/s per dtype (bars, labelled with the batch), and the largest batch."""
    plt = _pyplot()
    measured = [r for r in rows if "output_tokens_per_s" in r]
    contexts = sorted({r["context"] for r in rows})
    dtypes = list(dict.fromkeys(r.get("variant", r["kv_cache_dtype"]) for r in rows))  # "fp8_e4m3 dynamic" apart
    fig, (ax_tps, ax_batch) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(dtypes)
    for k, dtype in enumerate(dtypes):
        by_context = {r["context"]: r for r in measured if r.get("variant", r["kv_cache_dtype"]) == dtype}
        xs = [i + k * width for i, c in enumerate(contexts) if c in by_context]
        picked = [by_context[c] for c in contexts if c in by_context]
        bars = ax_tps.bar(xs, [r["output_tokens_per_s"] for r in picked], width, label=dtype)
        _bar_labels(ax_tps, bars, [f"b{r['batch']}" for r in picked])
        fits = {r["context"]: r["max_batch"] for r in rows if r.get("variant", r["kv_cache_dtype"]) == dtype}
        ax_batch.plot(contexts, [fits.get(c, math.nan) for c in contexts], marker="o", label=dtype)
    ax_tps.set_xticks([i + width * (len(dtypes) - 1) / 2 for i in range(len(contexts))],
                      [str(c) for c in contexts])
    ax_tps.set_xlabel("context (tokens)")
    ax_tps.set_ylabel("output tokens / s")
    ax_tps.set_title(f"throughput at the largest batch, KV cache {rows[0]['kv_cache_memory']}", fontsize=9)
    ax_tps.legend(fontsize=8)
    ax_batch.set_xlabel("context (tokens)")
    ax_batch.set_ylabel("sequences that fit")
    ax_batch.set_title("largest batch without preemption", fontsize=9)
    ax_batch.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_serve(summary: dict, path: str) -> str:
    """Mean / median / p90 / p99 of TTFT, TPOT, ITL and end-to-end latency."""
    plt = _pyplot()
    metrics = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
    fig, axes = plt.subplots(1, len(metrics), figsize=(13, 3.5))
    for ax, name in zip(axes, metrics):
        stats = summary[name]
        keys = [k for k in ("mean", "median", "p90", "p99") if stats.get(k) is not None]
        bars = ax.bar(keys, [stats[k] for k in keys], color="tab:blue")
        _bar_labels(ax, bars, [f"{stats[k]:.0f}" for k in keys])
        ax.set_title(name.removesuffix("_ms").upper() + " (ms)", fontsize=9)
    fig.suptitle(f"{summary['completed']} ok, {summary['failed']} failed, "
                 f"{summary['request_throughput']:.2f} req/s, {summary['output_tokens_per_s']:.1f} "
                 "output tokens/s", fontsize=9)
    return _save(plt, fig, path)


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
