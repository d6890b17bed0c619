"""FP8 weights as the quantization tools store them: run as FP8 matmuls on a GPU that has FP8 matrix units,
dequantized once at load everywhere else.

A quantized linear layer's checkpoint holds `weight` as float8 codes [out, in] and a float32 scale beside it:
`weight_scale` (compressed-tensors, ModelOpt, Quark, fbgemm) or `weight_scale_inv` (transformers' own `fp8`
method, DeepSeek's layout; despite the name it multiplies too). The scale's shape says how it applies:

- one value: per tensor (compressed-tensors FP8, ModelOpt FP8);
- [out] or [out, 1]: per output channel (FP8_DYNAMIC, fbgemm);
- [ceil(out / bn), ceil(in / bk)]: per bn x bk block (transformers `fp8` with weight_block_size, FP8_BLOCK).

The real weight is `code * scale`, the block or channel's scale repeated over it. Activations are quantized at
run time per token (dynamic), per tensor with a stored `input_scale` (static), or per 128-column group of a
token beside block scales, as the checkpoint's scheme says (model/checkpoints.py).

On CUDA with compute capability 8.9 or newer (Ada, Hopper and later) each such layer becomes an Fp8Linear: the
codes stay in FP8 (half the memory of bfloat16) and `torch._scaled_mm` multiplies them with the FP8
activations on the tensor cores: per-tensor scales as one scalar each (tensorwise), per-channel or per-token
scales as row vectors (rowwise, bfloat16 out), block scales as 1x128 / 128x128 tiles (sm_90). A short
numerical self-check on the device runs first; a kernel the device or torch build refuses or gets wrong
sends the model to dequantized weights, with the reason in the startup line. Everywhere else (CPUs, older
GPUs, tensor parallelism, weight-only schemes, a float32 model) the codes are dequantized into the model
dtype once at load, so fp8kv's packed CPU linears and the GPU's lean layers take them as any other weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fp8cache.platform.device import compute_capability, gpu_name, is_rocm

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
# An all-zero row or group must not divide by zero; far below any real activation's scale.
_MIN_ACT_SCALE = 1e-12
BLOCK = 128  # the only block size torch's scaled matmul takes (1x128 activations, 128x128 weights)
ACTIVATIONS = ("dynamic-token", "dynamic-tensor", "static-tensor", "dynamic-group", "none")


class Fp8WeightsError(ValueError):
    """FP8 weights that cannot be used as stored; the message names the tensor and the fix."""


# ---- scales and dequantization -------------------------------------------------------------------------

def scale_kind(scale: torch.Tensor, out_features: int, in_features: int,
               block: tuple[int, int] | None = None) -> str:
    """"tensor", "channel" or "block" for a weight scale of this shape (see the module docstring)."""
    if scale.numel() == 1:
        return "tensor"
    if scale.dim() == 1 and scale.shape[0] == out_features or \
            scale.dim() == 2 and scale.shape == (out_features, 1):
        return "channel"
    bn, bk = block or (BLOCK, BLOCK)
    if scale.dim() == 2 and scale.shape == (math.ceil(out_features / bn), math.ceil(in_features / bk)):
        return "block"
    raise Fp8WeightsError(f"a weight scale of shape {list(scale.shape)} fits no FP8 layout of a [{out_features}, "
                          f"{in_features}] weight: per tensor [1], per channel [{out_features}] or "
                          f"[{out_features}, 1], or per {bn}x{bk} block "
                          f"[{math.ceil(out_features / bn)}, {math.ceil(in_features / bk)}]")


def expand_scale(scale: torch.Tensor, kind: str, shape: tuple[int, int],
                 block: tuple[int, int] | None = None) -> torch.Tensor:
    """The scale of every weight element, [out, in] float32 (a broadcastable view where it can be one)."""
    out_features, in_features = shape
    s = scale.detach().to(torch.float32)
    if kind == "tensor":
        return s.reshape(1, 1)
    if kind == "channel":
        return s.reshape(out_features, 1)
    bn, bk = block or (BLOCK, BLOCK)
    return s.repeat_interleave(bn, dim=0)[:out_features].repeat_interleave(bk, dim=1)[:, :in_features]


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """codes (float8 [out, in]) times their scale, in `dtype`; the arithmetic in float32."""
    if codes.dtype not in FP8_DTYPES or codes.dim() != 2:
        raise Fp8WeightsError(f"expected a 2-D float8 weight, got {codes.dtype} of shape {list(codes.shape)}")
    kind = scale_kind(scale, *codes.shape, block)
    return (codes.to(torch.float32) * expand_scale(scale, kind, tuple(codes.shape), block)).to(dtype)


def quantize_activations(x: torch.Tensor, granularity: str,
                         scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3FN codes, float32 scales) so that codes * scales ~ x: one scale per token ([M, 1]),
    per tensor ([] from x's absolute maximum, or the stored static `scale`), or per 128-column group of a
    token ([M, K / 128]). Device ops only: a CUDA graph can hold them."""
    xf = x.to(torch.float32)
    if granularity == "token":
        s = (xf.abs().amax(dim=-1, keepdim=True) / _E4M3_MAX).clamp(min=_MIN_ACT_SCALE)
    elif granularity == "tensor":
        s = scale.to(torch.float32).reshape(()) if scale is not None else \
            (xf.abs().amax() / _E4M3_MAX).clamp(min=_MIN_ACT_SCALE)
    elif granularity == "group":
        groups = xf.view(xf.shape[0], -1, BLOCK)
        s = (groups.abs().amax(dim=-1) / _E4M3_MAX).clamp(min=_MIN_ACT_SCALE)
        codes = (groups / s.unsqueeze(-1)).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
        return codes.view(x.shape), s
    else:
        raise ValueError(f"unknown activation granularity {granularity!r}; valid: token, tensor, group")
    return (xf / s).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn), s


# ---- the FP8 linear layer ------------------------------------------------------------------------------

MODES = ("tensorwise", "rowwise", "block")


def matmul_mode(kind: str, activations: str, block: tuple[int, int] | None) -> str | None:
    """How _scaled_mm runs a weight of this scale kind with these activations; None: it cannot (dequantize)."""
    if activations == "none":
        return None  # weight-only FP8: the activations stay in 16 bits, which _scaled_mm does not take
    if kind == "block":
        return "block" if activations == "dynamic-group" and tuple(block or (BLOCK, BLOCK)) == (BLOCK, BLOCK) else None
    if activations == "dynamic-group":
        return None
    if kind == "tensor" and activations in ("static-tensor", "dynamic-tensor"):
        return "tensorwise"
    return "rowwise"


class Fp8Linear(nn.Module):
    """nn.Linear's forward with an FP8 weight: activations quantized to E4M3FN on the fly, one _scaled_mm.

    Buffers: `weight` (float8 [out, in]; its transpose is the column-major operand _scaled_mm wants),
    `weight_scale` (tensorwise [], rowwise [1, out], block [ceil(out / 128), ceil(in / 128)]), `input_scale`
    ([] for static activations) and `bias` (the model dtype, added after the matmul)."""

    fp8 = True

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, mode: str, activations: str,
                 input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown FP8 matmul mode {mode!r}; valid: {', '.join(MODES)}")
        if weight.dtype != torch.float8_e4m3fn:
            raise Fp8WeightsError(f"FP8 matmuls take E4M3FN weights, got {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.mode, self.activations, self.out_dtype = mode, activations, out_dtype
        self.register_buffer("weight", weight.contiguous())
        scale = weight_scale.detach().to(torch.float32)
        if mode == "tensorwise":
            scale = scale.reshape(())
        elif mode == "rowwise":
            scale = scale.reshape(-1).expand(self.out_features).reshape(1, self.out_features).contiguous()
        else:
            scale = scale.contiguous()
        self.register_buffer("weight_scale", scale)
        self.register_buffer("input_scale", None if input_scale is None else
                             input_scale.detach().to(torch.float32).reshape(()))
        self.register_buffer("bias", None if bias is None else bias.detach().to(out_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if self.mode == "tensorwise":
            codes, s = quantize_activations(x2, "tensor", self.input_scale)
            y = torch._scaled_mm(codes, self.weight.t(), scale_a=s, scale_b=self.weight_scale,
                                 out_dtype=self.out_dtype)
        elif self.mode == "rowwise":
            granularity = "tensor" if self.activations in ("static-tensor", "dynamic-tensor") else "token"
            codes, s = quantize_activations(x2, granularity, self.input_scale)
            s = s.reshape(-1, 1).expand(rows, 1).clone(memory_format=torch.contiguous_format)
            # Rowwise scaling writes bfloat16 only.
            y = torch._scaled_mm(codes, self.weight.t(), scale_a=s, scale_b=self.weight_scale,
                                 out_dtype=torch.bfloat16)
        else:
            pad = -rows % 4  # cuBLAS reads 1x128 activation scales in columns of a multiple of 4 rows
            codes, s = quantize_activations(F.pad(x2, (0, 0, 0, pad)) if pad else x2, "group")
            # 1x128 activation scales go in column-major ("outer-dim-major"), as cuBLAS reads them.
            scale_a = s.t().clone(memory_format=torch.contiguous_format).t()
            y = torch._scaled_mm(codes, self.weight.t(), scale_a=scale_a,
                                 scale_b=self.weight_scale.t(), out_dtype=torch.bfloat16).narrow(0, 0, rows)
        if y.dtype != self.out_dtype:
            y = y.to(self.out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, "
                f"activations={self.activations}, bias={self.bias is not None}")


def make_fp8_linear(codes: torch.Tensor, scale: torch.Tensor, activations: str, input_scale: torch.Tensor | None,
                    bias: torch.Tensor | None, dtype: torch.dtype,
                    block: tuple[int, int] | None = None) -> Fp8Linear | None:
    """The Fp8Linear for a layer, or None where _scaled_mm cannot take it (the caller dequantizes): its scale
    and activation scheme have no kernel, its codes are not E4M3FN, or its shape is not a multiple of 16 (of
    128 for block scales)."""
    out_features, in_features = codes.shape
    kind = scale_kind(scale, out_features, in_features, block)
    mode = matmul_mode(kind, activations, block)
    if mode is None or codes.dtype != torch.float8_e4m3fn:
        return None
    multiple = BLOCK if mode == "block" else 16
    if in_features % multiple or out_features % multiple:
        return None
    if activations == "static-tensor" and input_scale is None:
        raise Fp8WeightsError("a static activation scheme needs an input_scale tensor beside the weight")
    return Fp8Linear(codes, scale, mode, activations, input_scale if activations == "static-tensor" else None,
                     bias, dtype)


# ---- where FP8 matmuls run -----------------------------------------------------------------------------

def fp8_matmul_support(device: torch.device) -> tuple[bool, str]:
    """(whether this device runs FP8 matmuls, why not / which GPU)."""
    if device.type != "cuda":
        return False, "this device has no FP8 matrix units (FP8 matmuls need an NVIDIA GPU of compute capability 8.9+)"
    if is_rocm():
        return False, "FP8 matmuls run on NVIDIA GPUs only for now"
    major, minor = compute_capability(device)
    name = gpu_name(device)
    if (major, minor) < (8, 9):
        return False, f"{name} (sm_{major}{minor}) has no FP8 matrix units (sm_89 or newer has)"
    return True, f"{name} (sm_{major}{minor})"


def probe(device: torch.device, dtype: torch.dtype, modes: Iterable[tuple[str, str]],
          seed: int = 0) -> str | None:
    """Run each (mode, activations) kernel once on random data on `device` and compare with the dequantized
    matmul; None when all agree, else what failed. A kernel that a GPU or torch build refuses, or reads in
    another layout (a wrong answer, not an error), is caught here rather than in the model's output."""
    gen = torch.Generator().manual_seed(seed)
    for mode, activations in sorted(set(modes)):
        size = 256
        w = torch.randn(size, size, generator=gen) / 16
        x = torch.randn(8, size, generator=gen)
        if mode == "block":
            s = w.view(2, BLOCK, 2, BLOCK).abs().amax(dim=(1, 3)) / _E4M3_MAX
        elif mode == "rowwise":
            s = w.abs().amax(dim=1) / _E4M3_MAX
        else:
            s = w.abs().amax() / _E4M3_MAX
        kind = "block" if mode == "block" else "channel" if mode == "rowwise" else "tensor"
        codes = (w / expand_scale(s, kind, (size, size))).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
        input_scale = x.abs().amax() / _E4M3_MAX if activations == "static-tensor" else None
        expected = F.linear(x.to(dtype).float(), dequantize(codes, s, torch.float32))
        try:
            layer = Fp8Linear(codes, s, mode, activations, input_scale, None, dtype).to(device)
            got = layer(x.to(device, dtype)).float().cpu()
        except Exception as exc:  # noqa: BLE001 - whatever the kernel raises is the reason to dequantize
            return f"{mode} FP8 matmul failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        error = float((got - expected).norm() / expected.norm())
        if not math.isfinite(error) or error > 0.1:  # E4M3's rounding gives ~0.02 here; a wrong layout ~1
            return f"{mode} FP8 matmul disagrees with the dequantized one (relative error {error:.3g})"
    return None


# ---- applying a checkpoint's FP8 weights to a loaded model ----------------------------------------------

@dataclass
class Fp8Report:
    """What load did with the FP8 weights, for the startup line."""

    fp8_layers: int = 0
    dequantized: int = 0
    reason: str = ""  # why dequantized
    modes: dict[str, int] = field(default_factory=dict)


def apply(model: nn.Module, layers: dict[str, dict[str, str]], read: Callable[[list[str]], dict[str, torch.Tensor]],
          activations: str, dtype: torch.dtype, run_fp8: bool, block: tuple[int, int] | None = None) -> Fp8Report:
    """Give each FP8 layer of `model` its real weight. `layers` maps a module path to the checkpoint names of
    its "weight" codes, "scale" and optionally "input_scale"; `read` reads named tensors (one layer at a time, so
    the codes of a large model never all sit in memory beside it). run_fp8: replace nn.Linear layers _scaled_mm
    can take by Fp8Linear; the rest, and all without it, get their codes dequantized into the module's weight."""
    report = Fp8Report()
    for path, names in layers.items():
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise Fp8WeightsError(f"the checkpoint's FP8 weight {path}.weight belongs to no layer of the model "
                                  f"({type(model).__name__})") from None
        stored = read(list(names.values()))
        tensors = {key: stored[name] for key, name in names.items()}
        codes, scale = tensors["weight"], tensors["scale"]
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != tuple(codes.shape):
            raise Fp8WeightsError(f"the checkpoint's FP8 weight {path}.weight has shape {list(codes.shape)}, the "
                                  f"model's {type(module).__name__} "
                                  f"{list(weight.shape) if isinstance(weight, torch.Tensor) else 'none'}")
        try:
            fast = make_fp8_linear(codes, scale, activations, tensors.get("input_scale"), module.bias, dtype,
                                   block) if run_fp8 and type(module) is nn.Linear else None
            real = None if fast is not None else dequantize(codes, scale, weight.dtype, block)
        except Fp8WeightsError as exc:
            raise Fp8WeightsError(f"{path}: {exc}") from None
        if fast is not None:
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, fast)
            report.fp8_layers += 1
            report.modes[fast.mode] = report.modes.get(fast.mode, 0) + 1
            continue
        with torch.no_grad():
            weight.copy_(real)
        report.dequantized += 1
    return report
