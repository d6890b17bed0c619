"""Saturation counted: how many K/V values an FP8 cache write clips or flushes to zero, per layer.

With a static scale (per tensor or per head) a value whose |x / scale| exceeds the format's largest magnitude is
clipped to it, and a nonzero value too small for the format's smallest subnormal becomes a zero code: both are
silent losses, and the common cause of wrong output on a model whose K or V outgrow their scales (none, 1.0,
or a calibration that missed an outlier). Dynamic scales (one per token and KV head, from the head vector's own
maximum) cannot clip, but a value far below its vector's maximum still flushes to zero: they are counted the
same way, with the scales the write computes (dynamic_scales.scales_of), so that `fp8kv eval --per-layer` and
the choice of layers to keep in 16 bits work for them too.

Counting happens on the engine side, with torch ops on the step's own K/V beside the cache write, on one step
in `sample_every` (every step for `fp8kv eval`): it needs no change to any backend's write kernel (CPU, CUDA,
HIP, the host emulation count the same way), costs nothing on the steps it skips, and the ratio of the counts
is an unbiased estimate of the share lost. A counted decode step takes the per-op path instead of the CPU
whole-layer decode op (and no CUDA graph), since those write the cache inside one compiled call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8cache.kvcache.dynamic_scales import scales_of, token_head_amax
from fp8cache.kvcache.formats import Fp8Format

KINDS = ("k", "v")
WARN_RATIO = 0.001  # more than 0.1% of a layer's values clipped: worth a warning
SAMPLE_EVERY = 32  # serving: count one step in 32


@dataclass(frozen=True)
class LayerSaturation:
    """One layer's counts for K or V: values counted, clipped at the format's max, nonzero ones written as zero."""

    layer: int
    kind: str  # "k" or "v"
    written: int
    saturated: int
    underflow: int
    # relative MSE of the dequantized values against the exact ones (sum of squared errors / sum of squares),
    # measured only when the counter is asked to (fp8kv eval --per-layer): it costs a float8 round trip
    relative_mse: float | None = None

    @property
    def saturated_ratio(self) -> float:
        return self.saturated / self.written if self.written else 0.0


def _broadcast(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float32 scale shaped to multiply x [T, kv_heads, d]: [1] or [kv_heads] (static), [T, kv_heads] (dynamic)."""
    scale = scale.float()
    return scale.unsqueeze(-1) if scale.dim() == 2 and x.dim() == 3 else scale.view(-1, 1)


def dynamic_scales(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """float32 [T, kv_heads]: the per-token scales the dynamic cache write gives x [T, kv_heads, d]."""
    return scales_of(token_head_amax(x), fmt.max).float()


def count_lost(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """int64 [3]: (values, clipped, flushed to zero) when x [T, kv_heads, d] is written with `scale` ([1] or one
    per KV head, or [T, kv_heads] dynamic scales) in `fmt`, as the cache write scales it (times 1 / scale).
    Flushed: nonzero, yet at most half the smallest subnormal, which rounds (to nearest even) to a zero code; found
    by comparison, not by a float8 cast, which torch does several times slower on the CPU."""
    magnitude = (x.float() * _broadcast(scale, x).reciprocal()).abs_()
    clipped = (magnitude > fmt.max).sum()
    flushed = (magnitude <= smallest_subnormal(fmt) / 2).sum() - (x == 0).sum()
    # torch.full, not torch.tensor: no host-to-device copy of the count (and the stand-in GPU's fake tensors)
    return torch.stack([torch.full((), x.numel(), dtype=torch.int64, device=x.device), clipped, flushed])


def squared_error(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """float64 [2]: (sum of squared errors of x's dequantized FP8 codes, sum of x squared), x [T, kv_heads, d]
    written with `scale` as the cache write does: codes of clamp(x / scale, +-max), read back times scale."""
    exact, scale = x.double(), _broadcast(scale, x)
    scaled = (x.float() * scale.reciprocal()).clamp_(-fmt.max, fmt.max)
    back = scaled.to(fmt.torch_dtype).double() * scale.double()
    return torch.stack([(back - exact).square().sum(), exact.square().sum()])


def smallest_subnormal(fmt: Fp8Format) -> float:
    return 2.0 ** (1 - fmt.bias - fmt.mantissa_bits)


class SaturationCounter:
    """Per-layer running counts of a runner's cache writes, kept on the device between counted steps and read
    back once after each one. dynamic: the cache computes a scale per token and KV head (the scales passed to
    count are then not used)."""

    def __init__(self, num_layers: int, fmt: Fp8Format, device: torch.device | str,
                 sample_every: int = SAMPLE_EVERY, warn: Callable[[str], None] | None = None,
                 dynamic: bool = False) -> None:
        if sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {sample_every}")
        self.fmt, self.sample_every, self.warn, self.dynamic = fmt, sample_every, warn, dynamic
        self.measure_error = False  # also the relative MSE per layer (fp8kv eval --per-layer)
        self._device_counts = torch.zeros(num_layers, len(KINDS), 3, dtype=torch.int64, device=device)
        self._device_errors = torch.zeros(num_layers, len(KINDS), 2, dtype=torch.float64, device=device)
        self._counts = [[(0, 0, 0) for _ in KINDS] for _ in range(num_layers)]
        self._errors: list | None = None
        self._warned: set[int] = set()
        self._steps = 0

    def start_step(self) -> bool:
        """Whether the step about to run is one to count (one in sample_every, the first one included)."""
        counted = self._steps % self.sample_every == 0
        self._steps += 1
        return counted

    def count(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor,
              v_scale: torch.Tensor) -> None:
        """Add what writing k and v ([T, kv_heads, d]) with these scales loses to `layer`'s counts."""
        if self.dynamic:
            k_scale, v_scale = dynamic_scales(k, self.fmt), dynamic_scales(v, self.fmt)
        self._device_counts[layer, 0] += count_lost(k, k_scale, self.fmt)
        self._device_counts[layer, 1] += count_lost(v, v_scale, self.fmt)
        if self.measure_error:
            self._device_errors[layer, 0] += squared_error(k, k_scale, self.fmt)
            self._device_errors[layer, 1] += squared_error(v, v_scale, self.fmt)

    def finish_step(self) -> None:
        """Read the counts back after a counted step, and warn once per layer whose clipped share passed 0.1%."""
        self._counts = [[tuple(kind) for kind in layer] for layer in self._device_counts.tolist()]
        if self.measure_error:
            self._errors = self._device_errors.tolist()
        for entry in self.snapshot():
            if entry.saturated_ratio > WARN_RATIO and entry.layer not in self._warned and self.warn is not None:
                self._warned.add(entry.layer)
                self.warn(f"KV cache layer {entry.layer}: {100 * entry.saturated_ratio:.2f}% of its {entry.kind.upper()} "
                          f"values clip at the {self.fmt.name} maximum ({entry.saturated} of {entry.written} counted); "
                          "its scales are too small: use --kv-scales dynamic or calibrated scales (fp8kv calibrate)")

    def snapshot(self) -> list[LayerSaturation]:
        """Every layer's K and V counts as of the last counted step (plain ints: safe to read from any thread)."""
        counts, errors = self._counts, self._errors
        return [LayerSaturation(layer, kind, *counts[layer][i],
                                _ratio(*errors[layer][i]) if errors is not None else None)
                for layer in range(len(counts)) for i, kind in enumerate(KINDS)]


def _ratio(error: float, norm: float) -> float:
    return error / norm if norm else 0.0
