"""`fp8kv build`: compile the ops for this machine ahead of time (the compiling is fp8cache.ops')."""

from __future__ import annotations

import sys

import click
from rich.console import Console

console = Console(stderr=True, soft_wrap=True)


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    sys.exit(2)


@click.command()
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
        _fail(str(exc))
    built = _build.last_build()
    console.print(f"[green]ops ready:[/] {path} ({'CPU and GPU' if built.with_cuda else 'CPU'} kernels)")
