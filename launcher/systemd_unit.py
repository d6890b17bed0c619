"""`fp8kv systemd-unit`: the run flags given here become a unit file printed on stdout.

This file settles what depends on this machine and these flags (the executable, GPU or not, MemoryMax=,
paths the sandbox would hide); launcher/unit_file.py writes the unit text.
"""

from __future__ import annotations

import os
import shutil
import sys

import click

from launcher.help_sections import SectionedCommand, SectionedOption
from launcher.logs import logger, setup_logging
from launcher.options import engine_options, memory_arg, pick_model, server_options
from launcher.unit_file import MEMORY_HEADROOM, render_unit


@click.command("systemd-unit", cls=SectionedCommand, context_settings={"show_default": True})
@click.argument("model", required=False, metavar="[MODEL]")
@engine_options
@server_options
@click.option("--exec", "exec_path", cls=SectionedOption, section="Unit", default=None, metavar="PATH",
              help="fp8kv executable for ExecStart= (default: the one on PATH, else this Python's).")
@click.option("--template", cls=SectionedOption, section="Unit", is_flag=True,
              help="Write a template unit (fp8kv@.service) that also reads /etc/fp8kv/%i.env.")
@click.option("--user", "unit_user", cls=SectionedOption, section="Unit", default="fp8kv",
              help="Name of the dynamic user the service runs as.")
@click.option("--watchdog-sec", cls=SectionedOption, section="Unit", type=click.IntRange(min=0), default=120,
              help="WatchdogSec= (0: no watchdog). A step longer than this restarts the service.")
@click.option("--description", cls=SectionedOption, section="Unit", default=None, help="Description= of the unit.")
@click.pass_context
def systemd_unit(ctx: click.Context, model: str | None, exec_path: str | None, template: bool, unit_user: str,
                 watchdog_sec: int, description: str | None, **kw) -> None:
    """Print a systemd service unit that runs `fp8kv run` with these flags.

    The unit hides every device (PrivateDevices=yes) unless --device names a GPU: then it allows only the
    NVIDIA and ROCm device nodes. --device auto is settled when the unit is printed, from whether torch sees a
    GPU on this machine; pass --device cpu or cuda when the unit is for another machine. With
    --kv-cache-memory and a model folder, a CPU unit gets MemoryMax= (cache + weights + headroom).

    Example: fp8kv systemd-unit ./my-model --kv-cache-dtype fp8 --port 8001 > /etc/systemd/system/fp8kv.service
    """
    setup_logging(libraries=False)  # its notes and warnings are lines of the log, on stderr; the unit is stdout
    given = [name for name in kw if ctx.get_parameter_source(name) in
             (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)]
    if "api_key" in given:
        given.remove("api_key")
        logger.info("the API key is not written into the unit (units are world-readable); put FP8KV_API_KEY=... "
                    "in /etc/fp8kv/fp8kv.env (mode 0600)")
    flags = _flags_for(ctx, given, kw)
    model = pick_model(model, kw["model_option"])
    args = ["run"] + ([os.path.abspath(model)] if model and os.path.exists(model) else [model] if model else [])
    command = [exec_path] if exec_path else fp8kv_command()
    # Without an installed `fp8kv` script, `python -m launcher.cli` must find this source tree.
    pythonpath = _source_root() if command[1:2] == ["-m"] else None
    paths = [model, kw["quantization_param_path"], kw["tokenizer"], *command, pythonpath]
    gpu = _unit_wants_gpu(kw["device"])
    in_tmp = _under_tmp(paths)
    if in_tmp:
        logger.warning("the service needs %s, but the unit's PrivateTmp=yes gives it an empty /tmp and /var/tmp, "
                       "so it will not start: move the venv and the model elsewhere (e.g. /opt/fp8kv, /srv/models) "
                       "and print the unit again", in_tmp)
    try:
        memory_max = None if gpu else _memory_max(kw["kv_cache_memory"], model)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--kv-cache-memory") from exc
    click.echo(render_unit(command, args + flags, template=template, user=unit_user,
                           graceful_timeout=kw["graceful_timeout"], watchdog_sec=watchdog_sec,
                           description=description, home_access="read-only" if _under_home(paths) else "yes",
                           gpu=gpu, pythonpath=pythonpath, memory_max=memory_max), nl=False)


def _unit_wants_gpu(device: str | None) -> bool:
    """Whether the unit must let the service reach a GPU. `auto` is settled here, on the machine the unit is
    made on: a GPU host gets GPU access, a CPU host the full sandbox (PrivateDevices=, PrivateUsers=)."""
    if device in (None, "", "auto"):
        from fp8cache.platform.device import gpu_available

        found = gpu_available()
        logger.info("--device auto: torch %s GPU here, so the unit %s; pass --device cpu or --device cuda to "
                    "choose for another machine", "sees a" if found else "sees no",
                    "keeps /dev/nvidia*, /dev/kfd and /dev/dri visible" if found else "hides all devices")
        return found
    return not device.startswith("cpu")


def _under_tmp(paths: list[str | None]) -> str | None:
    """The first path the service would need from /tmp or /var/tmp (PrivateTmp=yes hides both)."""
    for p in paths:
        if p and os.path.realpath(p).startswith(("/tmp/", "/var/tmp/")):
            return p
    return None


def _memory_max(kv_cache_memory: str | None, model: str | None) -> int | None:
    """MemoryMax= for a CPU unit when the KV budget is given: KV budget + twice the weights on disk (a 16-bit
    checkpoint runs in float32 on a CPU without native bfloat16) + MEMORY_HEADROOM. None when the budget or the weights are unknown."""
    if kv_cache_memory is None or model is None or not os.path.isdir(model):
        return None
    from fp8cache.kvcache.sizing import parse_memory_size

    weights = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)
                  if f.endswith((".safetensors", ".bin", ".pt")))
    return parse_memory_size(memory_arg(kv_cache_memory), "--kv-cache-memory") + 2 * weights + MEMORY_HEADROOM


def _flags_for(ctx: click.Context, given: list[str], kw: dict) -> list[str]:
    params = {p.name: p for p in ctx.command.params}
    flags: list[str] = []
    for name in given:
        if name == "model_option":
            continue
        param, value = params[name], kw[name]
        if param.is_flag and param.secondary_opts:
            flags.append(param.opts[0] if value else param.secondary_opts[0])
        elif param.is_flag:
            if value:
                flags.append(param.opts[0])
        elif value is not None:
            if isinstance(value, str) and name == "quantization_param_path":
                value = os.path.abspath(value)
            if isinstance(value, tuple):  # layer ids: written back as the flag takes them
                value = ",".join(map(str, value))
            flags += [param.opts[0], str(value)]
    return flags


def _source_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _under_home(paths: list[str | None]) -> bool:
    """Whether the service must read below /home or /root (ProtectHome=yes would hide them)."""
    return any(p and os.path.abspath(p).startswith(("/home/", "/root/")) for p in paths)


def fp8kv_command() -> list[str]:
    """How systemd should start fp8kv: the installed script, else this Python with -m launcher.cli."""
    found = shutil.which("fp8kv") or os.path.join(os.path.dirname(sys.executable), "fp8kv")
    if os.path.isfile(found) and os.access(found, os.X_OK):
        return [os.path.realpath(found)]
    return [os.path.realpath(sys.executable), "-m", "launcher.cli"]

