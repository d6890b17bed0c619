"""An independent Hadamard matrix for the rotation tests, without scipy (not a dependency of fp8kv).

fp8cache.kvcache.rotation builds Sylvester's matrix by doubling; this one uses the closed form of the same
(Walsh) matrix, H[i, j] = (-1) ** popcount(i & j), which is also what scipy.linalg.hadamard returns."""

from __future__ import annotations

import math

import torch


def walsh_hadamard(n: int) -> torch.Tensor:
    """The n x n Hadamard matrix of +-1 entries in Sylvester's order, float64 (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}")
    i = torch.arange(n).reshape(-1, 1)
    j = torch.arange(n).reshape(1, -1)
    bits = i & j
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return 1.0 - 2.0 * parity.to(torch.float64)


def reference_hadamard(head_size: int, block: int) -> torch.Tensor:
    """Block-diagonal normalized Hadamard: `head_size // block` copies of walsh_hadamard(block) / sqrt(block)."""
    h = walsh_hadamard(block) / math.sqrt(block)
    return torch.block_diag(*[h] * (head_size // block))
