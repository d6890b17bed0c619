"""`fp8kv`: the command line. It parses flags, prints and supervises; the work lives in fp8cache."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


def fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "FP8KV"})
@click.version_option(package_name="fp8kv")
def main() -> None:
    """Serve language models with an FP8 KV cache."""


@main.command()
@click.option("--verbose", is_flag=True, help="Show the compiler's output.")
@click.option("--device", default="auto", show_default=True,
              help="What the ops must run on: auto (the GPU ops too when torch sees a GPU and nvcc is here), "
                   "cpu (no GPU sources), cuda.")
def build(verbose: bool, device: str) -> None:
    """Compile the ops for this machine ahead of time (e.g. systemd ExecStartPre=)."""
    from fp8cache.ops import _build

    try:
        with console.status("compiling fp8kv ops for this machine (first time takes a minute)..."):
            path = _build.build(verbose=verbose, device=None if device == "auto" else device,
                                progress_callback=lambda line: console.print(line, style="dim", markup=False))
    except RuntimeError as exc:
        fail(str(exc))
    built = _build.last_build()
    console.print(f"[green]ops ready:[/] {path} ({'CPU and GPU' if built.with_cuda else 'CPU'} kernels)")


@main.group()
def bench() -> None:
    """Measure kernels, throughput and capacity."""


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        try:
            batch, context = item.split("x")
            shapes.append((int(batch), int(context)))
        except ValueError:
            raise click.BadParameter(f"{item!r} is not BATCHxCONTEXT, e.g. 8x8192", param_hint="--shapes")
    return shapes


@bench.command("kernels")
@click.option("--shapes", default="1x512,1x16384,8x2048,8x8192,32x512,32x4096", show_default=True,
              help="Comma-separated BATCHxCONTEXT pairs.")
@click.option("--num-heads", default=32, show_default=True)
@click.option("--num-kv-heads", default=8, show_default=True)
@click.option("--head-size", default=128, show_default=True)
@click.option("--block-size", default=16, show_default=True)
@click.option("--repeats", default=5, show_default=True, help="Timed repeats per row (median).")
@click.option("--settle-ms", default=20.0, show_default=True, type=click.FloatRange(min=0),
              help="Untimed calls of a twin of each case right before its timed call (0: none, each call "
                   "then runs in the wake of the case before it).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list of rows on stdout.")
@click.option("--device", default="auto", show_default=True,
              help="Where the caches live and the kernels run: auto (the first GPU if torch sees one, else the "
                   "CPU), cpu, cuda or cuda:N.")
def bench_kernels(shapes: str, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                  repeats: int, settle_ms: float, as_json: bool, device: str) -> None:
    """Decode attention per kv-cache dtype vs torch SDPA on a dense float32 cache."""
    import torch

    from fp8cache.bench import kernels, machine

    if num_heads % num_kv_heads:
        raise click.BadParameter("must divide --num-heads", param_hint="--num-kv-heads")
    from fp8cache.device import DeviceError, resolve_device

    try:
        device = resolve_device(device)
    except DeviceError as exc:
        raise click.BadParameter(str(exc), param_hint="--device") from exc
    info = machine.describe()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{info['threads']} threads"
    console.print(f"machine: {info['cpu']}, {where}, torch {info['torch']}")
    with console.status("measuring...") as status:
        rows = kernels.run_kernel_bench(
            _parse_shapes(shapes), num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
            block_size=block_size, repeats=repeats, settle_ms=settle_ms, device=device,
            on_row=lambda r: status.update(f"measured {r['impl']} {r['kv_cache_dtype']} "
                                           f"b{r['batch']} ctx{r['context']}: {r['ms']:.2f} ms"))
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    bandwidths = sorted({round(r["read_bw_gbps"], 1) for r in rows})
    read_bw = f"{bandwidths[0]}" if len(bandwidths) == 1 else f"{bandwidths[0]}-{bandwidths[-1]}"
    probe = rows[0]["bandwidth_probe"] if rows else "read"
    table = Table(title=f"decode attention, {num_heads} heads / {num_kv_heads} KV heads, d{head_size}, "
                        f"{probe} bandwidth {read_bw} GB/s (measured taking turns with each shape's cases)")
    for col in ("impl", "kv cache", "dtype", "batch", "context", "ms", "KV GB/s", "% of bw"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["impl"], r["kv_cache_dtype"], r["dtype"], str(r["batch"]), str(r["context"]),
                      f"{r['ms']:.3f}", f"{r['kv_gbps']:.1f}", f"{100 * r['kv_gbps'] / r['read_bw_gbps']:.0f}%")
    Console().print(table)


@main.command("eval")
@click.argument("model", required=False)
@click.option("--kv-cache-dtype", default="fp8_e4m3", show_default=True,
              help="Cache to measure against the auto float32 baseline: fp8, fp8_e4m3, fp8_e5m2, "
                   "fp8_e4m3fnuz (or auto).")
@click.option("--quantization-param-path", type=click.Path(dir_okay=False),
              help="KV scales JSON (vLLM schema); default: checkpoint scales, else 1.0.")
@click.option("--calculate-kv-scales", is_flag=True, help="Compute scales from the first window.")
@click.option("--dtype", default="float32", show_default=True, help="Model dtype: float32 or bfloat16.")
@click.option("--text", "text_path", type=click.Path(dir_okay=False),
              help="Plain-text file to score (default: the WikiText-2 test text).")
@click.option("--kv-recent-window", type=click.IntRange(min=0), default=None,
              help="Newest tokens per position read in full precision (0: plain FP8; default 32 for FP8).")
@click.option("--kv-recent-window-dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              default="auto", show_default=True, help="dtype of that window (auto: the model dtype).")
@click.option("--device", default="auto", show_default=True,
              help="auto (the first GPU if torch sees one, else the CPU), cpu, cuda or cuda:N.")
@click.option("--windows", default=6, show_default=True, help="Number of consecutive windows.")
@click.option("--window-len", default=1024, show_default=True, help="Tokens per window.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def eval_command(model: str | None, kv_cache_dtype: str, quantization_param_path: str | None,
                 calculate_kv_scales: bool, dtype: str, text_path: str | None, kv_recent_window: int | None,
                 kv_recent_window_dtype: str, device: str, windows: int, window_len: int, as_json: bool) -> None:
    """Measure what an FP8 cache costs in quality (decode-faithful perplexity, KL, top-1 agreement)."""
    from fp8cache.config import EngineConfig
    from fp8cache.eval import evaluate
    from fp8cache.kvcache.scales import check_engine_scales

    config = EngineConfig(model=model, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                          quantization_param_path=quantization_param_path,
                          calculate_kv_scales=calculate_kv_scales, enable_prefix_caching=False,
                          kv_recent_window=kv_recent_window, kv_recent_window_dtype=kv_recent_window_dtype,
                          device=device)
    try:
        check_engine_scales(config)  # a bad scales file fails now, not after the model loads
        result = evaluate(config, text_path=text_path, windows=windows, window_len=window_len,
                          progress=not as_json)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(title=f"{result['kv_cache_dtype']} vs auto {dtype}, {result['tokens']} tokens on {result['device']} "
                        f"({result['windows']} windows), scales: {result['scales_source']}, "
                        f"recent window: {result['kv_recent_window']}"
                        + (f" ({result['kv_recent_window_dtype']})" if result["kv_recent_window"] else ""))
    for col in ("kv cache", "PPL", "baseline PPL", "KL", "top-1 agree"):
        table.add_column(col, justify="right")
    table.add_row(result["kv_cache_dtype"], f"{result['ppl']:.3f}", f"{result['baseline_ppl']:.3f}",
                  f"{result['kl']:.5f}", f"{100 * result['top1_agreement']:.2f}%")
    Console().print(table)


def _register_commands() -> None:
    from launcher.bench_commands import capacity, serve, throughput
    from launcher.calibrate_command import calibrate
    from launcher.generate_command import generate
    from launcher.run import run
    from launcher.systemd_command import systemd_unit

    for command in (run, generate, systemd_unit, calibrate):
        main.add_command(command)
    for command in (throughput, capacity, serve):
        bench.add_command(command)


_register_commands()

if __name__ == "__main__":
    main()
