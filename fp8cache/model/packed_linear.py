"""bfloat16 linear layers with their weights stored once in oneDNN's blocked layout (CPU).

A decode step multiplies a few rows by every weight of the model. `F.linear` hands oneDNN a plain
[out, in] weight on every call; a weight packed once at load, in the blocked layout its AMX /
AVX512-BF16 kernels read, streams from memory faster (measured with the default model's shapes in
bfloat16, 16 rows: all 210 layer matmuls 35 -> 27 ms, lm_head 7.1 -> 5.2 ms). Large batches (prefill) run as fast as before.
The packed copy replaces the module's weight (the plain one is freed), except for an output projection
that shares its weight with the input embeddings (both are kept).

Only bfloat16 on CPU: in float32 the packed path was faster at decode but up to 20% slower at prefill.
FP8KV_PACK_LINEARS=0 keeps every nn.Linear as it is.
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks its blocking for this many rows; decode batches are what the packing is for.
_BATCH_HINT = 16


class PackedLinear(nn.Module):
    """nn.Linear's forward over a weight packed by torch.ops.mkldnn._reorder_linear_weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT),
                             persistent=False)
        self.bias = linear.bias
        # Shape and dtype for code that inspects `weight`; it holds no values (the packed copy does).
        self.register_buffer("weight", torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch build packs and runs a `dtype` weight to F.linear's result (oneDNN with bfloat16
    support is missing from some builds and CPUs)."""
    try:
        generator = torch.Generator().manual_seed(0)
        linear = nn.Linear(64, 48, bias=True).to(dtype)
        x = torch.randn(1, 5, 64, generator=generator).to(dtype)
        with torch.no_grad():
            got, want = PackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def pack_linears(model: nn.Module, device: torch.device) -> int:
    """Replace the nn.Linear modules of a bfloat16 CPU model by PackedLinear; returns how many were."""
    if device.type != "cpu" or os.environ.get("FP8KV_PACK_LINEARS") == "0":
        return 0
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16]
    if not targets or not packing_works(torch.bfloat16):
        return 0
    with torch.no_grad():
        for parent, name in targets:
            setattr(parent, name, PackedLinear(getattr(parent, name)))
    _return_freed_memory()
    return len(targets)


def _return_freed_memory() -> None:
    """The plain weights were freed one layer at a time into the C heap, where glibc keeps them (the
    default model in bfloat16: 250 MB more resident than before packing); malloc_trim hands them back."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc: its allocator decides
        pass
