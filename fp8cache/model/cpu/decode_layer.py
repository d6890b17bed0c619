"""The CPU's whole-layer decode: in a decode step (every sequence has one new token) a decoder layer whose
projections are all packed one way (fp8kv's panels or oneDNN's layout, packed_linear.py) runs as one compiled
call, torch.ops.fp8kv.decode_layer: the same kernels in the same order as the lean layer (model/fused_layer.py),
so bitwise the same result, without ~25 Python-level calls per layer (default model, 16 sequences, float32:
26.4 -> 23.4 ms per step's layers, median). With kv rotation the op rotates q/k/v and the attention output with
the same compiled Hadamard transform that attention.attend calls, at the same points.

Steps it cannot take whole (a prefill row, scale calculation, a saturation count, a GPU step) fall back to the
lean layer: run() says which happened."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fp8cache import ops
from fp8cache.kvcache.formats import CacheFormat
from fp8cache.kvcache.rotation import HADAMARD
from fp8cache.model.cpu.packed_linear import PackedLinear, merged_siblings
from fp8cache.model.forward_context import ForwardContext

# decode_layer.cpp's packing codes
_PANELS, _ONEDNN = 0, 1


@dataclass(frozen=True)
class WholeLayer:
    """One decoder layer's arguments to decode_layer that do not change between steps."""

    op: Callable
    weight_args: tuple  # weights, biases, shape, eps
    dtype: torch.dtype  # the dtype its packed weights were made for
    layer_idx: int

    @classmethod
    def of(cls, layer: nn.Module) -> WholeLayer | None:
        """The layer's whole-layer decode, or None where the op library lacks it or `layer`'s projections are not
        packed one way (q/k/v and gate/up merged) with norms in the weights' dtype."""
        op = ops.overload("decode_layer")
        args = _weight_args(layer) if op is not None else None
        if args is None:
            return None
        return cls(op, args, layer.input_layernorm.weight.dtype, layer.self_attn.layer_idx)

    def run(self, ctx: ForwardContext, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            scaling: float) -> bool:
        """The layer over the residual stream x [T, hidden], in place, when this step is one it takes whole;
        False (x untouched) otherwise."""
        step = step_args(ctx, self.layer_idx)
        if step is None or x.dtype != self.dtype or not x.is_contiguous():
            return False
        self.op(x, *self.weight_args, cos, sin, scaling, *step)
        return True


def step_args(ctx: ForwardContext, layer: int) -> tuple | None:
    """decode_layer's attention arguments for `layer` (key_cache .. window_sinks) when the step is decode tokens
    only, on the CPU, with no scale calculation and no saturation count (the op writes the cache inside) for this
    layer; None otherwise."""
    # A layer kept in the model dtype is never rotated or counted (attention.attend), so it runs whole regardless.
    fp8 = ctx.layer_formats[layer] != CacheFormat.AUTO
    if (not ctx.all_decode or (fp8 and ctx.saturation is not None)
            or ctx.calculate_scales is not None or ctx.slot_mapping.device.type != "cpu"):
        return None
    key_cache, value_cache = ctx.kv_caches[layer]
    window = ctx.window_caches[layer] if ctx.window_size else ()
    # Dynamic scales; () for a layer kept in the model dtype, whose format is AUTO in a mixed cache. Passed as
    # (None, None) then, so that the rotation flag after them stays in its place.
    scale_caches = ctx.scale_caches[layer] if ctx.scale_caches is not None else ()
    return (key_cache, value_cache, ctx.slot_mapping, ctx.layer_formats[layer], ctx.k_scales[layer], ctx.v_scales[layer],
            ctx.decode_block_tables, ctx.decode_context_lens, ctx.max_decode_len, list(window),
            ctx.window_slot_mapping if window else None, ctx.decode_window_block_tables if window else None,
            ctx.decode_window_starts if window else None, ctx.window_size, *(scale_caches or (None, None)),
            fp8 and ctx.rotation == HADAMARD, ctx.window_sinks if window else 0)


def _weight_args(layer: nn.Module) -> tuple | None:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = merged_siblings(attn.q_proj, attn.k_proj, attn.v_proj), merged_siblings(mlp.gate_proj, mlp.up_proj)
    if qkv is None or gate_up is None:
        return None
    projections = (qkv.packed, attn.o_proj, gate_up.packed, mlp.down_proj)
    if not all(type(p) is PackedLinear and p.panels == projections[0].panels for p in projections):
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    dtype = norms[0].weight.dtype
    if norms[1].weight.dtype != dtype or dtype not in (torch.float32, torch.bfloat16):
        return None
    heads, kv_heads = attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim
    weights = [norms[0].weight, qkv.packed.packed_weight, attn.o_proj.packed_weight, norms[1].weight,
               gate_up.packed.packed_weight, mlp.down_proj.packed_weight]
    packing = _PANELS if projections[0].panels else _ONEDNN
    return (weights, [p.bias for p in projections],
            [heads, kv_heads, attn.head_dim, mlp.down_proj.in_features, packing],
            [float(n.variance_epsilon) for n in norms])
