"""Hadamard rotation of the head dimension for the FP8 KV cache (`kv_rotation: "hadamard"`).

K and Q are multiplied by the same orthonormal matrix H before the dot product, so q.k is unchanged; V is
stored as V H and the attention output is multiplied by H^T, so softmax(qk) V is unchanged. In full
precision nothing changes. In FP8 the rounding error of each element is proportional to its size; without
the rotation a few large channels of K carry most of the error and meet large channels of Q in the dot
product. H spreads every channel over all others, so the error no longer lines up with Q.

H is the Sylvester Hadamard matrix divided by sqrt(n). It is symmetric and orthonormal, so it is its own
inverse: the same matrix rotates and rotates back.

Head sizes that are not a power of two (80, 96, 112, ...) get a block-diagonal H whose blocks are the largest
power of two that divides the head size (80 -> 5 blocks of 16, 96 -> 3 of 32, 112 -> 7 of 16); blocks smaller
than MIN_BLOCK spread too little and are refused.

`apply_rotation` is what the attention layer calls: the compiled fast Walsh-Hadamard transform
(torch.ops.fp8kv.hadamard_transform, O(d log d) per row) once the op library is loaded, else the float32
matmul `rotate` with `rotation_matrix` (O(d^2) per row), which stays the reference.
"""

from __future__ import annotations

import functools
import math

import torch

NONE, HADAMARD = "none", "hadamard"
ROTATIONS = (NONE, HADAMARD)
MIN_BLOCK = 8


def hadamard_block_size(head_size: int) -> int:
    """Size of the Hadamard blocks used for `head_size`: its largest power-of-two divisor."""
    if head_size < 1:
        raise ValueError(f"head_size must be positive, got {head_size}")
    block = head_size & -head_size
    if block < MIN_BLOCK:
        raise ValueError(f"kv rotation 'hadamard' needs a head size divisible by {MIN_BLOCK} (it uses Hadamard "
                         f"blocks of the largest power of two dividing it); head size {head_size} allows "
                         f"blocks of {block} only: use kv rotation 'none' for this model")
    return block


def sylvester_hadamard(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix of +-1 entries, float64 (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=16)
def _hadamard(head_size: int, device: str) -> torch.Tensor:
    block = hadamard_block_size(head_size)
    h = sylvester_hadamard(block) / math.sqrt(block)
    return torch.block_diag(*[h] * (head_size // block)).to(device=device, dtype=torch.float32)


def hadamard_matrix(head_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [head_size, head_size] orthonormal, symmetric (block-diagonal) Hadamard matrix."""
    return _hadamard(head_size, str(torch.device(device)))


def rotation_matrix(rotation: str, head_size: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The matrix for a kv rotation name, None for "none"; raises for unknown names or head sizes."""
    if rotation == NONE:
        return None
    if rotation == HADAMARD:
        return hadamard_matrix(head_size, device)
    raise ValueError(f"unknown kv rotation {rotation!r}; valid: {', '.join(ROTATIONS)}")


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x [..., d] @ matrix in float32, back in x's dtype. With a Hadamard matrix this also undoes itself."""
    return (x.to(torch.float32) @ matrix).to(x.dtype)


# dtypes the compiled op takes; others (float64, ...) go through the matmul.
_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def apply_rotation(x: torch.Tensor, rotation: str) -> torch.Tensor:
    """x [..., d] in the basis of kv rotation `rotation`, in x's dtype: x itself for "none", x @ H for
    "hadamard" (H is its own inverse, so the same call rotates back). The result is contiguous for "hadamard".

    Runs the compiled op when it can (see `uses_compiled_op`), else `rotate(x, rotation_matrix(...))`; the two
    agree to float32 rounding. Raises for unknown names and head sizes H cannot rotate."""
    if rotation == NONE:
        return x
    if rotation != HADAMARD:
        raise ValueError(f"unknown kv rotation {rotation!r}; valid: {', '.join(ROTATIONS)}")
    if x.dim() == 0:
        raise ValueError("apply_rotation needs x of shape [..., head_size], got a 0-dim tensor")
    hadamard_block_size(x.shape[-1])  # the same refusal on both paths
    if uses_compiled_op(x):
        return torch.ops.fp8kv.hadamard_transform(x)
    return rotate(x, hadamard_matrix(x.shape[-1], x.device))


_OP = "fp8kv::hadamard_transform"
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def uses_compiled_op(x: torch.Tensor) -> bool:
    """Whether apply_rotation(x, "hadamard") runs torch.ops.fp8kv.hadamard_transform: the op library is loaded
    in this process (fp8cache.ops.load(); this never compiles it), x is float32/bfloat16/float16, and the
    library has a kernel for x's device (CPU always, CUDA/ROCm when it was built with GPU sources). Asked of
    torch's dispatcher, which knows what the loaded library registered."""
    if x.dtype not in _OP_DTYPES or x.device.type not in _DISPATCH_KEYS:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(_OP, _DISPATCH_KEYS[x.device.type])
    except RuntimeError:  # no such operator: the library is not loaded
        return False
