"""This machine's `--dtype auto` on a CPU (platform/model_dtype.py decides; here is what it measures where the
CPU's features don't decide): whether fp8kv's own linear kernels run a decoder faster over bfloat16 weights
than over float32 ones, measured once per machine and remembered beside the op library (ops/probes.py)."""

from __future__ import annotations

import functools

import torch

from fp8cache.model.cpu import packed_linear
from fp8cache.ops import probes
from fp8cache.platform import cpu_info
from fp8cache.platform.model_dtype import DtypeChoice, choose

# The measurement: a decoder layer's projections at a SmolLM2-sized width (packed_linear.race times them).
_SHAPES = ((1728, 576), (576, 576), (576, 1536), (1536, 576))


@functools.cache
def cpu_auto_dtype() -> DtypeChoice:
    """This machine's choice (memoized: every engine of a process gets the same answer)."""
    return choose(cpu_info.cpu_feature_names(),
                  lambda: probes.remembered(["bfloat16 model faster", "engine kernels"], measure_bfloat16_faster))


def measure_bfloat16_faster() -> bool:
    """Whether this machine's linear kernels for bfloat16 weights (packed_linear.engine_linear: fp8kv's panels
    where they run, else F.linear) beat its float32 ones at decoder shapes, decode batches streaming their
    weights from memory (packed_linear.race)."""
    float32, bfloat16 = packed_linear.race(
        [(packed_linear.engine_linear(dtype), dtype) for dtype in (torch.float32, torch.bfloat16)],
        frozenset(_SHAPES))
    return bfloat16 < float32
