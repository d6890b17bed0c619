"""`fp8kv bench kernels`: decode attention per kv-cache dtype against torch SDPA, as a table or --json.

The measuring is fp8cache.bench.kernels'; the other bench commands are in bench_commands.py.
"""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table

from launcher.bench import CPU_ISA_OPT, load_cpu_path

console = Console(stderr=True, soft_wrap=True)


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        try:
            batch, context = item.split("x")
            shapes.append((int(batch), int(context)))
        except ValueError:
            raise click.BadParameter(f"{item!r} is not BATCHxCONTEXT, e.g. 8x8192", param_hint="--shapes")
    return shapes


@click.command("kernels")
@click.option("--shapes", default="1x512,1x16384,8x2048,8x8192,32x512,32x4096", show_default=True,
              help="Comma-separated BATCHxCONTEXT pairs.")
@click.option("--num-heads", default=32, show_default=True)
@click.option("--num-kv-heads", default=8, show_default=True)
@click.option("--head-size", default=128, show_default=True)
@click.option("--heads", "heads_list", default=None, metavar="H/KV/D,...",
              help="Several attention shapes in one run, each at every --shapes pair, e.g. 32/8/128,9/3/64,28/4/128 "
                   "(Llama-3.1-8B, the default model, Qwen2-7B); replaces --num-heads/--num-kv-heads/--head-size.")
@click.option("--block-size", default=16, show_default=True)
@click.option("--repeats", default=5, show_default=True, help="Timed repeats per row (median).")
@click.option("--settle-ms", default=20.0, show_default=True, type=click.FloatRange(min=0),
              help="Untimed calls of a twin of each case right before its timed call (0: none, each call "
                   "then runs in the wake of the case before it).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list of rows on stdout.")
@click.option("--device", default="auto", show_default=True,
              help="Where the caches live and the kernels run: auto (the first GPU if torch sees one, else the "
                   "CPU), cpu, cuda or cuda:N.")
@click.option("--kv-scales", type=click.Choice(["static", "dynamic", "both"]), default="static", show_default=True,
              help="The FP8 caches' scales: dynamic reads a scale per token and KV head; both measures each FP8 "
                   "case with either, side by side.")
@click.option("--cache-write", is_flag=True, help="Also time each FP8 case's cache write (reshape_and_cache) of "
                                                  "BATCH x CONTEXT tokens.")
@CPU_ISA_OPT
def bench_kernels(shapes: str, num_heads: int, num_kv_heads: int, head_size: int, heads_list: str | None,
                  block_size: int, repeats: int, settle_ms: float, as_json: bool, device: str, kv_scales: str,
                  cache_write: bool, cpu_isa: str) -> None:
    """Decode attention per kv-cache dtype vs torch SDPA on a dense cache (float32 on a CPU, bfloat16 on a GPU)."""

    from fp8cache.bench import kernels, machine

    if num_heads % num_kv_heads:
        raise click.BadParameter("must divide --num-heads", param_hint="--num-kv-heads")
    try:
        heads = kernels.parse_heads(heads_list) if heads_list else [(num_heads, num_kv_heads, head_size)]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--heads") from exc
    parsed_shapes = _parse_shapes(shapes)
    from fp8cache.platform.device import DeviceError, gpu_name, resolve_device

    try:
        device = resolve_device(device)
    except DeviceError as exc:
        raise click.BadParameter(str(exc), param_hint="--device") from exc
    load_cpu_path(device, cpu_isa)  # a lower path is loaded before the bench's own load, which then reuses it
    info = machine.describe()
    where = gpu_name(device) if device.type == "cuda" else f"{info['threads']} threads"
    path = machine.cpu_path(device)
    console.print(f"machine: {info['cpu']}, {where}, torch {info['torch']}" + (f", CPU path {path}" if path else ""))
    with console.status("measuring...") as status:
        rows = kernels.run_kernel_bench(
            parsed_shapes, cases=kernels.default_cases(device, kv_scales, cache_write), heads=heads,
            block_size=block_size, repeats=repeats, settle_ms=settle_ms, device=device,
            on_row=lambda r: status.update(f"measured {r['impl']} {r['kv_cache_dtype']} "
                                           f"b{r['batch']} ctx{r['context']}: {r['ms']:.2f} ms"))
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    bandwidths = sorted({round(r["read_bw_gbps"], 1) for r in rows})
    read_bw = f"{bandwidths[0]}" if len(bandwidths) == 1 else f"{bandwidths[0]}-{bandwidths[-1]}"
    probe = rows[0]["bandwidth_probe"] if rows else "read"
    named = ", ".join(f"{h} heads / {kv} KV heads, d{d}" for h, kv, d in heads)
    table = Table(title=f"decode attention, {named}, "
                        f"{probe} bandwidth {read_bw} GB/s (measured taking turns with each shape's cases)")
    several = len(heads) > 1
    for col in (("heads",) if several else ()) + ("impl", "kv cache", "dtype", "batch", "context", "ms", "KV GB/s",
                                                  "% of bw"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*((f"{r['num_heads']}/{r['num_kv_heads']} d{r['head_size']}",) if several else ()),
                      r["impl"] + (" write" if r["op"] == "cache_write" else ""),
                      r["kv_cache_dtype"] + (" dynamic" if r["kv_scales"] == "dynamic" else ""), r["dtype"],
                      str(r["batch"]), str(r["context"]),
                      f"{r['ms']:.3f}", f"{r['kv_gbps']:.1f}", f"{100 * r['kv_gbps'] / r['read_bw_gbps']:.0f}%")
    Console(width=None if sys.stdout.isatty() else 200).print(table)  # piped: whole cells, not 80 columns
