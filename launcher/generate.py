"""`fp8kv generate`: one completion streamed to stdout, no server (with --num-shard N, over N ranks)."""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

import click

from fp8cache.platform.log import log_function
from launcher.build import build_ops_ahead
from launcher.help_sections import SectionedCommand
from launcher.logs import logger, setup_logging
from launcher.options import (
    engine_config,
    engine_errors,
    engine_options,
    fail,
    num_shard_option,
    option,
    pick_model,
)
from launcher.supervisor import owns_its_children

if TYPE_CHECKING:
    from fp8cache.engine.llm import LLM

GENERATE_DEFAULTS = {"temperature": 0.0, "max_tokens": 128}  # where neither a flag nor the model says


@click.command("generate", cls=SectionedCommand, context_settings={"show_default": True})
@click.argument("args", nargs=-1, required=True, metavar="[MODEL] PROMPT")
@option("--max-tokens", section="Sampling", type=click.IntRange(min=1), default=None,
        help="Most tokens to generate (default: the generation config's max_new_tokens, else 128).")
@option("--temperature", section="Sampling", type=click.FloatRange(min=0), default=None,
        help="Sampling temperature; 0 is greedy (default: the generation config's, else 0: reproducible).")
@option("--top-p", section="Sampling", type=click.FloatRange(0, 1, min_open=True), default=None,
        help="Nucleus sampling mass (default: the generation config's, else 1: off).")
@option("--top-k", section="Sampling", type=click.IntRange(min=-1), default=None,
        help="Sample among the k likeliest tokens (default: the generation config's, else -1: off).")
@option("--min-p", section="Sampling", type=click.FloatRange(0, 1), default=None,
        help="Drop tokens below min-p times the top probability (default: the generation config's, else 0).")
@option("--repetition-penalty", section="Sampling", type=click.FloatRange(min=0, min_open=True), default=None,
        help="Penalty on tokens already present (default: the generation config's, else 1: off).")
@option("--presence-penalty", section="Sampling", type=click.FloatRange(-2, 2), default=0.0, help="OpenAI presence penalty.")
@option("--frequency-penalty", section="Sampling", type=click.FloatRange(-2, 2), default=0.0, help="OpenAI frequency penalty.")
@option("--sampling-seed", section="Sampling", type=int, help="Seed of this request's sampling.")
@option("--stop", section="Sampling", multiple=True, help="Stop string (repeatable).")
@option("--ignore-eos", section="Sampling", is_flag=True, help="Keep generating past the end-of-sequence token.")
@option("--chat/--no-chat", section="Sampling", default=None,
        help="Wrap PROMPT in the tokenizer's chat template as a user turn (default: when the tokenizer has one; "
             "LLM.generate() in Python does not, LLM.chat() does).")
@num_shard_option("Tensor-parallel ranks: this process is rank 0 and starts the others itself. With "
                  "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (several machines, torchrun) this process is that "
                  "one rank.")
@engine_options
@owns_its_children
@engine_errors
def generate(args: tuple[str, ...], **kw) -> None:
    """Generate from PROMPT ('-' reads standard input) without a server, streaming text to stdout.

    PROMPT is sent as a chat message when the tokenizer has a chat template (like LLM.chat(), unlike
    LLM.generate(), which sends text as given): use --no-chat to have the model continue PROMPT instead.

    Example: fp8kv generate "What is the capital of France?" --kv-cache-dtype fp8 --max-tokens 32
    """
    if len(args) > 2:
        raise click.UsageError(f"expected [MODEL] PROMPT, got {len(args)} arguments; quote the prompt")
    model, prompt = (args[0], args[1]) if len(args) == 2 else (None, args[0])
    setup_logging()  # from here every line of stderr, an error included, is in the log's format
    from fp8cache.model.preflight import check_before_loading, check_engine_scales

    num_shard = kw.pop("num_shard")
    config = dataclasses.replace(engine_config(pick_model(model, kw["model_option"]), kw),
                                 tensor_parallel_size=num_shard)
    check_before_loading(config)  # the model folder and --num-shard, before torch and transformers load
    from fp8cache.distributed import parallel_state
    from fp8cache.distributed.group import WorkerDiedError
    from fp8cache.engine.llm import LLM

    check_engine_scales(config)  # a bad scales file fails now, not after the model loads (in every rank)
    build_ops_ahead(config.device)  # compiled (a first start) while the model is fetched, converted and loaded
    log = log_function("fp8kv")  # worker lines start "[rank 1]"

    if num_shard > 1 and (parallel_state.env_rank() or 0) > 0:  # one worker rank of an outside launcher
        from fp8cache.model.tp_ranks import run_worker
        from fp8cache.systemd.notify import Notifier

        parallel_state.exit_rank(run_worker(config, log=log,
                                            on_ready=lambda status: Notifier().ready(status)))
    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        logger.info("loading the model")
        llm = LLM.from_config(config, log=log)  # with --num-shard N, also starts and stops ranks 1..N-1
        with llm:
            _generate(llm, prompt, kw)
    except WorkerDiedError as exc:
        fail(str(exc), code=1)


def _generate(llm: LLM, prompt: str, kw: dict) -> None:
    """Write the completion's text to stdout as it comes; Ctrl-C stops it (the request is aborted)."""
    from fp8cache.engine.sampling_params import SamplingParams

    # The flags given, over the model's generation config (--generation-config), over this command's own defaults.
    defaults = llm.generation_defaults
    from_model = defaults.sampling | ({"max_tokens": defaults.max_new_tokens} if defaults.max_new_tokens else {})
    given = {name: kw[name] for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
             if kw[name] is not None}
    params = SamplingParams(
        **(GENERATE_DEFAULTS | from_model | given), presence_penalty=kw["presence_penalty"],
        frequency_penalty=kw["frequency_penalty"], seed=kw["sampling_seed"], stop=list(kw["stop"]) or None,
        ignore_eos=kw["ignore_eos"])
    printed, finish = 0, None
    try:
        for out in llm.stream(prompt, params, chat=kw["chat"]):
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed, finish = len(text), out.outputs[0].finish_reason
    except KeyboardInterrupt:
        finish = "interrupted"
    sys.stdout.write("\n")
    logger.info("finish reason: %s", finish)
