"""Flags that `fp8kv run`, `generate` and `systemd-unit` share, and the EngineConfig they make.

Every flag also reads an FP8KV_* environment variable (shown in --help), so a systemd EnvironmentFile or a
container's environment can configure the server without a command line.

The engine flags are made here from EngineConfig's fields (fp8cache/config.py: each field's type, default, check
and --help words, declared with setting()), in field order; engine_config() passes them back by name. A new engine
setting is one field there (tests/launcher/test_engine_flags.py checks every field has its flag, or a reason not).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import typing
from collections.abc import Callable
from typing import NoReturn

import click
from rich.console import Console

from fp8cache.config import EngineConfig, literal_choices
from fp8cache.engine.generation_defaults import DEFAULT_MAX_TOKENS
from fp8cache.model.shapes import shape_names
from fp8cache.platform import envs
from launcher.help_sections import SectionedOption

SHAPES = ", ".join(shape_names())  # for --help; fp8cache/data/shapes

console = Console(stderr=True, soft_wrap=True)
DEFAULT_GRACEFUL_TIMEOUT = 30.0


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one error line and exit with `code` (2: a configuration error, which a restart does not fix).
    Once the command has set up its log (launcher/logs.py), the line is an ERROR line of that log."""
    from launcher.logs import say_error

    say_error(message, console)
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        # A tensor-parallel rank (a model too large for its cache, say) ends without interpreter teardown, where
        # gloo's threads can abort it (SIGABRT) instead of exiting with this status.
        from fp8cache.distributed import parallel_state

        parallel_state.exit_rank(code)
    sys.exit(code)


def env_var(name: str) -> str:
    """The environment variable behind a flag: kv-cache-dtype -> FP8KV_KV_CACHE_DTYPE."""
    return envs.flag_env(name)


def speculative_arg(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> str | None:
    """--speculative-config JSON, checked now (a bad value is a usage error, not a failure after loading); kept
    as given, so that systemd-unit writes it back unchanged."""
    from fp8cache.engine.speculative_config import SpeculativeConfig

    try:
        SpeculativeConfig.parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


class LayerIds(click.ParamType):
    """Layer ids as "0,1,5" on the command line (a tuple of ints for EngineConfig)."""

    name = "LAYERS"

    def convert(self, value, param, ctx) -> tuple[int, ...]:
        from fp8cache.config import layer_ids

        try:
            return layer_ids(value, param.name if param is not None else "layers")
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def memory_arg(value: str | None) -> int | str | None:
    """A SIZE flag as EngineConfig takes it: digits are bytes, "2GiB" stays text for the engine to parse."""
    if value is None:
        return None
    return int(value) if value.isdigit() else value


# -- shared flags ------------------------------------------------------------------------------------

def option(*decls: str, help: str, section: str | None = None, **kwargs) -> Callable:
    """click.option whose value may also come from FP8KV_<LONG_NAME> (e.g. --kv-cache-dtype <-
    FP8KV_KV_CACHE_DTYPE), named in --help, listed there under `section` (launcher/help_sections.py)."""
    envvar = kwargs.pop("envvar", None) or env_var(decls[0].split("/")[0].removeprefix("--"))
    return click.option(*decls, envvar=envvar, help=f"{help} [env: {envvar}]", cls=SectionedOption,
                        section=section, **kwargs)


def num_shard_option(help: str) -> Callable:
    """--num-shard (alias --tensor-parallel-size), the engine's tensor_parallel_size; `help` says how the command
    starts its ranks."""
    return option("--num-shard", "--tensor-parallel-size", "num_shard", section="Device", type=click.IntRange(min=1),
                  default=1, help=help)


ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
# EngineConfig fields without a flag of their own name, and why (setting(no_flag=); tests/launcher/test_engine_flags.py).
CLI_LESS = {f.name: f.metadata["no_flag"] for f in dataclasses.fields(EngineConfig) if f.metadata["no_flag"]}
# Flags checked as they are parsed, beyond their type: a bad value is a usage error, not a failure after loading.
_CALLBACKS = {"speculative_config": speculative_arg}
# What setting(path=) means on the command line.
_PATHS = {"dir": click.Path(file_okay=False), "existing file": click.Path(exists=True, dir_okay=False)}


def _flag_type(field: dataclasses.Field, hint: object) -> click.ParamType | type | None:
    """The click type of a field's flag, from its setting() and its type (None: text)."""
    meta = field.metadata
    if meta["choices"] is not None:
        return click.Choice(meta["choices"])
    if literal_choices(hint):
        return click.Choice(literal_choices(hint))
    if meta["path"] is not None:
        return _PATHS[meta["path"]]
    if hint == tuple[int, ...]:
        return LayerIds()
    if meta["share"]:
        return click.FloatRange(0, 1, min_open=True)
    if meta["flag_type"] is not None:
        return meta["flag_type"]
    if meta["at_least"] is not None:
        return click.IntRange(min=meta["at_least"])
    return None


def engine_flag(field: dataclasses.Field, hint: object) -> Callable:
    """option() for an EngineConfig field, named as it (max_num_seqs: --max-num-seqs), with its setting()'s help,
    section and metavar, its default, and its type's choices or range; a bool is a flag (--x/--no-x when on by
    default)."""
    meta, name = field.metadata, "--" + field.name.replace("_", "-")
    kwargs = {"default": field.default, "callback": _CALLBACKS.get(field.name)}
    if hint is bool:
        if field.default:
            name = f"{name}/--no-{name[2:]}"
        else:
            kwargs["is_flag"] = True
    else:
        kwargs["type"] = _flag_type(field, hint)
    if meta["metavar"] is not None:
        kwargs["metavar"] = meta["metavar"]
    return option(name, section=meta["section"], help=meta["help"].replace("{shapes}", SHAPES), **kwargs)


def _engine_flags() -> list[Callable]:
    hints = typing.get_type_hints(EngineConfig)
    return [engine_flag(f, hints[f.name]) for f in dataclasses.fields(EngineConfig) if f.name not in CLI_LESS]


_ENGINE_OPTIONS = [
    option("--model", "model_option", section="Model", metavar="PATH", envvar=envs.flag_env("model"),
           help="Model folder (safetensors) or Hugging Face hub id (org/name: the hub cache first, else a "
                "download); same as the MODEL argument. Default: the embedded SmolLM2-135M-Instruct."),
    *_engine_flags(),
]

_SERVER_OPTIONS = [
    option("--host", section="Server", default="127.0.0.1",
           help="Address to listen on; 0.0.0.0 exposes the server to the network."),
    option("--port", section="Server", type=click.IntRange(0, 65535), default=8000,
           help="TCP port (0: any free port, printed at start)."),
    option("--api-key", section="Server", metavar="KEY",
           help="Require 'Authorization: Bearer KEY' on every route except /health."),
    option("--served-model-name", section="Server", metavar="NAME",
           help="Model name in the OpenAI API (default: the hub id, or the model folder's name)."),
    option("--graceful-timeout", section="Server", type=click.FloatRange(min=0),
           default=DEFAULT_GRACEFUL_TIMEOUT,
           help="Seconds in-flight requests get to finish after SIGTERM/SIGINT."),
    option("--log-format", section="Logging", type=click.Choice(["text", "json"]), default="text",
           help="Log lines as text, or as one JSON object per line."),
    option("--max-request-bytes", section="Server limits", type=click.IntRange(min=1024), default=4 * 2**20,
           help="Largest request body accepted (413 above)."),
    option("--max-concurrent-requests", section="Server limits", type=click.IntRange(min=1), default=256,
           help="Sequences in flight at once: a request counts its prompts times n (429 above)."),
    option("--access-log/--no-access-log", section="Logging", default=True,
           help="Log one line per HTTP request."),
    option("--max-connections", section="Server limits", type=click.IntRange(min=1),
           help="Open client connections at once; more get a 503 and are closed (default: 4096, or less to "
                "stay below the open-file limit)."),
    option("--read-timeout", section="Server limits", type=click.FloatRange(min=0, min_open=True),
           default=20.0,
           help="Seconds a client has to send a request's headers, and each part of its body."),
    option("--structured-output-timeout", section="Server limits", type=click.FloatRange(min=0, min_open=True),
           default=30.0,
           help="Seconds a structured output grammar (JSON schema, regex, choices) may take to compile (400 "
                "above)."),
    option("--structured-output-memory", section="Server limits", metavar="SIZE", default="2GiB",
           help="Memory one structured output grammar compile may use (400 above)."),
    option("--stall-timeout", section="Server limits", type=click.FloatRange(min=0, min_open=True),
           default=60.0,
           help="/health answers 503 when requests wait and no engine step has finished for this long."),
    option("--default-max-tokens", section="Sampling", type=click.IntRange(min=0), default=DEFAULT_MAX_TOKENS,
           help="New tokens of a request that sets no max_tokens (max_completion_tokens, TGI's max_new_tokens): at "
                "most this many, and at most the generation config's max_new_tokens when that is smaller, never "
                "more than the room left in the context. 0: the room left (long answers allowed). A request's own "
                "max_tokens is not capped; /v1/completions keeps OpenAI's 16 when smaller."),
]


def _stack(options: list[Callable]) -> Callable:
    def decorate(fn: Callable) -> Callable:
        for opt in reversed(options):
            fn = opt(fn)
        return fn
    return decorate


engine_options = _stack(_ENGINE_OPTIONS)
server_options = _stack(_SERVER_OPTIONS)


def pick_model(model: str | None, model_option: str | None) -> str | None:
    """The model from the MODEL argument or --model (FP8KV_MODEL); two different folders are refused."""
    if model and model_option and os.path.abspath(model) != os.path.abspath(model_option):
        raise click.UsageError(f"MODEL {model!r} and --model {model_option!r} disagree; give one of them")
    return model or model_option


def engine_config(model: str | None, kw: dict) -> EngineConfig:
    """The EngineConfig of the engine flags in kw, field by field name (tensor_parallel_size is left to the
    command); a field whose flag this command lacks keeps its default."""
    from fp8cache.engine.generation_defaults import check_generation_flags

    check_generation_flags(kw["generation_config"], kw["override_generation_config"])  # ValueError: one clear line
    values = {f.name: memory_arg(kw[f.name]) if f.metadata["size"] else kw[f.name]
              for f in dataclasses.fields(EngineConfig) if f.name in kw and f.name not in CLI_LESS}
    return EngineConfig(model=model, **values)


def engine_errors(fn: Callable) -> Callable:
    """Configuration mistakes (bad scales file, unknown dtype, missing model) end with one clear line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from fp8cache.model.default_model import DefaultModelError

        try:
            return fn(*args, **kwargs)
        except (ValueError, FileNotFoundError, DefaultModelError, OSError) as exc:
            fail(str(exc))

    return wrapper

