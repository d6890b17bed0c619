"""A 16-bit model's logits in float32 on a GPU: its output projection as one GEMM with a float32 result.

Rounded to bfloat16, logits near 16 are 1/8 apart: greedy decoding ties tokens there, and logprobs and KL
measurements see the steps (on a CPU the default model answered the README's question wrong over an FP8 cache
until its logits stayed float32; model/cpu/packed_linear.float32_logits does that there). cuBLAS sums in
float32 anyway; torch.mm's out_dtype (CUDA, float16 or bfloat16 inputs) keeps the sum instead of rounding it,
for the same weight bytes read.
"""

from __future__ import annotations

import torch
from torch import nn


class Float32Logits(nn.Module):
    """The output projection `head` (an nn.Linear, kept as a submodule: its weight may be tied to the input
    embeddings) with float32 output."""

    float32_out = True  # as a CPU head with float32 output says it (packed_linear.PackedLinear)

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = torch.mm(x.reshape(-1, x.shape[-1]), self.head.weight.t(), torch.float32)
        if self.head.bias is not None:
            flat = flat + self.head.bias.float()
        return flat.reshape(*x.shape[:-1], flat.shape[-1])


def install(model: nn.Module, device: torch.device) -> bool:
    """Make a 16-bit model's output projection on a GPU give float32 logits, where this torch build can
    (tried once on the device); whether it did."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if device.type == "cpu" or type(head) is not nn.Linear or head.weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not _mm_to_float32_works(device, head.weight.dtype):
        return False
    model.set_output_embeddings(Float32Logits(head))
    return True


def _mm_to_float32_works(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        a, b = torch.zeros(2, 16, dtype=dtype, device=device), torch.zeros(16, 8, dtype=dtype, device=device)
        return torch.mm(a, b, torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):  # an older torch, or no such kernel for this GPU
        return False
