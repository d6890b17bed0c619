"""A lean forward for Llama-family decoder layers (Llama, Mistral, Qwen2), on a CPU or a GPU.

transformers' decoder layer runs about 60 torch ops and a dozen module calls per layer (RMSNorm alone is
seven ops, rotary ten); in a decode step of a small model that dispatch costs more than the arithmetic.
This forward computes the same thing in about a dozen calls: one op for each norm (the second one fused
with the residual add), for rotary and for SiLU-and-mul, q/k/v and gate/up as one matmul each where they
are packed together (packed_linear.MergedLinear), and our attention called directly. The ops round where
transformers' formulas round (bitwise equal in bfloat16 and float16, float32 differs in summation order).
The residual stream is updated in place, so a layer's output is its input tensor.

On a CPU, a decode step (every sequence has one new token) of a layer whose projections are packed runs as
one compiled call (model/cpu/decode_layer.py). On a GPU these layers are what a decode step's CUDA graph
captures (model/cuda/cuda_graph.py).

The model's own forward still runs the layers, the rotary embedding and the final norm; only each
decoder layer's `forward` is replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fp8cache import ops as fp8_ops
from fp8cache.model import attention
from fp8cache.model.cpu import decode_layer
from fp8cache.model.cpu.packed_linear import merged_siblings
from fp8cache.model.forward_context import from_kwargs

# Decoder layers whose forward is exactly: pre-norm, q/k/v with rotate_half rotary, attention, o_proj,
# residual, post-norm, SiLU-gated MLP, residual.
SUPPORTED_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")


@dataclass(frozen=True)
class LayerOps:
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable


def layer_ops() -> LayerOps:
    """The compiled kernels, bound to their overloads: the cheapest call."""
    return LayerOps(*(fp8_ops.overload(name) for name in ("rms_norm", "fused_add_rms_norm",
                                                         "rotary_embedding_cos_sin", "silu_and_mul")))


class FusedDecoderLayer:
    """Replaces one decoder layer's forward; falls back to the original for inputs it was not built for."""

    def __init__(self, layer: nn.Module, ops: LayerOps) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        installed = layer.__dict__.get("forward")  # a runner sharing this model installed one already
        self.original = installed.original if isinstance(installed, FusedDecoderLayer) else layer.forward
        self.ops = ops
        self.layer_idx, self.scaling, self.head_dim = attn.layer_idx, attn.scaling, attn.head_dim
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.o_proj, self.down_proj = attn.o_proj, mlp.down_proj
        on_gpu = layer.input_layernorm.weight.device.type != "cpu"
        project = _device_projections if on_gpu else _projections
        self.qkv = project(attn.q_proj, attn.k_proj, attn.v_proj)
        self.gate_up = project(mlp.gate_proj, mlp.up_proj)
        # The layer's sliding window, soft cap and sinks (features_of); the whole-layer CPU op has none of them.
        self.features = attention.features_of(attn, getattr(attn, "config", None))
        self.whole_layer = None if on_gpu or not self.features.plain else decode_layer.WholeLayer.of(layer)

    def __call__(self, hidden_states: torch.Tensor, *args, position_embeddings=None, **kwargs) -> torch.Tensor:
        if (position_embeddings is None or hidden_states.dim() != 3 or hidden_states.shape[0] != 1
                or position_embeddings[0].shape[-1] != self.head_dim):
            return self.original(hidden_states, *args, position_embeddings=position_embeddings, **kwargs)
        ctx = from_kwargs(kwargs)
        ops, x = self.ops, hidden_states[0]  # [T, hidden]: the residual stream, updated in place
        cos, sin = position_embeddings
        if self.whole_layer is not None and self.whole_layer.run(ctx, x, cos[0], sin[0], self.scaling):
            return hidden_states
        tokens = x.shape[0]
        h = torch.empty_like(x)
        ops.rms_norm(h, x, self.input_norm.weight, self.input_norm.variance_epsilon)
        q, k, v = (t.view(tokens, -1, self.head_dim) for t in self.qkv(h))
        ops.rotary(q, k, cos[0], sin[0])
        out = attention.attend(ctx, self.layer_idx, q, k, v, self.scaling, self.features)
        h = self.o_proj(out.view(tokens, -1))
        ops.fused_add_rms_norm(h, x, self.post_norm.weight, self.post_norm.variance_epsilon)
        gate, up = self.gate_up(h)
        act = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        ops.silu_and_mul(act, gate, up)
        x.add_(self.down_proj(act))
        return hidden_states


def _projections(*linears: nn.Module) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """x -> each linear's output: column views of one matmul when they are the siblings of one MergedLinear
    in order, else one call each."""
    merged = merged_siblings(*linears)
    if merged is not None:
        bounds, packed = merged.bounds, merged.packed
        return lambda x: [y[:, start:stop] for y in (packed(x),) for start, stop in bounds]
    return lambda x: [m(x) for m in linears]


def _device_projections(*linears: nn.Linear) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """On a GPU: the siblings' weights (and biases) as one matrix, each linear's weight a view of its rows (no
    memory added), so q/k/v and gate/up are one matmul each; x -> column views of its output."""
    if any(type(m) is not nn.Linear for m in linears) or len({m.weight.dtype for m in linears}) != 1 or \
            len({m.bias is None for m in linears}) != 1:
        return lambda x: [m(x) for m in linears]
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
    sizes, start = [], 0
    for m in linears:
        rows = m.out_features
        m.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
        sizes.append(rows)
        start += rows
    return lambda x: F.linear(x, weight, bias).split(sizes, dim=-1)


def supports(layer: nn.Module) -> bool:
    if type(layer).__name__ not in SUPPORTED_LAYERS:
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    return (attn is not None and mlp is not None
            and all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "layer_idx",
                                                     "scaling", "head_dim"))
            and all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))
            and getattr(getattr(mlp, "config", None), "hidden_act", None) == "silu"
            and all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") for n in norms))


def install(model: nn.Module) -> int:
    """Give every supported decoder layer of `model` the lean forward (the compiled ops' CPU or CUDA kernels);
    returns how many layers run it. Runners sharing a model share its layers."""
    ops = layer_ops()
    count = 0
    for layer in model.modules():
        if supports(layer):
            layer.forward = FusedDecoderLayer(layer, ops)
            count += 1
    return count
