"""The model dtype `--dtype` names, and what `--dtype auto` means on each device.

On a GPU, auto is the checkpoint's 16-bit dtype (bfloat16 for a float32 checkpoint: float16's range overflows
in some models' activations; vLLM picks float16 here, TGI bfloat16). On a CPU it is whichever of float32 and
bfloat16 runs a model faster. A decode step streams every weight from memory, so bfloat16's half-size weights
win wherever the CPU multiplies bfloat16 natively (AMX, AVX512-BF16, Arm's BF16): `fp8kv bench throughput`
(16 x 256 in / 128 out) gave 1.9x the float32 throughput on an Intel Xeon with AMX and 1.4x on an AMD EPYC with
AVX512-BF16. Without such instructions the kernels widen bfloat16 to float32 as they multiply, and whether the
halved bytes pay for that depends on the CPU, so a short measurement of the kernels the engine would run
decides, once per machine: the caller passes it in (model/cpu/dtype_probe.py measures fp8kv's linears).

Quality: a bfloat16 model's logits come out of its output projection in float32 (packed_linear.float32_logits);
rounded to bfloat16 they tied the README's example answer and added a third to the FP8 cache's KL. What is
left of bfloat16's extra KL over float32 (default model, 2 eval windows: 0.0032 against 0.0021) is
transformers' own: its bfloat16 model with the same FP8 rounding of K and V measures the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

AUTO = "auto"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DTYPES = (torch.float32, torch.bfloat16)
# /proc/cpuinfo feature names of native bfloat16 multiplies, best first, with the names people know them by.
NATIVE_BF16 = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("bf16", "Arm BF16"))


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} ({self.reason})"


CpuChoice = Callable[[], DtypeChoice]  # this machine's CPU choice, asked only when a CPU's auto needs it


def choose(features: set[str], bfloat16_faster: Callable[[], bool]) -> DtypeChoice:
    """The faster model dtype on a CPU with `features`; bfloat16_faster() is asked only where they don't decide."""
    for flag, name in NATIVE_BF16:
        if flag in features:
            return DtypeChoice(torch.bfloat16, f"auto: this CPU multiplies bfloat16 natively, with {name}")
    if bfloat16_faster():
        return DtypeChoice(torch.bfloat16, "auto: no native bfloat16 multiply, but bfloat16 measured faster here")
    return DtypeChoice(torch.float32, "auto: no native bfloat16 multiply, and float32 measured faster here")


def resolve(name: str, device: torch.device, checkpoint_dtype: torch.dtype | None,
            cpu_choice: CpuChoice) -> torch.dtype:
    """The model dtype for a --dtype value on `device`; ValueError names the valid ones."""
    if name == AUTO:
        return auto_dtype(device, checkpoint_dtype, cpu_choice)
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not known; valid: auto, {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    if device.type == "cpu" and dtype not in CPU_DTYPES:
        raise ValueError(f"dtype {name!r} is not supported on CPU; use auto, float32 or bfloat16")
    return dtype


def auto_dtype(device: torch.device, checkpoint_dtype: torch.dtype | None, cpu_choice: CpuChoice) -> torch.dtype:
    """--dtype auto (see the module docstring)."""
    if device.type == "cpu":
        return cpu_choice().dtype
    if checkpoint_dtype in (torch.bfloat16, torch.float16):
        return checkpoint_dtype
    return torch.bfloat16


def describe(asked: str, device: torch.device, dtype: torch.dtype, cpu_choice: CpuChoice) -> str:
    """The startup line's model dtype and why it is that one."""
    name = str(dtype).removeprefix("torch.")
    if asked != AUTO:
        return f"{name} (--dtype {asked})"
    if device.type != "cpu":
        return f"{name} (auto: the checkpoint's 16-bit dtype on a GPU, bfloat16 for a float32 checkpoint)"
    return f"{name} ({cpu_choice().reason}; --dtype float32 or bfloat16 chooses)"
