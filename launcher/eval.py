"""`fp8kv eval`: what an FP8 cache costs in quality, as a table or --json (the measuring is fp8cache.quality.eval)."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table

from launcher.options import LayerIds

console = Console(stderr=True, soft_wrap=True)


def _fail(message: str) -> None:
    from launcher.logs import say_error

    say_error(message, console)
    sys.exit(2)


@click.command("eval")
@click.argument("model", required=False)
@click.option("--kv-cache-dtype", default="fp8_e4m3", show_default=True,
              help="Cache to measure against the auto float32 baseline: fp8, fp8_e4m3, fp8_e5m2, "
                   "fp8_e4m3fnuz (or auto).")
@click.option("--quantization-param-path", type=click.Path(dir_okay=False),
              help="KV scales JSON (vLLM schema); default: checkpoint scales, else 1.0.")
@click.option("--calculate-kv-scales", is_flag=True, help="Compute scales from the first window.")
@click.option("--kv-scales", type=click.Choice(["static", "dynamic"]), default="static", show_default=True,
              help="dynamic: a scale per token and KV head computed as the cache is written (no scales file).")
@click.option("--kv-rotation", type=click.Choice(["auto", "none", "hadamard"]), default="auto", show_default=True,
              help="With --kv-scales dynamic: Hadamard-rotate K/V first (auto: where the head size allows).")
@click.option("--kv-cache-dtype-skip-layers", "skip_layers", type=LayerIds(), default=(), metavar="0,1,...",
              help="Layers whose cache stays in the model dtype (what `fp8kv calibrate --skip-layers-kl-budget` "
                   "suggests).")
@click.option("--dtype", default="float32", show_default=True, help="Model dtype: float32 or bfloat16.")
@click.option("--text", "text_path", type=click.Path(dir_okay=False),
              help="Plain-text file to score (default: the WikiText-2 test text).")
@click.option("--kv-recent-window", type=click.IntRange(min=0), default=None,
              help="Newest tokens per position read in full precision (0: plain FP8; default 32 for FP8).")
@click.option("--kv-recent-window-sinks", type=click.IntRange(min=0), default=1, show_default=True,
              help="With a recent window: each window's first N tokens (attention sinks) also read in full "
                   "precision (0: only the recent window).")
@click.option("--kv-recent-window-dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              default="auto", show_default=True, help="dtype of that window (auto: the model dtype).")
@click.option("--device", default="auto", show_default=True,
              help="auto (the first GPU if torch sees one, else the CPU), cpu, cuda or cuda:N.")
@click.option("--windows", default=6, show_default=True, help="Number of consecutive windows.")
@click.option("--window-len", default=1024, show_default=True, help="Tokens per window.")
@click.option("--per-layer", is_flag=True,
              help="Also each layer's K/V quantization error (relative MSE of the dequantized values) and "
                   "saturation, every layer shown (static FP8 scales).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--load-format", type=click.Choice(["auto", "dummy"]), default="auto", show_default=True,
              help="Only auto (the checkpoint's weights): random weights (dummy) have no quality to measure.")
@click.option("--revision", metavar="REV", help="Hub ids: the branch, tag or commit to use (default: main).")
@click.option("--download-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="Hub ids: the Hugging Face cache folder to read and download into (default: $HF_HOME/hub).")
def eval_command(model: str | None, kv_cache_dtype: str, quantization_param_path: str | None,
                 calculate_kv_scales: bool, kv_scales: str, kv_rotation: str, skip_layers: tuple[int, ...],
                 dtype: str, text_path: str | None, kv_recent_window: int | None, kv_recent_window_sinks: int,
                 kv_recent_window_dtype: str, device: str, windows: int, window_len: int, per_layer: bool,
                 as_json: bool,
                 load_format: str, revision: str | None, download_dir: str | None) -> None:
    """Measure what an FP8 cache costs in quality (decode-faithful perplexity, KL, top-1 agreement)."""
    if load_format == "dummy":
        _fail("--load-format dummy gives random weights, whose perplexity and KL say nothing about a real model's "
              "quality; evaluate a model folder with its weights (drop --load-format dummy), and measure random "
              "weights' speed and memory with `fp8kv bench throughput|capacity --load-format dummy`")
    from fp8cache.config import EngineConfig
    from fp8cache.model.preflight import check_engine_scales
    from fp8cache.quality.eval import evaluate
    from launcher.logs import setup_logging

    setup_logging()

    config = EngineConfig(model=model, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                          quantization_param_path=quantization_param_path,
                          calculate_kv_scales=calculate_kv_scales, kv_scales=kv_scales, kv_rotation=kv_rotation,
                          kv_cache_dtype_skip_layers=skip_layers, enable_prefix_caching=False,
                          kv_recent_window=kv_recent_window, kv_recent_window_dtype=kv_recent_window_dtype,
                          kv_recent_window_sinks=kv_recent_window_sinks,
                          device=device, revision=revision, download_dir=download_dir)
    try:
        check_engine_scales(config)  # a bad scales file fails now, not after the model loads
        result = evaluate(config, text_path=text_path, windows=windows, window_len=window_len,
                          progress=not as_json, per_layer=per_layer)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(title=f"{result['kv_cache_dtype']} vs auto {dtype}, {result['tokens']} tokens on {result['device']} "
                        f"({result['windows']} windows), scales: {result['scales_source']}, "
                        f"recent window: {result['kv_recent_window']}"
                        + (f" + {result['kv_recent_window_sinks']} sink" + ("s" if result["kv_recent_window_sinks"] > 1 else "")
                           if result["kv_recent_window_sinks"] else "")
                        + (f", layers kept in {dtype}: {','.join(map(str, result['kv_cache_dtype_skip_layers']))}"
                           if result["kv_cache_dtype_skip_layers"] else "")
                        + (f" ({result['kv_recent_window_dtype']})" if result["kv_recent_window"] else ""))
    for col in ("kv cache", "PPL", "baseline PPL", "KL", "top-1 agree"):
        table.add_column(col, justify="right")
    table.add_row(result["kv_cache_dtype"], f"{result['ppl']:.3f}", f"{result['baseline_ppl']:.3f}",
                  f"{result['kl']:.5f}", f"{100 * result['top1_agreement']:.2f}%")
    Console().print(table)
    if per_layer:
        _print_per_layer(result["saturation"], result["kv_cache_dtype"], result["kv_cache_dtype_skip_layers"])
    else:
        _print_saturation(result["saturation"])


def _print_per_layer(rows: list[dict], kv_cache_dtype: str, skip_layers: list[int]) -> None:
    """Every layer's K and V: relative MSE of the dequantized values, clipped and flushed-to-zero shares."""
    if not rows:
        Console().print(f"per-layer error: only measured for an FP8 cache ({kv_cache_dtype} stores the values)")
        return
    table = Table(title="Per layer: K/V quantization error and saturation")
    for col in ("layer", "kind", "relative MSE", "clipped %", "flushed %"):
        table.add_column(col, justify="right")
    for r in rows:
        if r["layer"] in skip_layers:
            table.add_row(str(r["layer"]), r["kind"].upper(), "model dtype", "-", "-")
            continue
        written = r["written"] or 1
        table.add_row(str(r["layer"]), r["kind"].upper(), f"{r['relative_mse']:.3e}",
                      f"{100 * r['saturated'] / written:.3f}%", f"{100 * r['underflow'] / written:.3f}%")
    Console().print(table)


def _print_saturation(rows: list[dict]) -> None:
    """Per layer, the K/V values the cache write lost (clipped at the format's max, nonzero ones written as
    zero); only layers that lost any, and one line when none did."""
    if not rows:
        return
    lossy = [r for r in rows if r["saturated"] or r["underflow"]]
    if not lossy:
        Console().print(f"saturation: no K/V value clipped or flushed to zero ({rows[0]['written']} per layer and kind)")
        return
    table = Table(title="K/V values lost by the cache write (layers without loss left out)")
    for col in ("layer", "kind", "written", "clipped", "clipped %", "flushed to zero"):
        table.add_column(col, justify="right")
    for r in lossy:
        share = 100 * r["saturated"] / r["written"] if r["written"] else 0.0
        table.add_row(str(r["layer"]), r["kind"].upper(), str(r["written"]), str(r["saturated"]), f"{share:.3f}%",
                      str(r["underflow"]))
    Console().print(table)
