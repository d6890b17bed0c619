"""Flags that `fp8kv run`, `generate` and `systemd-unit` share, and the EngineConfig they make.

Every flag also reads an FP8KV_* environment variable (shown in --help), so a systemd EnvironmentFile or a
container's environment can configure the server without a command line.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import click
from rich.console import Console

from fp8cache.kvcache.dtype_names import KV_CACHE_DTYPES
from fp8cache.model.shapes import shape_names
from fp8cache.platform import paths

SHAPES = ", ".join(shape_names())  # for --help; fp8cache/data/shapes

if TYPE_CHECKING:
    from fp8cache.config import EngineConfig

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
    return paths.flag_env(name)


def speculative_arg(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> str | None:
    """--speculative-config JSON, checked now (a bad value is a usage error, not a failure after loading); kept
    as given, so that systemd-unit writes it back unchanged."""
    from fp8cache.engine.speculative_config import SpeculativeConfig

    try:
        SpeculativeConfig.parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def memory_arg(value: str | None) -> int | str | None:
    """A SIZE flag as EngineConfig takes it: digits are bytes, "2GiB" stays text for the engine to parse."""
    if value is None:
        return None
    return int(value) if value.isdigit() else value


# -- shared flags ------------------------------------------------------------------------------------

def option(*decls: str, help: str, **kwargs) -> Callable:
    """click.option whose value may also come from FP8KV_<LONG_NAME> (e.g. --kv-cache-dtype <-
    FP8KV_KV_CACHE_DTYPE), named in --help."""
    envvar = kwargs.pop("envvar", None) or env_var(decls[0].split("/")[0].removeprefix("--"))
    return click.option(*decls, envvar=envvar, help=f"{help} [env: {envvar}]", **kwargs)


_ENGINE_OPTIONS = [
    option("--model", "model_option", metavar="PATH", envvar=paths.flag_env("model"),
           help="Model folder (safetensors) or Hugging Face hub id (org/name: the hub cache first, else a "
                "download); same as the MODEL argument. Default: the embedded SmolLM2-135M-Instruct."),
    option("--revision", metavar="REV",
           help="Hub ids: the branch, tag or commit to use (default: main)."),
    option("--download-dir", metavar="DIR", type=click.Path(file_okay=False),
           help="Hub ids: the Hugging Face cache folder to read and download into (default: $HF_HOME/hub)."),
    option("--tokenizer", metavar="PATH", help="Tokenizer folder, if not the model's."),
    option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto",
           help="KV cache storage: auto (the model dtype) or an FP8 format; fp8 is E4M3FN on CPU and CUDA, "
                "E4M3FNUZ on ROCm."),
    option("--quantization-param-path", type=click.Path(exists=True, dir_okay=False),
           help="JSON file of KV cache scales (vLLM/aphrodite schema)."),
    option("--calculate-kv-scales", is_flag=True,
           help="Compute KV scales from the first batch when no scales file or checkpoint scales exist."),
    option("--kv-scales-granularity", type=click.Choice(["tensor", "head"]), default="tensor",
           help="Granularity of calculated scales."),
    option("--kv-recent-window", type=click.IntRange(min=0), default=None,
           help="Keep each sequence's newest N tokens' K/V in full precision too (0: plain FP8 cache; "
                "default 32 with an FP8 cache)."),
    option("--kv-recent-window-dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
           default="auto",
           help="dtype of that window (auto: the model dtype; bfloat16 halves a float32 model's window memory)."),
    option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
           help="Weights and activations dtype (auto: on a CPU the faster of float32 and bfloat16 there, bfloat16 where it multiplies bfloat16 natively; on a GPU the checkpoint's 16-bit dtype)."),
    option("--block-size", type=click.Choice(["8", "16", "32"]), default="16", help="Tokens per KV cache block."),
    option("--max-model-len", type=click.IntRange(min=1),
           help="Longest prompt plus completion in tokens (default: the model's own limit)."),
    option("--max-num-seqs", type=click.IntRange(min=1), default=64, help="Most sequences in one batch."),
    option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048,
           help="Most tokens in one engine step (longer prompts are prefilled in chunks)."),
    option("--kv-cache-memory", metavar="SIZE",
           help="Memory for the KV cache: 2GiB, 512MiB or bytes (default: what max-num-seqs x max-model-len "
                "need, capped at 0.3 of free host memory or, on a GPU, by --gpu-memory-utilization)."),
    option("--enable-prefix-caching/--no-enable-prefix-caching", default=True,
           help="Reuse the cached blocks of shared prompt prefixes."),
    option("--seed", type=int, default=0, help="Engine random seed."),
    option("--device", default="auto",
           help="auto (the first GPU if torch sees one, else the CPU), cpu, cuda or cuda:N."),
    option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=0.9,
           help="On a GPU: the share of its memory fp8kv may use in all; the KV cache gets what the weights and "
                "activations leave of it (capped at what max-num-seqs x max-model-len need)."),
    option("--enforce-eager", is_flag=True,
           help="On a GPU: run decode steps op by op instead of replaying CUDA graphs."),
    option("--speculative-config", metavar="JSON", callback=speculative_arg,
           help='Speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 4, '
                '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' proposes the tokens that followed the last '
                "n-gram's previous occurrence and verifies them in one step (same output; faster on text that "
                'repeats its context); "disable_by_batch_size": N (default 4) decodes plainly while more sequences '
                "run. Default: off."),
    option("--trust-remote-code", is_flag=True,
           help="Allow Python code shipped in the model folder to run (off: transformers' own "
                "architectures only)."),
    option("--load-format", type=click.Choice(["auto", "dummy"]), default="auto",
           help="auto: the model folder's safetensors weights. dummy: random weights made on the device from "
                "config.json alone, for benchmarks at a model's real size without its checkpoint; MODEL may "
                f"then be a folder with only a config (and a tokenizer) or a shape fp8kv ships: {SHAPES}."),
]

_SERVER_OPTIONS = [
    option("--host", default="127.0.0.1", help="Address to listen on; 0.0.0.0 exposes the server to the network."),
    option("--port", type=click.IntRange(0, 65535), default=8000,
           help="TCP port (0: any free port, printed at start)."),
    option("--api-key", metavar="KEY",
           help="Require 'Authorization: Bearer KEY' on every route except /health."),
    option("--served-model-name", metavar="NAME",
           help="Model name in the OpenAI API (default: the hub id, or the model folder's name)."),
    option("--graceful-timeout", type=click.FloatRange(min=0), default=DEFAULT_GRACEFUL_TIMEOUT,
           help="Seconds in-flight requests get to finish after SIGTERM/SIGINT."),
    option("--log-format", type=click.Choice(["text", "json"]), default="text",
           help="Log lines as text, or as one JSON object per line."),
    option("--max-request-bytes", type=click.IntRange(min=1024), default=4 * 2**20,
           help="Largest request body accepted (413 above)."),
    option("--max-concurrent-requests", type=click.IntRange(min=1), default=256,
           help="Sequences in flight at once: a request counts its prompts times n (429 above)."),
    option("--access-log/--no-access-log", default=True, help="Log one line per HTTP request."),
    option("--max-connections", type=click.IntRange(min=1),
           help="Open client connections at once; more get a 503 and are closed (default: 4096, or less to "
                "stay below the open-file limit)."),
    option("--read-timeout", type=click.FloatRange(min=0, min_open=True), default=20.0,
           help="Seconds a client has to send a request's headers, and each part of its body."),
    option("--structured-output-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0,
           help="Seconds a structured output grammar (JSON schema, regex, choices) may take to compile (400 "
                "above)."),
    option("--structured-output-memory", metavar="SIZE", default="2GiB",
           help="Memory one structured output grammar compile may use (400 above)."),
    option("--stall-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0,
           help="/health answers 503 when requests wait and no engine step has finished for this long."),
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
    """The EngineConfig for the engine flags in kw (tensor_parallel_size is left to the command)."""
    from fp8cache.config import EngineConfig

    return EngineConfig(
        model=model, tokenizer=kw["tokenizer"], dtype=kw["dtype"], kv_cache_dtype=kw["kv_cache_dtype"],
        quantization_param_path=kw["quantization_param_path"], calculate_kv_scales=kw["calculate_kv_scales"],
        kv_scales_granularity=kw["kv_scales_granularity"], kv_recent_window=kw["kv_recent_window"],
        kv_recent_window_dtype=kw["kv_recent_window_dtype"], block_size=int(kw["block_size"]),
        max_model_len=kw["max_model_len"], max_num_seqs=kw["max_num_seqs"],
        max_num_batched_tokens=kw["max_num_batched_tokens"],
        kv_cache_memory=memory_arg(kw["kv_cache_memory"]), enable_prefix_caching=kw["enable_prefix_caching"],
        seed=kw["seed"], device=kw["device"],
        gpu_memory_utilization=kw["gpu_memory_utilization"], enforce_eager=kw["enforce_eager"],
        trust_remote_code=kw["trust_remote_code"], load_format=kw["load_format"],
        revision=kw["revision"], download_dir=kw["download_dir"], speculative_config=kw.get("speculative_config"))


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

