"""`fp8kv run`, `fp8kv generate` and `fp8kv systemd-unit`: flags in, fp8cache.server / the engine out.

Every flag also reads an FP8KV_* environment variable (shown in --help), so a systemd EnvironmentFile or a
container's environment can configure the server without a command line.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import sys
from collections.abc import Callable

import click
from rich.console import Console

from fp8cache.kvcache.formats import KV_CACHE_DTYPES
from launcher.supervisor import owns_its_children

console = Console(stderr=True)
DEFAULT_GRACEFUL_TIMEOUT = 30.0


def _fail(message: str, code: int = 2) -> None:
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        # A tensor-parallel rank (a model too large for its cache, say) ends without interpreter teardown, where
        # gloo's threads can abort it (SIGABRT) instead of exiting with this status.
        from fp8cache.distributed import parallel_state

        parallel_state.exit_rank(code)
    sys.exit(code)


def _env(name: str) -> str:
    return "FP8KV_" + name.upper().replace("-", "_")


def _memory(value: str | None) -> int | str | None:
    if value is None:
        return None
    return int(value) if value.isdigit() else value


# -- shared flags ------------------------------------------------------------------------------------

def option(*decls: str, help: str, **kwargs) -> Callable:
    """click.option whose value may also come from FP8KV_<LONG_NAME> (e.g. --kv-cache-dtype <-
    FP8KV_KV_CACHE_DTYPE), named in --help."""
    envvar = kwargs.pop("envvar", None) or _env(decls[0].split("/")[0].removeprefix("--"))
    return click.option(*decls, envvar=envvar, help=f"{help} [env: {envvar}]", **kwargs)


_ENGINE_OPTIONS = [
    option("--model", "model_option", metavar="PATH", envvar="FP8KV_MODEL",
           help="Model folder (safetensors); same as the MODEL argument. Default: the embedded "
                "SmolLM2-135M-Instruct."),
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
           help="Weights and activations dtype (auto: float32 on CPU)."),
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
    option("--trust-remote-code", is_flag=True,
           help="Allow Python code shipped in the model folder to run (off: transformers' own "
                "architectures only)."),
]

_SERVER_OPTIONS = [
    option("--host", default="127.0.0.1", help="Address to listen on; 0.0.0.0 exposes the server to the network."),
    option("--port", type=click.IntRange(0, 65535), default=8000,
           help="TCP port (0: any free port, printed at start)."),
    option("--api-key", metavar="KEY",
           help="Require 'Authorization: Bearer KEY' on every route except /health."),
    option("--served-model-name", metavar="NAME",
           help="Model name in the OpenAI API (default: the model folder's name)."),
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


def _model(model: str | None, model_option: str | None) -> str | None:
    if model and model_option and os.path.abspath(model) != os.path.abspath(model_option):
        raise click.UsageError(f"MODEL {model!r} and --model {model_option!r} disagree; give one of them")
    return model or model_option


def engine_config(model: str | None, kw: dict):
    from fp8cache.config import EngineConfig

    return EngineConfig(
        model=model, tokenizer=kw["tokenizer"], dtype=kw["dtype"], kv_cache_dtype=kw["kv_cache_dtype"],
        quantization_param_path=kw["quantization_param_path"], calculate_kv_scales=kw["calculate_kv_scales"],
        kv_scales_granularity=kw["kv_scales_granularity"], kv_recent_window=kw["kv_recent_window"],
        kv_recent_window_dtype=kw["kv_recent_window_dtype"], block_size=int(kw["block_size"]),
        max_model_len=kw["max_model_len"], max_num_seqs=kw["max_num_seqs"],
        max_num_batched_tokens=kw["max_num_batched_tokens"], kv_cache_memory=_memory(kw["kv_cache_memory"]),
        enable_prefix_caching=kw["enable_prefix_caching"], seed=kw["seed"], device=kw["device"],
        gpu_memory_utilization=kw["gpu_memory_utilization"], enforce_eager=kw["enforce_eager"],
        trust_remote_code=kw["trust_remote_code"])


def _engine_errors(fn: Callable) -> Callable:
    """Configuration mistakes (bad scales file, unknown dtype, missing model) end with one clear line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from fp8cache.model.default_model import DefaultModelError

        try:
            return fn(*args, **kwargs)
        except (ValueError, FileNotFoundError, DefaultModelError, OSError) as exc:
            _fail(str(exc))

    return wrapper


# -- run ---------------------------------------------------------------------------------------------


@click.command("run", context_settings={"show_default": True})
@click.argument("model", required=False, metavar="[MODEL]")
@engine_options
@server_options
@option("--num-shard", "--tensor-parallel-size", "num_shard", type=click.IntRange(min=1), default=1,
        help="Tensor-parallel ranks: this many processes each hold a slice of the model's heads and MLP. "
             "Started here when RANK is unset; with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (several "
             "machines, torchrun) this process is that one rank.")
@owns_its_children
@_engine_errors
def run(model: str | None, **kw) -> None:
    """Serve MODEL over HTTP: OpenAI /v1 routes, TGI /generate routes, /health and /metrics.

    Example: fp8kv run ./my-model --kv-cache-dtype fp8 --quantization-param-path scales.json
    """
    from fp8cache.distributed import parallel_state
    from fp8cache.server.serve import ServeOptions, configure_logging, serve

    num_shard = kw.pop("num_shard")
    rank = parallel_state.env_rank() if num_shard > 1 else 0
    config = dataclasses.replace(engine_config(_model(model, kw["model_option"]), kw),
                                 tensor_parallel_size=num_shard)
    from fp8cache.kvcache.scales import check_engine_scales

    check_engine_scales(config)  # a bad scales file fails now, not after the model loads (in every rank)
    if rank is None:  # one machine: start the ranks and watch them (rank 0 serves HTTP)
        from fp8cache.device import resolve_device
        from fp8cache.distributed.sharding import check_model_divisible
        from fp8cache.server.listener import ListenError, check_listen
        from fp8cache.server.serve import EXIT_PORT_IN_USE
        from launcher.supervisor import supervise

        # What would fail in every rank after its model load is refused here, once, before any starts.
        resolve_device(config.device)
        check_model_divisible(config)
        try:
            check_listen(kw["host"], kw["port"])
        except ListenError as exc:
            _fail(str(exc), code=EXIT_PORT_IN_USE)
        sys.exit(supervise(sys.argv[1:], num_shard, stop_timeout=kw["graceful_timeout"] + 30))
    configure_logging(kw["log_format"])
    if rank > 0:
        import logging

        from fp8cache.distributed.worker import run_worker

        parallel_state.exit_rank(run_worker(config, log=logging.getLogger("fp8kv").info))
    if kw["host"] not in ("127.0.0.1", "localhost", "::1") and not kw["api_key"]:
        console.print(f"[yellow]warning:[/] listening on {kw['host']} without --api-key: anyone who can "
                      "reach this port can use the model", highlight=False)
    options = ServeOptions(host=kw["host"], port=kw["port"], api_key=kw["api_key"] or None,
                           served_model_name=kw["served_model_name"], graceful_timeout=kw["graceful_timeout"],
                           log_format=kw["log_format"], max_request_bytes=kw["max_request_bytes"],
                           max_concurrent_requests=kw["max_concurrent_requests"], access_log=kw["access_log"],
                           max_connections=kw["max_connections"], read_timeout=kw["read_timeout"],
                           structured_output_timeout=kw["structured_output_timeout"],
                           structured_output_memory=_memory(kw["structured_output_memory"]),
                           stall_timeout=kw["stall_timeout"])
    code = serve(config, options)
    if num_shard > 1:  # stop the workers, then end without the interpreter teardown gloo can abort in
        from fp8cache.distributed.worker import stop_workers

        stop_workers()
        parallel_state.exit_rank(code)
    sys.exit(code)


# -- generate ----------------------------------------------------------------------------------------


@click.command("generate", context_settings={"show_default": True})
@click.argument("args", nargs=-1, required=True, metavar="[MODEL] PROMPT")
@option("--max-tokens", type=click.IntRange(min=1), default=128, help="Most tokens to generate.")
@option("--temperature", type=click.FloatRange(min=0), default=0.0,
        help="Sampling temperature; 0 is greedy (the default: reproducible).")
@option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, help="Nucleus sampling mass.")
@option("--top-k", type=click.IntRange(min=-1), default=-1, help="Sample among the k likeliest tokens (-1: off).")
@option("--min-p", type=click.FloatRange(0, 1), default=0.0,
        help="Drop tokens below min-p times the top probability.")
@option("--repetition-penalty", type=click.FloatRange(min=0, min_open=True), default=1.0,
        help="Penalty on tokens already present (1: off).")
@option("--presence-penalty", type=click.FloatRange(-2, 2), default=0.0, help="OpenAI presence penalty.")
@option("--frequency-penalty", type=click.FloatRange(-2, 2), default=0.0, help="OpenAI frequency penalty.")
@option("--sampling-seed", type=int, help="Seed of this request's sampling.")
@option("--stop", multiple=True, help="Stop string (repeatable).")
@option("--ignore-eos", is_flag=True, help="Keep generating past the end-of-sequence token.")
@option("--chat/--no-chat", default=None,
        help="Wrap PROMPT in the tokenizer's chat template as a user turn (default: when the tokenizer has one; "
             "LLM.generate() in Python does not, LLM.chat() does).")
@option("--num-shard", "--tensor-parallel-size", "num_shard", type=click.IntRange(min=1), default=1,
        help="Tensor-parallel ranks: this process is rank 0 and starts the others itself. With "
             "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (several machines, torchrun) this process is that "
             "one rank.")
@engine_options
@owns_its_children
@_engine_errors
def generate(args: tuple[str, ...], **kw) -> None:
    """Generate from PROMPT ('-' reads standard input) without a server, streaming text to stdout.

    PROMPT is sent as a chat message when the tokenizer has a chat template (like LLM.chat(), unlike
    LLM.generate(), which sends text as given): use --no-chat to have the model continue PROMPT instead.

    Example: fp8kv generate "What is the capital of France?" --kv-cache-dtype fp8 --max-tokens 32
    """
    if len(args) > 2:
        raise click.UsageError(f"expected [MODEL] PROMPT, got {len(args)} arguments; quote the prompt")
    model, prompt = (args[0], args[1]) if len(args) == 2 else (None, args[0])
    from fp8cache.distributed import parallel_state
    from fp8cache.distributed.group import WorkerDiedError
    from fp8cache.engine.llm import LLM

    num_shard = kw.pop("num_shard")
    config = dataclasses.replace(engine_config(_model(model, kw["model_option"]), kw),
                                 tensor_parallel_size=num_shard)
    from fp8cache.kvcache.scales import check_engine_scales

    check_engine_scales(config)  # a bad scales file fails now, not after the model loads (in every rank)

    def log(msg: str) -> None:
        from rich.markup import escape

        console.print(f"[dim]{escape(msg)}[/]", highlight=False)  # worker lines start "[rank 1]"

    if num_shard > 1 and (parallel_state.env_rank() or 0) > 0:  # one worker rank of an outside launcher
        from fp8cache.distributed.worker import run_worker

        parallel_state.exit_rank(run_worker(config, log=log))
    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        with console.status("loading the model..."):
            llm = LLM.from_config(config, log=log)  # with --num-shard N, also starts and stops ranks 1..N-1
        with llm:
            _generate(llm.engine, prompt, kw)
    except WorkerDiedError as exc:
        _fail(str(exc), code=1)


def _generate(engine, prompt: str, kw: dict) -> None:
    from fp8cache.engine.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=kw["temperature"], top_p=kw["top_p"], top_k=kw["top_k"], min_p=kw["min_p"],
        repetition_penalty=kw["repetition_penalty"], presence_penalty=kw["presence_penalty"],
        frequency_penalty=kw["frequency_penalty"], seed=kw["sampling_seed"], stop=list(kw["stop"]) or None,
        max_tokens=kw["max_tokens"], ignore_eos=kw["ignore_eos"])
    tok = engine.tokenizer
    chat = kw["chat"] if kw["chat"] is not None else bool(getattr(tok, "chat_template", None))
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        engine.add_request("generate", text, params, prompt_token_ids=tok.encode(text, add_special_tokens=False))
    else:
        engine.add_request("generate", prompt, params)
    stream_to_stdout(engine, "generate")


def stream_to_stdout(engine, request_id: str) -> None:
    printed = 0
    finish = None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                text = out.outputs[0].text
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = len(text)
                finish = out.outputs[0].finish_reason
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        finish = "interrupted"
    sys.stdout.write("\n")
    console.print(f"[dim]finish reason: {finish}[/]", highlight=False)


# -- systemd-unit ------------------------------------------------------------------------------------


@click.command("systemd-unit", context_settings={"show_default": True})
@click.argument("model", required=False, metavar="[MODEL]")
@engine_options
@server_options
@click.option("--exec", "exec_path", default=None, metavar="PATH",
              help="fp8kv executable for ExecStart= (default: the one on PATH, else this Python's).")
@click.option("--template", is_flag=True,
              help="Write a template unit (fp8kv@.service) that also reads /etc/fp8kv/%i.env.")
@click.option("--user", "unit_user", default="fp8kv", help="Name of the dynamic user the service runs as.")
@click.option("--watchdog-sec", type=click.IntRange(min=0), default=120,
              help="WatchdogSec= (0: no watchdog). A step longer than this restarts the service.")
@click.option("--description", default=None, help="Description= of the unit.")
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
    given = [name for name in kw if ctx.get_parameter_source(name) in
             (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)]
    if "api_key" in given:
        given.remove("api_key")
        console.print("[yellow]note:[/] the API key is not written into the unit (units are world-readable); put "
                      "FP8KV_API_KEY=... in /etc/fp8kv/fp8kv.env (mode 0600)", highlight=False)
    flags = _flags_for(ctx, given, kw)
    model = _model(model, kw["model_option"])
    args = ["run"] + ([os.path.abspath(model)] if model and os.path.exists(model) else [model] if model else [])
    command = [exec_path] if exec_path else fp8kv_command()
    # Without an installed `fp8kv` script, `python -m launcher.cli` must find this source tree.
    pythonpath = _source_root() if command[1:2] == ["-m"] else None
    paths = [model, kw["quantization_param_path"], kw["tokenizer"], *command, pythonpath]
    gpu = _unit_wants_gpu(kw["device"])
    in_tmp = _under_tmp(paths)
    if in_tmp:
        console.print(f"[yellow]warning:[/] the service needs {in_tmp}, but the unit's PrivateTmp=yes gives it an "
                      "empty /tmp and /var/tmp, so it will not start: move the venv and the model elsewhere "
                      "(e.g. /opt/fp8kv, /srv/models) and print the unit again", highlight=False)
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
        import torch

        found = torch.cuda.is_available()
        console.print(f"[dim]note: --device auto: torch {'sees' if found else 'sees no'} GPU here, so the unit "
                      f"{'keeps /dev/nvidia*, /dev/kfd and /dev/dri visible' if found else 'hides all devices'}; "
                      "pass --device cpu or --device cuda to choose for another machine[/]", highlight=False)
        return found
    return not device.startswith("cpu")


def _under_tmp(paths: list[str | None]) -> str | None:
    """The first path the service would need from /tmp or /var/tmp (PrivateTmp=yes hides both)."""
    for p in paths:
        if p and os.path.realpath(p).startswith(("/tmp/", "/var/tmp/")):
            return p
    return None


MEMORY_HEADROOM = 4 * 2**30  # Python, torch, activations and `fp8kv build`'s compilers beside the KV cache


def _memory_max(kv_cache_memory: str | None, model: str | None) -> int | None:
    """MemoryMax= for a CPU unit when the KV budget is given: KV budget + twice the weights on disk (a 16-bit
    checkpoint runs in float32 on the CPU) + MEMORY_HEADROOM. None when the budget or the weights are unknown."""
    if kv_cache_memory is None or model is None or not os.path.isdir(model):
        return None
    from fp8cache.kvcache.sizing import parse_memory_size

    weights = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)
                  if f.endswith((".safetensors", ".bin", ".pt")))
    return parse_memory_size(_memory(kv_cache_memory), "--kv-cache-memory") + 2 * weights + MEMORY_HEADROOM


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


def quote_systemd(arg: str) -> str:
    """One ExecStart= word: specifiers (%) and variables ($) escaped, quoted when it has spaces."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


CPU_DEVICES = (
    "PrivateDevices=yes",
    "PrivateUsers=yes",
)
# A GPU service needs the driver's device nodes. ProtectClock= and ProtectKernelLogs= close the device
# policy, so each node the CUDA or ROCm runtime opens is allowed by name (a missing one is skipped).
# PrivateUsers= stays off: it has not been tried with the GPU drivers yet, and ROCm's nodes are often
# group render/video, which only the service's own user and group are mapped into.
GPU_DEVICES = (
    "PrivateDevices=no",
    "PrivateUsers=no",
    "DevicePolicy=closed",
    "# NVIDIA: /dev/nvidia0..N, nvidiactl, nvidia-uvm(-tools), nvidia-caps/* by their /proc/devices names",
    "# (nvidia-frontend in older drivers, nvidia and nvidiactl in newer ones), and by path",
    "DeviceAllow=char-nvidia* rw",
    "DeviceAllow=/dev/nvidiactl rw",
    "DeviceAllow=/dev/nvidia-uvm rw",
    "DeviceAllow=/dev/nvidia-uvm-tools rw",
    "# ROCm: /dev/kfd and /dev/dri/* (if they are group render/video, add SupplementaryGroups=render video)",
    "DeviceAllow=/dev/kfd rw",
    "DeviceAllow=char-drm rw",
)
# Left out on purpose, so that systemd-analyze's remaining points are explained.
NOT_SET = (
    "# Not set: MemoryDenyWriteExecute= (torch's oneDNN and the GPU runtimes write code at run time),",
    "# ProcSubset=pid (hides /proc/cpuinfo and /proc/meminfo, which pick the op build and size the cache),",
    "# PrivateNetwork=/IPAddressDeny= (a network server; the first start may download the default model).",
)


def render_gpu_dropin(header: tuple[str, ...] = ()) -> str:
    """A drop-in (fp8kv@.service.d/gpu.conf) that gives a CPU unit's service the GPU device nodes."""
    return "\n".join([*header, "[Service]", *GPU_DEVICES]) + "\n"


def _memory_lines(memory_max: int) -> list[str]:
    mib = -(-memory_max // 2**20)  # rounded up; systemd reads M as MiB
    return [f"# The KV budget, twice the weights on disk and {MEMORY_HEADROOM // 2**30} GiB for Python, torch and",
            "# ExecStartPre's compilers (if `fp8kv build` is killed for memory, raise this or set MAX_JOBS=2).",
            f"MemoryMax={mib}M"]


GENERATED_HEADER = (
    "# Generated by `fp8kv systemd-unit`. Flags may also come from FP8KV_* variables in the",
    "# EnvironmentFile(s) below, e.g. FP8KV_API_KEY=... (keep that file mode 0600).",
)


def render_unit(command: list[str], args: list[str], template: bool = False, user: str = "fp8kv",
                graceful_timeout: float = DEFAULT_GRACEFUL_TIMEOUT, watchdog_sec: int = 120,
                description: str | None = None, home_access: str = "yes", gpu: bool = False,
                pythonpath: str | None = None, memory_max: int | None = None,
                header: tuple[str, ...] = GENERATED_HEADER) -> str:
    """A hardened Type=notify service unit running `command args`.

    template: an fp8kv@.service whose instance name (%i) names the model and its env file. gpu: the service
    may open the GPU device nodes (NVIDIA and ROCm); otherwise it sees no device at all. memory_max: bytes for
    MemoryMax=."""
    exec_start = " ".join(quote_systemd(a) for a in command + args)
    exec_pre = " ".join(quote_systemd(a) for a in command + ["build"])
    env_files = ["EnvironmentFile=-/etc/fp8kv/fp8kv.env"] + (["EnvironmentFile=-/etc/fp8kv/%i.env"]
                                                              if template else [])
    description = description or ("fp8kv model server (%i)" if template else "fp8kv model server")
    extra_env = ["Environment=FP8KV_SERVED_MODEL_NAME=%i"] if template else []
    if pythonpath:
        extra_env.append(f"Environment={quote_systemd('PYTHONPATH=' + pythonpath)}")
    lines = [
        *header,
        "[Unit]",
        f"Description={description}",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        # The first start compiles the ops for this machine and may convert the default model.
        f"ExecStartPre={exec_pre}",
        f"ExecStart={exec_start}",
        *env_files,
        "Restart=on-failure",
        "RestartSec=5",
        "# Exit status 2 is a configuration error, which a restart does not fix.",
        "RestartPreventExitStatus=2",
        "TimeoutStartSec=900",
        f"# Above the graceful timeout ({graceful_timeout:g} s) so in-flight requests finish before a kill.",
        f"TimeoutStopSec={int(graceful_timeout) + 30}",
        f"WatchdogSec={watchdog_sec}" if watchdog_sec else "WatchdogSec=0",
        "KillMode=mixed",
        f"User={user}",
        "DynamicUser=yes",
        "StateDirectory=fp8kv",
        "CacheDirectory=fp8kv",
        "Environment=FP8KV_CACHE_DIR=%C/fp8kv XDG_CACHE_HOME=%C/fp8kv HOME=%S/fp8kv",
        "Environment=HF_HOME=%C/fp8kv/huggingface",
        *extra_env,
        "ProtectSystem=strict",
        f"ProtectHome={home_access}",
        "PrivateTmp=yes",
        *(GPU_DEVICES if gpu else CPU_DEVICES),
        "PrivateMounts=yes",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "SystemCallErrorNumber=EPERM",
        "UMask=0077",
        *NOT_SET,
        *(_memory_lines(memory_max) if memory_max else []),
        "LimitNOFILE=65536",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    @click.group()
    def _cli() -> None:
        pass

    for _command in (run, generate, systemd_unit):
        _cli.add_command(_command)
    _cli()
