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
        with console.status("compiling fp8kv ops for this machine..."):
            path = _build.build(verbose=verbose, device=None if device == "auto" else device,
                                progress_callback=lambda line: console.print(line, style="dim", markup=False))
    except RuntimeError as exc:
        _fail(str(exc))
    built = _build.last_build()
    console.print(f"[green]ops ready:[/] {path} ({'CPU and GPU' if built.with_cuda else 'CPU'} kernels)")


def build_ops_ahead(device: str) -> None:
    """Start making the ops for `device` in the background (fp8cache.ops._build.build_ahead), so that a first start
    compiles them while it fetches, converts and loads the model, not after; the engine takes the result. Only
    where the command is the program: one run in-process (CliRunner) leaves its host's op library alone. A
    device this machine lacks is left to the command's own check, which says so."""
    from launcher.logs import owns_the_process

    if not owns_the_process():
        return
    from fp8cache.ops import _build
    from fp8cache.platform.device import resolve_device

    try:
        _build.build_ahead(resolve_device(device))
    except (RuntimeError, ValueError):  # no such device, no nvcc: said with the fix when the engine starts
        return
