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
def build(verbose: bool) -> None:
    """Compile the ops for this machine ahead of time (e.g. systemd ExecStartPre=)."""
    from fp8cache.ops import _build

    try:
        with console.status("compiling fp8kv ops for this machine (first time takes a minute)..."):
            path = _build.build(verbose=verbose)
    except RuntimeError as exc:
        fail(str(exc))
    console.print(f"[green]ops ready:[/] {path}")


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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list of rows on stdout.")
def bench_kernels(shapes: str, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                  repeats: int, as_json: bool) -> None:
    """Decode attention per kv-cache dtype vs torch SDPA on a dense float32 cache."""
    from fp8cache.bench import kernels, machine

    if num_heads % num_kv_heads:
        raise click.BadParameter("must divide --num-heads", param_hint="--num-kv-heads")
    info = machine.describe()
    console.print(f"machine: {info['cpu']}, {info['threads']} threads, torch {info['torch']}")
    with console.status("measuring...") as status:
        rows = kernels.run_kernel_bench(
            _parse_shapes(shapes), num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
            block_size=block_size, repeats=repeats,
            on_row=lambda r: status.update(f"measured {r['impl']} {r['kv_cache_dtype']} "
                                           f"b{r['batch']} ctx{r['context']}: {r['ms']:.2f} ms"))
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    table = Table(title=f"decode attention, {num_heads} heads / {num_kv_heads} KV heads, d{head_size}, "
                        f"read bandwidth {rows[0]['read_bw_gbps']:.1f} GB/s")
    for col in ("impl", "kv cache", "dtype", "batch", "context", "ms", "KV GB/s", "% of bw"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["impl"], r["kv_cache_dtype"], r["dtype"], str(r["batch"]), str(r["context"]),
                      f"{r['ms']:.3f}", f"{r['kv_gbps']:.1f}", f"{100 * r['kv_gbps'] / r['read_bw_gbps']:.0f}%")
    Console().print(table)


if __name__ == "__main__":
    main()
