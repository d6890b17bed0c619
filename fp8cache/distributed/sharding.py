"""Split a loaded Hugging Face Llama-family model over tensor-parallel ranks, in place (Megatron style).

Attention: q/k/v projections keep this rank's heads (column-parallel), o_proj takes those heads' inputs
(row-parallel) and sums the ranks' partial outputs. MLP: gate/up keep a slice of the intermediate columns,
down_proj the matching rows, summed the same way. Embeddings, norms and lm_head stay whole on every rank,
so every rank computes the same logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp8cache.distributed import parallel_state
from fp8cache.distributed.layout import check_divisible

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_SHARD_MARK = "_fp8kv_tp_shard"  # (rank, size) on a model already cut to one rank's share


class RowParallelLinear(nn.Module):
    """x[..., in/N] @ W[:, in/N slice].T, summed over ranks, plus the bias once."""

    def __init__(self, full: nn.Linear, start: int, stop: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.data[:, start:stop].clone(), requires_grad=False)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.data.clone(), requires_grad=False)
        self.in_features, self.out_features = stop - start, full.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = parallel_state.all_reduce_sum(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def keep_rows(linear: nn.Linear, start: int, stop: int) -> None:
    """Column-parallel in place: keep output features [start, stop)."""
    linear.weight = nn.Parameter(linear.weight.data[start:stop].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[start:stop].clone(), requires_grad=False)
    linear.out_features = stop - start


def shard_model(model: nn.Module, hf_config: object, tp_rank: int, tp_size: int) -> None:
    """Keep only rank tp_rank's share of every attention and MLP block of `model`. Runners that share one
    loaded model (the bench's cache dtypes side by side) all call this; the first one shards it."""
    done = getattr(model, _SHARD_MARK, None)
    if done == (tp_rank, tp_size):
        return
    if done is not None:
        raise RuntimeError(f"this model is already sharded as rank {done[0]} of {done[1]}; load it again for "
                           f"rank {tp_rank} of {tp_size}")
    check_divisible(hf_config, tp_size)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    attention_blocks = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    for block in attention_blocks:
        missing = [name for name in _ATTENTION if not isinstance(getattr(block, name, None), nn.Linear)]
        if missing:
            raise ValueError(f"{type(block).__name__} has no separate {', '.join(missing)} linear layers; "
                             "fp8kv's tensor parallelism handles Llama-style attention (q/k/v/o_proj) only: "
                             "run this model with --num-shard 1")
        _shard_attention(block, heads, kv_heads, tp_rank, tp_size)
    mlps = [m for m in model.modules() if all(isinstance(getattr(m, n, None), nn.Linear) for n in _MLP)]
    if len(mlps) != len(attention_blocks):
        raise ValueError(f"found {len(mlps)} gate/up/down_proj MLPs for {len(attention_blocks)} attention "
                         "layers; fp8kv's tensor parallelism handles Llama-style MLPs only: run this model "
                         "with --num-shard 1")
    for mlp in mlps:
        _shard_mlp(mlp, tp_rank, tp_size)
    setattr(model, _SHARD_MARK, (tp_rank, tp_size))


def _shard_attention(block: nn.Module, heads: int, kv_heads: int, tp_rank: int, tp_size: int) -> None:
    head_dim = block.q_proj.out_features // heads
    q_start, q_stop = _split(heads, tp_rank, tp_size)
    kv_start, kv_stop = _split(kv_heads, tp_rank, tp_size)
    keep_rows(block.q_proj, q_start * head_dim, q_stop * head_dim)
    keep_rows(block.k_proj, kv_start * head_dim, kv_stop * head_dim)
    keep_rows(block.v_proj, kv_start * head_dim, kv_stop * head_dim)
    block.o_proj = RowParallelLinear(block.o_proj, q_start * head_dim, q_stop * head_dim)
    # Older attention classes read these counts in forward; newer ones infer them from the shapes.
    for name, value in (("num_heads", q_stop - q_start), ("num_key_value_heads", kv_stop - kv_start)):
        if hasattr(block, name):
            setattr(block, name, value)


def _shard_mlp(mlp: nn.Module, tp_rank: int, tp_size: int) -> None:
    start, stop = _split(mlp.gate_proj.out_features, tp_rank, tp_size)
    keep_rows(mlp.gate_proj, start, stop)
    keep_rows(mlp.up_proj, start, stop)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, start, stop)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = stop - start


def _split(total: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    per_rank = total // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank
