"""Flags that `fp8kv run`, `generate` and `systemd-unit` share, and the EngineConfig they make.

Every flag also reads an FP8KV_* environment variable (shown in --help), so a systemd EnvironmentFile or a
container's environment can configure the server without a command line.

A new engine setting is a field of EngineConfig (fp8cache/config.py: its type, default and check) and one
engine_option here, named as the field and given its --help words and section: its default and choices are
the field's, and engine_config() passes it on by name (tests/launcher/test_engine_flags.py checks both).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import click
from rich.console import Console

from fp8cache.config import EngineConfig, field_choices
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
# EngineConfig fields without a flag of their own name, and why (tests/launcher/test_engine_flags.py).
CLI_LESS = {"model": "the MODEL argument, or --model (model_option)",
            "tensor_parallel_size": "--num-shard, which each command reads itself",
            "kv_cache_memory_fraction": "Python API only: --kv-cache-memory gives the budget itself"}
# How a flag's value becomes its field's (the rest are taken as they are).
_TO_FIELD = {"kv_cache_memory": memory_arg}


def engine_option(*decls: str, help: str, **kwargs) -> Callable:
    """option() for the EngineConfig field the flag names (--max-num-seqs: max_num_seqs): its default, and for a
    Literal field its choices, are the field's, written once in fp8cache/config.py."""
    name = decls[0].split("/")[0].removeprefix("--").replace("-", "_")
    if name in field_choices():
        kwargs.setdefault("type", click.Choice(field_choices()[name]))
    return option(*decls, help=help, default=ENGINE_DEFAULTS[name], **kwargs)


_ENGINE_OPTIONS = [
    option("--model", "model_option", section="Model", metavar="PATH", envvar=envs.flag_env("model"),
           help="Model folder (safetensors) or Hugging Face hub id (org/name: the hub cache first, else a "
                "download); same as the MODEL argument. Default: the embedded SmolLM2-135M-Instruct."),
    engine_option("--revision", section="Model", metavar="REV",
                  help="Hub ids: the branch, tag or commit to use (default: main)."),
    engine_option("--download-dir", section="Model", metavar="DIR", type=click.Path(file_okay=False),
                  help="Hub ids: the Hugging Face cache folder to read and download into (default: $HF_HOME/hub)."),
    engine_option("--tokenizer", section="Model", metavar="PATH", help="Tokenizer folder, if not the model's."),
    engine_option("--kv-cache-dtype", section="KV cache",
                  help="KV cache storage: auto (the model dtype) or an FP8 format; fp8 is E4M3FN on CPU and CUDA, "
                       "E4M3FNUZ on ROCm."),
    engine_option("--quantization-param-path", section="KV cache", type=click.Path(exists=True, dir_okay=False),
                  help="JSON file of KV cache scales (vLLM/aphrodite schema)."),
    engine_option("--calculate-kv-scales", section="KV cache", is_flag=True,
                  help="Compute KV scales from the first batch when no scales file or checkpoint scales exist."),
    engine_option("--kv-scales-granularity", section="KV cache", help="Granularity of calculated scales."),
    engine_option("--kv-scales", section="KV cache",
                  help="static: per-tensor or per-head scales (scales file, checkpoint, --calculate-kv-scales or "
                       "1.0). dynamic: a scale per token and KV head computed as the cache is written, no "
                       "calibration (the GPU kernels have not yet run on a GPU)."),
    engine_option("--kv-rotation", section="KV cache",
                  help="With --kv-scales dynamic: rotate K/V by a Hadamard matrix before quantizing (auto: where the "
                       "head size allows). Static scales use the rotation their scales file records."),
    engine_option("--kv-cache-dtype-skip-layers", section="KV cache", type=LayerIds(), metavar="0,1,...",
                  help="Layers whose KV cache is kept in the model dtype (2 or 4 bytes a value instead of 1) while "
                       "the others are FP8, where FP8 hurts most (`fp8kv calibrate --skip-layers-kl-budget` names "
                       "them). No effect with kv-cache-dtype auto. Default: none."),
    engine_option("--kv-recent-window", section="KV cache", type=click.IntRange(min=0),
                  help="Keep each sequence's newest N tokens' K/V in full precision too (0: plain FP8 cache; "
                       "default 32 with an FP8 cache)."),
    engine_option("--kv-recent-window-dtype", section="KV cache",
                  help="dtype of that window (auto: the model dtype; bfloat16 halves a float32 model's window "
                       "memory)."),
    engine_option("--dtype", section="Model",
                  help="Weights and activations dtype (auto: on a CPU the faster of float32 and bfloat16 there, "
                       "bfloat16 where it multiplies bfloat16 natively; on a GPU the checkpoint's 16-bit dtype)."),
    engine_option("--block-size", section="KV cache", type=click.Choice([8, 16, 32]),
                  help="Tokens per KV cache block."),
    engine_option("--max-model-len", section="Scheduling", type=click.IntRange(min=1),
                  help="Longest prompt plus completion in tokens (default: the model's own limit)."),
    engine_option("--max-num-seqs", section="Scheduling", type=click.IntRange(min=1),
                  help="Most sequences in one batch."),
    engine_option("--max-num-batched-tokens", section="Scheduling", type=click.IntRange(min=1),
                  help="Most tokens in one engine step (longer prompts are prefilled in chunks)."),
    engine_option("--kv-cache-memory", section="KV cache", metavar="SIZE",
                  help="Memory for the KV cache: 2GiB, 512MiB or bytes (default: what max-num-seqs x max-model-len "
                       "need, capped at 0.3 of free host memory or, on a GPU, by --gpu-memory-utilization)."),
    engine_option("--enable-prefix-caching/--no-enable-prefix-caching", section="KV cache",
                  help="Reuse the cached blocks of shared prompt prefixes."),
    engine_option("--seed", section="Scheduling", type=int, help="Engine random seed."),
    engine_option("--device", section="Device",
                  help="auto (the first GPU if torch sees one, else the CPU), cpu, cuda or cuda:N."),
    engine_option("--gpu-memory-utilization", section="Device", type=click.FloatRange(0, 1, min_open=True),
                  help="On a GPU: the share of its memory fp8kv may use in all; the KV cache gets what the weights "
                       "and activations leave of it (capped at what max-num-seqs x max-model-len need)."),
    engine_option("--enforce-eager", section="Device", is_flag=True,
                  help="On a GPU: run decode steps op by op instead of replaying CUDA graphs."),
    engine_option("--speculative-config", section="Scheduling", metavar="JSON", callback=speculative_arg,
                  help='Speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 4, '
                       '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' proposes the tokens that followed the '
                       "last n-gram's previous occurrence and verifies them in one step (same output; faster on text "
                       'that repeats its context); "disable_by_batch_size": N (default 8) decodes plainly while more '
                       "sequences run (on a CPU fewer drafts a sequence as more run, none from 16). Default: off."),
    engine_option("--trust-remote-code", section="Model", is_flag=True,
                  help="Allow Python code shipped in the model folder to run (off: transformers' own "
                       "architectures only)."),
    engine_option("--load-format", section="Model",
                  help="auto: the model folder's safetensors weights. dummy: random weights made on the device "
                       "from config.json alone, for benchmarks at a model's real size without its checkpoint; "
                       f"MODEL may then be a folder with only a config (and a tokenizer) or a shape fp8kv ships: "
                       f"{SHAPES}."),
    engine_option("--generation-config", section="Sampling", metavar="auto|vllm|FOLDER",
                  help="Request defaults, as vLLM's flag: auto = the model folder's generation_config.json (its "
                       "temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens fill what a request "
                       "leaves out); vllm or none = fp8kv's neutral defaults (temperature 1, no top-p/top-k); or a "
                       "folder holding a generation_config.json. A request's own field always wins; TGI's routes "
                       "sample as TGI does (greedy unless asked)."),
    engine_option("--override-generation-config", section="Sampling", metavar="JSON",
                  help="JSON object replacing single fields of those defaults, e.g. '{\"temperature\": 0}' for "
                       "reproducible answers to requests without sampling fields."),
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
    values = {f.name: _TO_FIELD.get(f.name, lambda v: v)(kw[f.name]) for f in dataclasses.fields(EngineConfig)
              if f.name in kw and f.name not in CLI_LESS}
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

