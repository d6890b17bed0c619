"""This process's place in the tensor-parallel group, from the standard torch.distributed environment.

Every rank runs the same model slice by slice; rank 0 also runs the scheduler and tells the others what to
compute. Two groups: the default one carries the model's all_reduces (nccl on CUDA, gloo on CPU); a gloo
"control" group with a long timeout carries the step broadcasts, because an idle server may leave the
workers waiting for the next step far longer than a collective's usual timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from fp8cache.config import EngineConfig
from fp8cache.distributed.layout import ENV_VARS, env_rank, read_env  # noqa: F401 (their home was here)
from fp8cache.distributed.layout import env_int as _env_int

_IDLE_TIMEOUT = timedelta(days=365)  # workers wait for rank 0's next step as long as the server lives


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    control_group: object | None = None  # gloo group for step broadcasts; None when world_size == 1

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, samples, and broadcasts each step to the other ranks."""
        return self.rank == 0


SINGLE = ParallelState()
_state = SINGLE


def get() -> ParallelState:
    return _state


def rank_device(config: EngineConfig, rank: int) -> str:
    """Each rank its own GPU: a bare "cuda" (or "auto" with a GPU) becomes cuda:LOCAL_RANK (else rank modulo
    the GPUs here)."""
    from fp8cache.platform.device import resolve_device

    device = resolve_device(config.device)
    if device.type != "cuda" or device.index is not None:
        return str(device)
    local = os.environ.get("LOCAL_RANK")
    index = _env_int("LOCAL_RANK", local) if local is not None else rank % max(torch.cuda.device_count(), 1)
    return f"cuda:{index}"


def initialize(config: EngineConfig) -> tuple[EngineConfig, ParallelState]:
    """Join the process group when config.tensor_parallel_size > 1; returns the config for this rank.

    A process that joined already (an offline group, see group.py, or an earlier runner) keeps its group;
    otherwise the rank comes from the standard environment (`fp8kv run --num-shard N`, torchrun)."""
    size = config.tensor_parallel_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size={size!r} must be a positive integer")
    if size == 1:
        return config, SINGLE
    if _state.is_parallel:
        if _state.world_size != size:
            raise RuntimeError(f"this process already runs tensor parallelism of size {_state.world_size}, "
                               f"not {size}; close that engine (LLM.close()) before starting another")
        return dataclasses.replace(config, device=rank_device(config, _state.rank)), _state
    rank, world = read_env(size)
    config = dataclasses.replace(config, device=rank_device(config, rank))
    return config, join(rank, world, torch.device(config.device))


def join(rank: int, world: int, device: torch.device, store: dist.Store | None = None) -> ParallelState:
    """Join the default group (from the environment, or over `store`) and make the control group."""
    global _state
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if store is None:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    _state = ParallelState(rank, world, control)
    return _state


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; the row-parallel layers' reduction."""
    if _state.is_parallel:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    if _state.is_parallel:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def all_reduce_min_int(value: int) -> int:
    """The smallest of each rank's value (e.g. cache blocks: every rank must hold rank 0's block ids)."""
    if not _state.is_parallel:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_state.control_group)
    return int(t.item())


def exit_rank(code: int) -> NoReturn:
    """End a worker rank's process once its work is done, without interpreter teardown: there torch's gloo
    threads can abort the process (SIGABRT, "terminate called without an active exception") even after
    destroy(); seen in 1 to 5 of 20 two-rank runs (torch 2.13), which turned a clean stop into a crash."""
    destroy()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def destroy() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = SINGLE
