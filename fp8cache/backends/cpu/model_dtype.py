"""Which of float32 and bfloat16 runs a model faster on this CPU.

A decode step streams every weight from memory, so bfloat16's half-size weights win wherever the CPU multiplies
bfloat16 natively (AMX, AVX512-BF16, Arm's BF16): `fp8kv bench throughput` (16 x 256 in / 128 out) gave 1.9x
the float32 throughput on an Intel Xeon with AMX and 1.4x on an AMD EPYC with AVX512-BF16. Without such
instructions the kernels widen bfloat16 to float32 as they multiply, and whether the halved bytes pay for that
depends on the CPU, so a short measurement of the kernels the engine would run decides, once per machine
(ops/probes.py).

`--dtype auto` on a CPU is this choice, and the startup line says why (fp8cache.device.describe_model_dtype).
Quality: a bfloat16 model's logits come out of its output projection in float32 (packed_linear.float32_logits);
rounded to bfloat16 they tied the README's example answer and added a third to the FP8 cache's KL. What is
left of bfloat16's extra KL over float32 (default model, 2 eval windows: 0.0032 against 0.0021) is
transformers' own: its bfloat16 model with the same FP8 rounding of K and V measures the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8cache.backends.cpu import packed_linear
from fp8cache.ops import _build, probes

# /proc/cpuinfo feature names of native bfloat16 multiplies, best first, with the names people know them by.
NATIVE_BF16 = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("bf16", "Arm BF16"))
# The measurement: a decoder layer's projections at a SmolLM2-sized width (packed_linear.race times them).
_SHAPES = ((1728, 576), (576, 576), (576, 1536), (1536, 576))


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} ({self.reason})"


def choose(features: set[str], bfloat16_faster: Callable[[], bool]) -> DtypeChoice:
    """The faster model dtype on a CPU with `features`; bfloat16_faster() is asked only where they don't decide."""
    for flag, name in NATIVE_BF16:
        if flag in features:
            return DtypeChoice(torch.bfloat16, f"auto: this CPU multiplies bfloat16 natively, with {name}")
    if bfloat16_faster():
        return DtypeChoice(torch.bfloat16, "auto: no native bfloat16 multiply, but bfloat16 measured faster here")
    return DtypeChoice(torch.float32, "auto: no native bfloat16 multiply, and float32 measured faster here")


@functools.cache
def cpu_auto_dtype() -> DtypeChoice:
    """This machine's choice (memoized: every engine of a process gets the same answer)."""
    return choose(_build.cpu_feature_names(),
                  lambda: probes.remembered(["bfloat16 model faster", "engine kernels"], measure_bfloat16_faster))


def measure_bfloat16_faster() -> bool:
    """Whether this machine's linear kernels for bfloat16 weights (packed_linear.engine_linear: fp8kv's panels
    where they run, else F.linear) beat its float32 ones at decoder shapes, decode batches streaming their
    weights from memory (packed_linear.race)."""
    float32, bfloat16 = packed_linear.race(
        [(packed_linear.engine_linear(dtype), dtype) for dtype in (torch.float32, torch.bfloat16)],
        frozenset(_SHAPES))
    return bfloat16 < float32
