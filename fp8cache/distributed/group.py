"""Offline tensor parallelism: this process is rank 0 and starts ranks 1..N-1 itself, as vLLM's LLM does.

LLM(tensor_parallel_size=N), `fp8kv generate --num-shard N` and `fp8kv bench throughput --num-shard N` all
run on a TensorParallelGroup. The ranks meet over a TCPStore that rank 0 hosts on 127.0.0.1; each worker
gets the engine configs as JSON, builds the same runners in the same order with the builder rank 0 was given
(fp8cache/model/tp_ranks.py's build_runners, passed here by module and name, since this package imports no
model code) and serves rank 0's steps until told to stop. Rank 0 watches its workers: one that
dies becomes a WorkerDiedError naming the rank, how it ended and its last output, not a hang or a bare
gloo message. Workers exit when rank 0 closes the group, when rank 0's process ends (atexit, or its
connections closing), or when their parent process is gone.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Self

import torch
import torch.distributed as dist

from fp8cache.config import EngineConfig
from fp8cache.distributed import parallel_state
from fp8cache.distributed import worker as tp_worker
from fp8cache.distributed.processes import LOOPBACK, RankProcess, rank_env, relay_output, stop_processes

JOIN_TIMEOUT_S = 300.0  # workers import torch and join before loading the model, so this is generous
STOP_TIMEOUT_S = 30.0  # after the stop message (or SIGTERM), before SIGKILL
_EXIT_WAIT_S = 2.0  # a gloo error arrives as the dead worker's sockets close; its exit status just after
_POLL_S = 0.05
_JOINED_KEY = "fp8kv/joined/{rank}"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Builds one rank's runners from the engine configs, in order: (configs, log) -> runners.
RunnerBuilder = Callable[[Sequence[EngineConfig], Callable[[str], None]], list]


class WorkerDiedError(RuntimeError):
    """A worker rank ended while rank 0 needed it; the group can run no more steps."""


class TensorParallelGroup:
    """Rank 0 (this process) and the worker processes it started, with rank 0's runners."""

    def __init__(self, world_size: int, log: Callable[[str], None]) -> None:
        self.world_size, self.log = world_size, log
        self.workers: list[RankProcess] = []
        self.runners: list[DriverRunner] = []
        self.broken: str | None = None  # why no more steps can run
        self.closed = False
        self._store: dist.Store | None = None
        self._relays: list[threading.Thread] = []  # each worker's output to log

    @classmethod
    def start(cls, configs: Sequence[EngineConfig], log: Callable[[str], None] = print,
              threads_per_rank: int | None = None,
              *, build_runners: RunnerBuilder) -> TensorParallelGroup:
        """Start ranks 1..N-1, join them as rank 0, and build one runner per config on every rank.

        threads_per_rank: torch threads of each worker (default: OMP_NUM_THREADS when set, else this
        machine's cores shared out over the ranks). build_runners: a module-level function, since each worker
        imports it by name (fp8cache.model.tp_ranks.start_group passes fp8cache's)."""
        world = _check_configs(configs)
        builder, build = _builder_name(build_runners), build_runners
        if parallel_state.get().is_parallel:
            raise RuntimeError(f"this process already runs a tensor-parallel group of "
                               f"{parallel_state.get().world_size} ranks; close that LLM (llm.close(), or use"
                               " `with LLM(...) as llm:`) before starting another")
        group = cls(world, log)
        atexit.register(group.close)
        try:
            group._spawn(configs, _worker_threads(configs[0], world, threads_per_rank), builder)
            group._join(configs[0])
            runners = build(configs, log)
            group.runners = [DriverRunner(r, i, group) for i, r in enumerate(runners)]
        except BaseException as exc:
            died = group.dead_worker(_EXIT_WAIT_S) if not isinstance(exc, WorkerDiedError) else None
            # The workers may be inside a collective of the runners' start (a cache size all-reduce, say) that
            # rank 0 will never join: a stop message would wait for them forever. Terminate them instead.
            group.broken = f"rank 0 failed while the runners started ({type(exc).__name__}: {exc})"
            group.close()
            # Rank 0's own configuration error is the one to show; a collective's failure means a worker died.
            if died is not None and not isinstance(exc, (ValueError, KeyboardInterrupt)):
                raise WorkerDiedError(_died_message(died, "while the model was loading")) from exc
            raise
        return group

    # ---- starting --------------------------------------------------------------------------------------

    def _spawn(self, configs: Sequence[EngineConfig], threads: int | None, builder: str) -> None:
        self._store = dist.TCPStore(LOOPBACK, 0, self.world_size, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        spec = json.dumps({"configs": [dataclasses.asdict(c) for c in configs], "threads": threads,
                           "builder": builder})
        path = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
        for rank in range(1, self.world_size):
            env = rank_env(rank, self.world_size, self._store.port, PYTHONPATH=path)
            # Its own session: a Ctrl-C at the terminal reaches rank 0, which decides what the workers do.
            proc = subprocess.Popen([sys.executable, "-m", "fp8cache.distributed", spec], env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            self.workers.append(RankProcess(rank, proc))
        for w in self.workers:
            relay = threading.Thread(target=relay_output, args=(w, self.log), daemon=True,
                                     name=f"fp8kv-rank-{w.rank}-output")
            relay.start()
            self._relays.append(relay)

    def _join(self, config: EngineConfig) -> None:
        """Wait for every worker to reach the store (watching for one that dies first), then join them."""
        keys = [_JOINED_KEY.format(rank=w.rank) for w in self.workers]
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not self._store.check(keys):
            died = self.dead_worker()
            if died is not None:
                raise WorkerDiedError(_died_message(died, "before joining rank 0"))
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not reach rank 0 within "
                                   f"{JOIN_TIMEOUT_S:g} s")
            time.sleep(_POLL_S)
        device = torch.device(parallel_state.rank_device(config, 0))
        parallel_state.join(0, self.world_size, device, self._store)

    # ---- watching --------------------------------------------------------------------------------------

    def dead_worker(self, wait_s: float = 0.0) -> RankProcess | None:
        """The first worker that has exited (waiting up to wait_s for one to finish exiting), or None."""
        deadline = time.monotonic() + wait_s
        while True:
            for w in self.workers:
                if w.exit_code() is not None:
                    return w
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)

    def check_usable(self) -> None:
        """Before a step: raise if the group is closed, broken, or missing a worker."""
        if self.closed:
            raise RuntimeError("this tensor-parallel engine was closed; make a new LLM to generate again")
        if self.broken is not None:
            raise RuntimeError(self.broken)
        died = self.dead_worker()
        if died is not None:
            self.broken = _died_message(died, "")
            raise WorkerDiedError(self.broken)

    def step_failed(self, exc: BaseException, broadcast: bool) -> None:
        """After a step raised on rank 0: a worker's death becomes WorkerDiedError; otherwise, if the
        workers got the step, they may be inside it, and no later step can line up with them."""
        if not broadcast:
            return  # rank 0 refused the batch before sending it: nothing is out of step
        died = self.dead_worker(_EXIT_WAIT_S)
        if died is not None:
            self.broken = _died_message(died, "during a step")
            raise WorkerDiedError(self.broken) from exc
        self.broken = (f"a tensor-parallel step stopped half way on rank 0 ({type(exc).__name__}: {exc}); "
                       "the workers are out of step: close this engine and make a new one")

    # ---- stopping --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers (the stop message when they are in step, else SIGTERM), then leave the group."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if parallel_state.get().is_parallel and self.broken is None and self.dead_worker() is None:
            tp_worker.stop_workers()
        else:
            for w in self.workers:
                if w.exit_code() is None:
                    w.proc.terminate()
        if not stop_processes(self.workers, STOP_TIMEOUT_S):
            self.log(f"tensor-parallel workers did not stop within {STOP_TIMEOUT_S:g} s; killed them")
        for relay in self._relays:  # the workers' last lines reach the log before close returns
            relay.join(_EXIT_WAIT_S)
        if dist.is_initialized():
            parallel_state.destroy()
        tp_worker.reset()
        self.runners, self._store = [], None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class DriverRunner:
    """Rank 0's handle on one of the group's runners, for an LLMEngine: each step names its runner to the
    workers, and a dead worker or a half-run step becomes a clear error. Everything else is the runner's."""

    def __init__(self, runner, index: int, group: TensorParallelGroup) -> None:
        self.runner, self.index, self.group = runner, index, group

    def execute(self, batch, all_logits: bool = False) -> torch.Tensor:
        self.group.check_usable()
        ticket = tp_worker.StepTicket(self.index)
        try:
            with tp_worker.selected_runner(ticket):
                return self.runner.execute(batch, all_logits)
        except BaseException as exc:
            self.group.step_failed(exc, broadcast=ticket.sent)
            raise

    def __getattr__(self, name: str):
        return getattr(self.__dict__["runner"], name)

    def __setattr__(self, name: str, value) -> None:
        if name in ("runner", "index", "group"):
            object.__setattr__(self, name, value)
        else:  # the runner's own attributes, as on an unwrapped runner
            setattr(self.runner, name, value)


def _check_configs(configs: Sequence[EngineConfig]) -> int:
    if not configs:
        raise ValueError("a tensor-parallel group needs at least one engine config")
    sizes = {c.tensor_parallel_size for c in configs}
    if len(sizes) != 1:
        raise ValueError(f"engine configs disagree on tensor_parallel_size ({sorted(sizes)}); give them one")
    (world,) = sizes
    if not isinstance(world, int) or isinstance(world, bool) or world < 2:
        raise ValueError(f"tensor_parallel_size={world!r}: a group needs an integer of at least 2 ranks")
    return world


def _worker_threads(config: EngineConfig, world: int, wanted: int | None) -> int | None:
    if wanted is not None:
        return wanted
    if "OMP_NUM_THREADS" in os.environ or torch.device(config.device).type != "cpu":
        return None
    return max(1, (os.cpu_count() or 1) // world)  # rank 0 keeps its own setting


def _builder_name(build: RunnerBuilder) -> str:
    """"module:function", for a worker process to import."""
    name = getattr(build, "__qualname__", "")
    if not name or "<" in name:  # a lambda or a nested function: no worker could import it
        raise ValueError(f"build_runners={build!r} must be a module-level function; each worker rank imports "
                         "it by name")
    return f"{build.__module__}:{name}"


def _import_builder(name: str) -> RunnerBuilder:
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _died_message(died: RankProcess, when: str) -> str:
    when = f" {when}" if when else ""
    first, *rest = died.describe_failure().split("\n", 1)
    headline = (f"tensor-parallel {first}{when}; this engine can run no more steps: close it and start a "
                "new one")
    return "\n".join([headline, *rest])


# ---- the worker side --------------------------------------------------------------------------------------


def worker_main(spec_json: str) -> int:
    """A rank > 0 started by TensorParallelGroup: join rank 0, build the runners, serve steps; exit code."""
    spec = json.loads(spec_json)
    configs = [EngineConfig(**c) for c in spec["configs"]]
    build = _import_builder(spec["builder"])
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    _exit_with_parent()
    rank, world = parallel_state.read_env(configs[0].tensor_parallel_size)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    store.set(_JOINED_KEY.format(rank=rank), "1")
    parallel_state.join(rank, world, torch.device(parallel_state.rank_device(configs[0], rank)), store)
    runners = build(configs, print)
    print(f"rank {rank} of {world} ready", flush=True)
    steps = tp_worker.serve_steps([r.execute for r in runners])
    print(f"rank {rank}: stopped by rank 0 after {steps} steps", flush=True)
    parallel_state.destroy()
    return 0


def _exit_with_parent() -> None:
    """A worker whose rank 0 process is gone (even by SIGKILL, even while it waits on a store) exits."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="fp8kv-parent-watch").start()
