"""`fp8kv run`: serve a model over HTTP, or with --num-shard N start and supervise its N ranks.

The serving itself is fp8cache.server's; a rank > 0 runs fp8cache.model.tp_ranks' worker loop.
"""

from __future__ import annotations

import dataclasses
import sys

import click

from launcher.build import build_ops_ahead
from launcher.help_sections import SectionedCommand
from launcher.options import (
    engine_config,
    engine_errors,
    engine_options,
    fail,
    memory_arg,
    num_shard_option,
    pick_model,
    server_options,
)
from launcher.supervisor import owns_its_children


@click.command("run", cls=SectionedCommand, context_settings={"show_default": True})
@click.argument("model", required=False, metavar="[MODEL]")
@engine_options
@server_options
@num_shard_option("Tensor-parallel ranks: this many processes each hold a slice of the model's heads and MLP. "
                  "Started here when RANK is unset; with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (several "
                  "machines, torchrun) this process is that one rank.")
@owns_its_children
@engine_errors
def run(model: str | None, **kw) -> None:
    """Serve MODEL over HTTP: OpenAI /v1 routes, TGI /generate routes, /health and /metrics.

    Example: fp8kv run ./my-model --kv-cache-dtype fp8 --quantization-param-path scales.json
    """
    from fp8cache.distributed.layout import env_rank
    from fp8cache.model.preflight import check_before_loading, check_engine_scales
    from fp8cache.server.serve import EXIT_PORT_IN_USE, ServeOptions, serve  # no torch: a fifth of a second
    from fp8cache.systemd.listener import ListenError, check_listen
    from launcher.logs import logger, setup_logging

    num_shard = kw.pop("num_shard")
    rank = env_rank() if num_shard > 1 else 0
    # From here every line of stderr, an error included, is in the log's format; with --num-shard N each
    # rank's lines name it, and the supervisor (rank None) writes its own in the same format.
    setup_logging(kw["log_format"], rank=rank if num_shard > 1 else None)
    config = dataclasses.replace(engine_config(pick_model(model, kw["model_option"]), kw),
                                 tensor_parallel_size=num_shard)
    # What fails without torch and transformers fails before they load (five seconds), and before any rank
    # starts: the model folder, --num-shard against its heads, the port.
    check_before_loading(config)
    if rank in (None, 0):
        try:
            check_listen(kw["host"], kw["port"])
        except ListenError as exc:
            fail(str(exc), code=EXIT_PORT_IN_USE)
    check_engine_scales(config)  # a bad scales file fails now, not after the model loads (in every rank)
    from fp8cache.platform.device import resolve_device

    resolve_device(config.device)  # torch's, before transformers loads and (supervisor) before any rank starts
    if rank is None:  # one machine: start the ranks and watch them (rank 0 serves HTTP)
        from launcher.supervisor import supervise

        sys.exit(supervise(sys.argv[1:], num_shard, stop_timeout=kw["graceful_timeout"] + 30,
                           log_format=kw["log_format"]))
    build_ops_ahead(config.device)  # compiled (a first start) while the model is fetched, converted and loaded
    from fp8cache.distributed import parallel_state

    if rank > 0:
        from fp8cache.model.tp_ranks import run_worker
        from fp8cache.platform.log import log_function
        from fp8cache.systemd.notify import Notifier

        parallel_state.exit_rank(run_worker(config, log=log_function("fp8kv"),
                                            on_ready=lambda status: Notifier().ready(status)))
    if kw["host"] not in ("127.0.0.1", "localhost", "::1") and not kw["api_key"]:
        logger.warning("listening on %s without --api-key: anyone who can reach this port can use the model",
                       kw["host"])
    options = ServeOptions(host=kw["host"], port=kw["port"], api_key=kw["api_key"] or None,
                           served_model_name=kw["served_model_name"], graceful_timeout=kw["graceful_timeout"],
                           log_format=kw["log_format"], max_request_bytes=kw["max_request_bytes"],
                           max_concurrent_requests=kw["max_concurrent_requests"], access_log=kw["access_log"],
                           max_connections=kw["max_connections"], read_timeout=kw["read_timeout"],
                           structured_output_timeout=kw["structured_output_timeout"],
                           structured_output_memory=memory_arg(kw["structured_output_memory"]),
                           stall_timeout=kw["stall_timeout"], default_max_tokens=kw["default_max_tokens"])
    code = serve(config, options)
    if num_shard > 1:  # stop the workers, then end without the interpreter teardown gloo can abort in
        from fp8cache.distributed.worker import stop_workers

        stop_workers()
        parallel_state.exit_rank(code)
    sys.exit(code)


if __name__ == "__main__":  # `python -m launcher.run`: the three engine commands without the rest of fp8kv
    from launcher.generate import generate
    from launcher.systemd_unit import systemd_unit

    @click.group()
    def _cli() -> None:
        pass

    for _command in (run, generate, systemd_unit):
        _cli.add_command(_command)
    _cli()
