"""KV cache scale values: what a scale means, one layer's K and V scales, sharding them over tensor-parallel
ranks, and scales computed from observed maxima (docs/design.md section 3). Reading and writing scale files and
checkpoint names live in kvcache/scale_files.py.

Convention: stored = Q(x / scale), x ~= dequant(stored) * scale. One float32 tensor per layer for K and
one for V, shape [1] (per tensor) or [num_kv_heads] (per KV head).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import struct
from dataclasses import dataclass

import torch

from fp8cache.kvcache import formats

logger = logging.getLogger(__name__)

ROTATIONS = ("none", "hadamard")
GRANULARITIES = ("tensor", "head")
# Floor for computed scales: an all-zero first batch must not give scale 0 (x / 0), and x / 1e-12 stays
# finite in float32 for any activation below 1e26.
MIN_SCALE = 1e-12
# Scales a file may hold: [MIN_SCALE, MAX_SCALE], compared in float32 (MIN_SCALE is what calibration writes
# for an all-zero head). Outside it the cache stores nothing useful in any format: at 1e-12 the largest
# storable |x| is under 6e-8 (E5M2's 57344 x 1e-12), so every K/V saturates; at 1e12 the smallest nonzero
# code stands for more than 1.5e7 (E5M2's 2**-16 x 1e12), so every K/V a model makes is stored as 0.
MAX_SCALE = 1e12
MIN_SCALE_F32 = float(torch.tensor(MIN_SCALE, dtype=torch.float32))
MAX_SCALE_F32 = float(torch.tensor(MAX_SCALE, dtype=torch.float32))

# E4M3FNUZ (bias 8) reads every code as half the E4M3FN (bias 7) value, so its scales are twice as large.
E4M3_SCALE_UNIT = {"fp8_e4m3": 1.0, "fp8_e4m3fnuz": 2.0}




_FILE_FIX = "make scales for this model with `fp8kv calibrate`, or fix the file by hand"


class ScalesError(ValueError):
    """Scales that cannot be used; the message says where they came from and how to fix them."""


class ScalesFileError(ScalesError):
    def __init__(self, path: str | os.PathLike, key: str, problem: str, fix: str = _FILE_FIX):
        self.path, self.key, self.problem, self.fix = str(path), key, problem, fix
        where = f"scales file {self.path}" + (f", key {key}" if key else "")
        super().__init__(f"{where}: {problem}: {fix}")


class CheckpointScalesError(ScalesError):
    pass


@dataclass
class KVScales:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    fmt_name: str  # canonical kv-cache-dtype the scales apply to ("fp8_e4m3", ...)
    source: str  # for people: "file scales.json", "checkpoint", ...
    rotation: str = "none"  # "hadamard": k and v are scales of K H and V H (fp8cache.kvcache.rotation)
    # Rotated scales only: per layer, one scale for the UNROTATED K and V together. It is what the plain vLLM
    # `scaling_factor` of a rotated file holds, for readers that know no rotation and apply it to unrotated
    # K/V; fp8kv itself uses k and v. None for unrotated scales (their plain scale is max(k, v)).
    unrotated_scales: list[float] | None = None
    # The kv_recent_window the scales were made for (`fp8kv calibrate --kv-recent-window`); run, eval and
    # bench use it when the user gives none. None: not recorded.
    recent_window: int | None = None

    def __post_init__(self) -> None:
        if self.recent_window is not None and (not isinstance(self.recent_window, int)
                                               or isinstance(self.recent_window, bool) or self.recent_window < 0):
            raise ValueError(f"recent_window={self.recent_window!r} must be a whole number of tokens >= 0")
        if len(self.k) != len(self.v):
            raise ValueError(f"KVScales needs as many K as V layers, got {len(self.k)} and {len(self.v)}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"unknown kv rotation {self.rotation!r}; valid: {', '.join(ROTATIONS)}")
        if self.unrotated_scales is not None:
            if self.rotation == "none":
                raise ValueError("unrotated_scales are for rotated scales only; unrotated scales give vLLM's "
                                 "plain scale as max(k, v)")
            if len(self.unrotated_scales) != len(self.k):
                raise ValueError(f"unrotated_scales has {len(self.unrotated_scales)} layers, k and v have "
                                 f"{len(self.k)}")
            bad = [s for s in self.unrotated_scales if not (math.isfinite(s) and s > 0)]
            if bad:
                raise ValueError(f"unrotated_scales must be positive finite numbers, got {bad[0]!r}")

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def per_head(self) -> bool:
        return any(t.numel() > 1 for t in self.k + self.v)

    def fingerprint(self) -> str:
        """Short hash of what the cached bytes mean: format, rotation and every scale value."""
        h = hashlib.sha256(f"{self.fmt_name}|{self.rotation}|{self.num_layers}".encode())
        for tensors in (self.k, self.v):
            for t in tensors:
                data = t.detach().to("cpu", torch.float32).reshape(-1)
                h.update(str(tuple(t.shape)).encode())
                # The values' float32 bits, as a list (a tensor subclass, e.g. under FakeTensorMode in the
                # GPU-path tests, has no numpy view).
                h.update(struct.pack(f"<{data.numel()}f", *data.tolist()))
        return h.hexdigest()[:16]

    def for_format(self, name: str) -> KVScales:
        """The same scales for a cache of format `name` (a canonical kv-cache-dtype or "auto")."""
        check_canonical(name)
        if name == self.fmt_name:
            return self
        factor = 1.0
        if self.fmt_name in E4M3_SCALE_UNIT and name in E4M3_SCALE_UNIT:
            factor = E4M3_SCALE_UNIT[name] / E4M3_SCALE_UNIT[self.fmt_name]
        unrotated = None if self.unrotated_scales is None else [s * factor for s in self.unrotated_scales]
        return KVScales([t * factor for t in self.k], [t * factor for t in self.v], name, self.source,
                        self.rotation, unrotated, self.recent_window)

    def shard(self, tp_rank: int, tp_size: int) -> KVScales:
        """This tensor-parallel rank's scales: per-head vectors cut to the rank's heads."""
        if tp_size == 1:
            return self

        def cut(t: torch.Tensor) -> torch.Tensor:
            if t.numel() == 1:
                return t
            start, stop = head_range(t.numel(), tp_rank, tp_size)
            return t[start:stop].clone()

        return KVScales([cut(t) for t in self.k], [cut(t) for t in self.v], self.fmt_name, self.source,
                        self.rotation, self.unrotated_scales, self.recent_window)


def head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, stop) of the KV heads rank `tp_rank` holds; fewer heads than ranks replicates heads."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside [0, tp_size={tp_size})")
    if num_kv_heads % tp_size == 0:
        per_rank = num_kv_heads // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    if tp_size % num_kv_heads == 0:
        head = tp_rank * num_kv_heads // tp_size
        return head, head + 1
    raise ValueError(f"{num_kv_heads} KV heads cannot be split across {tp_size} tensor-parallel ranks: "
                     f"choose a tensor-parallel size that divides {num_kv_heads} or is a multiple of it")


def check_canonical(name: str) -> None:
    if name != formats.AUTO and name not in formats.FP8_FORMATS:
        valid = ", ".join((formats.AUTO, *formats.FP8_FORMATS))
        hint = "; resolve \"fp8\" first with formats.resolve_kv_cache_dtype" if name == "fp8" else ""
        raise ValueError(f"scales need a canonical kv-cache-dtype, got {name!r}; valid: {valid}{hint}")


def ones(num_layers: int, fmt_name: str) -> KVScales:
    k = [torch.ones(1, dtype=torch.float32) for _ in range(num_layers)]
    v = [torch.ones(1, dtype=torch.float32) for _ in range(num_layers)]
    return KVScales(k, v, fmt_name, "default 1.0")


def compute_scales(k_amax: list[torch.Tensor], v_amax: list[torch.Tensor], fmt_name: str,
                   granularity: str) -> KVScales:
    """Scales that map each layer's absolute maximum (per KV head) onto the format's largest value."""
    fmt = formats.FP8_FORMATS.get(fmt_name)
    if fmt is None:
        raise ValueError(f"cannot compute scales for kv-cache-dtype {fmt_name!r}; need one of "
                         f"{', '.join(formats.FP8_FORMATS)}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown scale granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")
    if len(k_amax) != len(v_amax):
        raise ValueError(f"compute_scales needs as many K as V layers, got {len(k_amax)} and {len(v_amax)}")

    def scale(kind: str, layer: int, amax: torch.Tensor) -> torch.Tensor:
        a = amax.detach().to(torch.float32).reshape(-1)
        if not bool(torch.isfinite(a).all()) or bool((a < 0).any()):
            raise ValueError(f"{kind} absolute maximum of layer {layer} is not a finite non-negative "
                             f"number: {a.tolist()}")
        if granularity == "tensor":
            a = a.max().reshape(1)
        return torch.clamp(a / fmt.max, min=MIN_SCALE)

    k = [scale("K", i, a) for i, a in enumerate(k_amax)]
    v = [scale("V", i, a) for i, a in enumerate(v_amax)]
    return KVScales(k, v, fmt_name, "calculated from the first batch")
