"""The tensor-parallel layout as far as it is known before torch loads: this process's rank from the standard
torch.distributed environment, and whether a model's heads and MLP split over a number of ranks. No torch here:
the launcher checks these before it imports torch and transformers (five seconds), so a wrong --num-shard or
RANK fails at once."""

from __future__ import annotations

import os

ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def env_rank() -> int | None:
    """RANK from the environment, None when unset (then a multi-rank start supervises its own ranks)."""
    value = os.environ.get("RANK")
    return None if value is None else env_int("RANK", value)


def env_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def read_env(tensor_parallel_size: int) -> tuple[int, int]:
    """(rank, world size) from RANK/WORLD_SIZE, checked against the tensor-parallel size asked for."""
    missing = [name for name in ENV_VARS if not os.environ.get(name)]
    if missing:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs the environment variables "
                         f"{', '.join(ENV_VARS)}; {', '.join(missing)} not set. Start with `fp8kv run "
                         f"--num-shard {tensor_parallel_size}` (it sets them for one machine), or set them "
                         "for each rank as torchrun does (LLM(tensor_parallel_size=N) starts its own ranks)")
    rank, world = env_int("RANK", os.environ["RANK"]), env_int("WORLD_SIZE", os.environ["WORLD_SIZE"])
    if world != tensor_parallel_size:
        raise ValueError(f"WORLD_SIZE={world} but the tensor-parallel size is {tensor_parallel_size}; fp8kv "
                         "uses every rank for tensor parallelism, so make them equal")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    return rank, world


def check_divisible(hf_config: object, tp_size: int) -> None:
    """Refuse at start a model whose heads or MLP width cannot be split evenly over tp_size ranks."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    problems = []
    if heads % tp_size:
        problems.append(f"{heads} attention heads")
    if kv_heads % tp_size:
        problems.append(f"{kv_heads} KV heads")
    intermediate = getattr(hf_config, "intermediate_size", None)
    if intermediate is not None and intermediate % tp_size:
        problems.append(f"an MLP width of {intermediate}")
    if problems:
        divisors = [n for n in range(1, kv_heads + 1) if kv_heads % n == 0 and heads % n == 0
                    and (intermediate is None or intermediate % n == 0)]
        raise ValueError(f"tensor-parallel size {tp_size} does not divide this model's "
                         f"{' and '.join(problems)}; use --num-shard (tensor_parallel_size) "
                         f"{' or '.join(map(str, divisors))}")
