"""`fp8kv`: the command line. It parses flags, prints and supervises; the work lives in fp8cache.

This file makes the `fp8kv` group and its `bench` subgroup and names the commands, one file each, imported when
used.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import click

from fp8cache.platform import envs


class LazyCommand(NamedTuple):
    target: str  # "module:attribute" of the click command
    summary: str  # its line in the group's --help: whole, one sentence


class _Commands(click.Group):
    """A group whose commands are imported when asked for: `fp8kv systemd-unit` or `fp8kv run --help` import
    only their own file, and `fp8kv --help` none (calibrate's imports torch: a second and a half before anything
    is printed). The summaries it lists are the table's, so that listing imports nothing."""

    def __init__(self, *args, lazy: dict[str, LazyCommand] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy and name not in self.commands:
            module, attr = self.lazy[name].target.split(":")
            command = getattr(importlib.import_module(module), attr)
            command.short_help = self.lazy[name].summary
            self.add_command(command, name)
        return super().get_command(ctx, name)

    def summary(self, ctx: click.Context, name: str) -> str:
        """The command's line in --help; a command added directly (not lazy) says its own."""
        if name in self.lazy:
            return self.lazy[name].summary
        command = self.commands[name]
        return command.short_help or command.get_short_help_str(limit=1000)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, self.summary(ctx, name)) for name in self.list_commands(ctx)
                if name in self.lazy or not self.commands[name].hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=_Commands, lazy={
    "run": LazyCommand("launcher.run:run", "Serve a model over HTTP: the OpenAI and TGI APIs."),
    "generate": LazyCommand("launcher.generate:generate", "Generate from a prompt without a server."),
    "build": LazyCommand("launcher.build:build", "Compile the ops for this machine ahead of time."),
    "systemd-unit": LazyCommand("launcher.systemd_unit:systemd_unit",
                                "Print a systemd unit that runs `fp8kv run` with these flags."),
    "calibrate": LazyCommand("launcher.calibrate:calibrate", "Measure a model's KV cache scales into a file."),
    "eval": LazyCommand("launcher.eval:eval_command", "Measure what an FP8 cache costs in quality."),
}, context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": envs.FLAG_ENV_PREFIX})
@click.version_option(package_name="fp8kv")
def main() -> None:
    """Serve language models with an FP8 KV cache."""
    from launcher.logs import progress_bars_only_on_a_terminal

    progress_bars_only_on_a_terminal()


@click.group(cls=_Commands, short_help="Measure kernels, throughput and capacity.", lazy={
    "kernels": LazyCommand("launcher.bench_kernels:bench_kernels",
                           "Time decode attention per KV cache dtype against torch SDPA."),
    "throughput": LazyCommand("launcher.bench:throughput", "Offline throughput per KV cache dtype, in one run."),
    "capacity": LazyCommand("launcher.bench:capacity", "Tokens that fit a KV cache budget, and the batch they allow."),
    "serve": LazyCommand("launcher.bench:serve", "Latency and throughput of a running server under load."),
})
def bench() -> None:
    """Measure kernels, throughput and capacity."""


main.add_command(bench)


if __name__ == "__main__":
    main()
