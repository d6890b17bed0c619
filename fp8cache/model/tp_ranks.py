"""Tensor parallelism, model side: the runners every rank builds and the loop a worker rank runs.

fp8cache.distributed starts the rank processes, joins the process groups and carries each step from rank 0
to the others, but knows nothing of models; this module hands it ModelRunners. Rank 0 runs the engine (and,
with `fp8kv run`, the HTTP server); every other rank runs run_worker, or the offline group's worker
(fp8cache/distributed/group.py), which calls build_runners by name in the new process. A worker rank's
runners are WorkerRunners: besides the steps they apply what rank 0 sends after a step to repair its cache.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from dataclasses import replace

from fp8cache.config import EngineConfig
from fp8cache.distributed import parallel_state
from fp8cache.distributed import worker as step_channel
from fp8cache.distributed.group import TensorParallelGroup
from fp8cache.model import window_slots
from fp8cache.model.batch import StepBatch
from fp8cache.model.loader import load_model, resolve_dtype
from fp8cache.model.runner import ModelRunner
from fp8cache.platform.device import resolve_device


class WorkerRunner:
    """A rank > 0's ModelRunner as rank 0's messages reach it: each step runs on it, and the WindowRestore rank 0
    sends after a verify step puts back this rank's heads of the ring slots that step's rejected drafts
    overwrote (saved here before the step, as rank 0 saves its own). Anything else is the runner's."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._saved: tuple[list[int], window_slots.Saved] | None = None  # the last verify step's draft slots

    def execute(self, message: StepBatch | window_slots.WindowRestore, all_logits: bool = False):
        if isinstance(message, window_slots.WindowRestore):
            return self._restore(message)
        self._save_draft_slots(message)
        return self.runner.execute(message, all_logits)

    def _save_draft_slots(self, batch: StepBatch) -> None:
        caches = self.runner.window_caches
        slots = window_slots.draft_slots(batch) if caches else []
        self._saved = (slots, window_slots.save_slots(caches, slots, self.runner.block_size)) if slots else None

    def _restore(self, message: window_slots.WindowRestore) -> None:
        saved, self._saved = self._saved, None
        if saved is None or saved[0] != message.slots:
            raise RuntimeError(f"rank 0 restores window slots {message.slots} but this rank saved "
                               f"{saved[0] if saved else 'none'} before the step: the ranks are out of step")
        window_slots.restore_slots(self.runner.window_caches, message.slots, saved[1], message.keep,
                                   self.runner.block_size)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["runner"], name)


def build_runners(configs: Sequence[EngineConfig],
                  log: Callable[[str], None] = print) -> list[ModelRunner] | list[WorkerRunner]:
    """This rank's runners, one per config, in order (ModelRunners on rank 0, WorkerRunners on the others);
    several share one loaded copy of the weights."""
    configs = [parallel_state.initialize(c)[0] for c in configs]  # this rank's device in each
    # Random weights stay shapes only (meta) here: the first runner fills just this rank's share on its device.
    loaded = load_model(configs[0], on_device=configs[0].load_format != "dummy") if len(configs) > 1 else None
    runners = [ModelRunner(c, log=log, loaded=loaded) for c in configs]
    return runners if parallel_state.get().is_driver else [WorkerRunner(r) for r in runners]


def start_group(configs: Sequence[EngineConfig], log: Callable[[str], None] = print,
                threads_per_rank: int | None = None) -> TensorParallelGroup:
    """This process as rank 0 of a new offline group whose ranks each build these configs' runners."""
    configs = [with_cpu_auto_dtype_resolved(c) for c in configs]
    return TensorParallelGroup.start(configs, log, threads_per_rank, build_runners=build_runners)


def with_cpu_auto_dtype_resolved(config: EngineConfig) -> EngineConfig:
    """The config with a CPU's --dtype auto made concrete here, so that every rank runs the dtype rank 0 chose
    (the choice can rest on a measurement). On a GPU auto follows the checkpoint, the same file for every rank."""
    if config.dtype != "auto" or resolve_device(config.device).type != "cpu":
        return config
    return replace(config, dtype=str(resolve_dtype("auto", "cpu")).removeprefix("torch."))


def run_worker(config: EngineConfig, log: Callable[[str], None] = print,
               on_ready: Callable[[str], object] | None = None) -> int:
    """A rank > 0 of `fp8kv run --num-shard N` (or of an outside launcher): load this rank's slice, report
    ready (on_ready gets a status line: the launcher's sd_notify), serve rank 0's steps; the exit code."""
    (runner,) = build_runners([config], log)
    state = parallel_state.get()
    if state.is_driver:
        raise RuntimeError("run_worker is for ranks > 0; rank 0 runs the engine")
    # A stop signal now waits for rank 0's stop message: rank 0 drains its requests first, and those need
    # this rank's share of every step. (The launcher sends SIGKILL if that takes too long.)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: log(f"{signal.Signals(s).name} received: stopping when rank 0 does"))
    if on_ready is not None:
        on_ready(f"tensor-parallel rank {state.rank} of {state.world_size} ready")
    log(f"rank {state.rank} of {state.world_size} ready")
    steps = step_channel.serve_steps(runner.execute)
    log(f"rank {state.rank}: stopped by rank 0 after {steps} steps")
    parallel_state.destroy()
    return 0
