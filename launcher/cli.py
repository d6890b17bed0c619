"""`fp8kv`: the command line. It parses flags, prints and supervises; the work lives in fp8cache.

This file makes the `fp8kv` group and its `bench` subgroup and registers the commands, one file each.
"""

from __future__ import annotations

import click

from fp8cache.platform import paths


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": paths.FLAG_ENV_PREFIX})
@click.version_option(package_name="fp8kv")
def main() -> None:
    """Serve language models with an FP8 KV cache."""
    from launcher.logs import progress_bars_only_on_a_terminal

    progress_bars_only_on_a_terminal()


@main.group()
def bench() -> None:
    """Measure kernels, throughput and capacity."""


def _register_commands() -> None:
    from launcher.bench import capacity, serve, throughput
    from launcher.bench_kernels import bench_kernels
    from launcher.build import build
    from launcher.calibrate import calibrate
    from launcher.eval import eval_command
    from launcher.generate import generate
    from launcher.run import run
    from launcher.systemd_unit import systemd_unit

    for command in (build, run, generate, systemd_unit, calibrate, eval_command):
        main.add_command(command)
    for command in (bench_kernels, throughput, capacity, serve):
        bench.add_command(command)


_register_commands()

if __name__ == "__main__":
    main()
