"""`fp8kv`: the command line. It parses flags, prints and supervises; the work lives in fp8cache.

This file makes the `fp8kv` group and its `bench` subgroup and names the commands, one file each, imported when
used.
"""

from __future__ import annotations

import importlib

import click

from fp8cache.platform import paths


class _Commands(click.Group):
    """A group whose commands are imported when asked for: `fp8kv systemd-unit` or `fp8kv run --help` import
    only their own file (torch-free), not every command's (calibrate's choices come from modules that import
    torch: two seconds before anything is printed)."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy and name not in self.commands:
            module, attr = self.lazy[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)


@click.group(cls=_Commands, lazy={
    "build": "launcher.build:build", "run": "launcher.run:run", "generate": "launcher.generate:generate",
    "systemd-unit": "launcher.systemd_unit:systemd_unit", "calibrate": "launcher.calibrate:calibrate",
    "eval": "launcher.eval:eval_command"},
    context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": paths.FLAG_ENV_PREFIX})
@click.version_option(package_name="fp8kv")
def main() -> None:
    """Serve language models with an FP8 KV cache."""
    from launcher.logs import progress_bars_only_on_a_terminal

    progress_bars_only_on_a_terminal()


@click.group(cls=_Commands, lazy={
    "kernels": "launcher.bench_kernels:bench_kernels", "throughput": "launcher.bench:throughput",
    "capacity": "launcher.bench:capacity", "serve": "launcher.bench:serve"})
def bench() -> None:
    """Measure kernels, throughput and capacity."""


main.add_command(bench)


if __name__ == "__main__":
    main()
