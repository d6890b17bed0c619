"""KVCacheSpec: everything that decides what an engine's cache bytes are and mean, resolved once.

The runner builds one from the flags and the checkpoint (format, scales, rotation, recent-token window) and
hands it down: sizing plans and allocates from it, each step's forward context reads it, and its fingerprint
keys the prefix cache. Only calculated scales (calculate_kv_scales, after the first batch) change it, as a new
spec made with `with_scales`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from fp8cache.kvcache import dynamic_scales, formats, layout, scale_files
from fp8cache.kvcache import scales as kv_scales
from fp8cache.kvcache.rotation import NONE, rotation_matrix

PENDING_SOURCE = "pending: calculated from the first batch"
DYNAMIC_SOURCE = "dynamic: one per token and KV head, computed as the cache is written"


def check_gpu_head_size(head_size: int, fmt: formats.CacheFormat, model_dtype: torch.dtype, backend: str) -> None:
    """Refuse at start a head size the GPU attention kernels do not take (csrc/cuda/launch.h): multiples of 16 up
    to 256, and on CUDA multiples of 8 up to 128 with a 16-bit cache (the tensor-core kernel, sm_80+). The CPU
    kernels take any head size."""
    if backend == "cpu":
        return
    sixteen_bit = fmt == formats.CacheFormat.AUTO and model_dtype in (torch.bfloat16, torch.float16)
    if head_size <= 256 and head_size % 16 == 0:
        return
    if backend == "cuda" and sixteen_bit and head_size <= 128 and head_size % 8 == 0:
        return
    raise ValueError(f"head size {head_size} is not supported by the GPU attention kernels (multiples of 16 up to "
                     f"256, or of 8 up to 128 with a bfloat16/float16 auto cache on CUDA); serve this model on "
                     f"the CPU (--device cpu)")


@dataclass(frozen=True, eq=False)  # eq=False: fields hold tensors, which have no single truth value
class KVCacheSpec:
    kv_cache_dtype: str  # as the user gave it ("fp8", "auto", ...); `cache_dtype_name` is what it resolved to
    format: formats.CacheFormat  # the code the compiled ops take for every layer not in skip_layers
    model_dtype: torch.dtype
    block_size: int
    num_layers: int
    num_kv_heads: int  # this tensor-parallel rank's share
    head_size: int
    # Per layer, float32 [1] or [num_kv_heads], where the step reads them (CUDA graphs keep their addresses).
    k_scales: tuple[torch.Tensor, ...]
    v_scales: tuple[torch.Tensor, ...]
    scales_source: str
    scales: kv_scales.KVScales | None  # as resolved; None while calculated scales are pending
    rotation: str = NONE
    window_size: int = 0  # kv_recent_window: newest tokens per sequence also kept in window_dtype
    window_dtype: torch.dtype | None = None  # None: the model dtype
    backend: str = "cpu"
    # Dynamic scales (kvcache/dynamic_scales.py): per token and KV head, in scale caches beside the cache's codes;
    # k_scales and v_scales are then unused ones.
    dynamic_scales: bool = False
    # Layers whose cache is held in the model dtype (an auto cache) while the others are FP8 (vLLM's
    # --kv-cache-dtype-skip-layers); their scales, scale caches and saturation counts are unused.
    skip_layers: tuple[int, ...] = ()
    # kv_recent_window_sinks: the first tokens of each sequence (attention sinks) also in the window ring, seats
    # [0, window_sinks) before the window_size recent ones (0 without a window).
    window_sinks: int = 0

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; tuples keep a frozen spec from being changed in place.
        object.__setattr__(self, "k_scales", tuple(self.k_scales))
        object.__setattr__(self, "v_scales", tuple(self.v_scales))
        object.__setattr__(self, "format", formats.format_code(int(self.format)))
        skip = check_skip_layers(self.skip_layers, self.num_layers)
        object.__setattr__(self, "skip_layers", skip if self.format != formats.CacheFormat.AUTO else ())
        if self.window_dtype is None:
            object.__setattr__(self, "window_dtype", self.model_dtype)
        check_block_size(self.block_size)
        if self.dynamic_scales and not self.is_fp8:
            raise ValueError("dynamic KV scales need an FP8 kv-cache-dtype; an auto cache holds the values themselves")
        check_gpu_head_size(self.head_size, self.format, self.model_dtype, self.backend)
        if self.window_size < 0:
            raise ValueError(f"window_size={self.window_size} must be a whole number of tokens >= 0")
        if self.window_sinks < 0:
            raise ValueError(f"window_sinks={self.window_sinks} must be a whole number of tokens >= 0")
        if not self.window_size:
            object.__setattr__(self, "window_sinks", 0)  # sinks sit beside a recent window, never alone
        try:
            rotation_matrix(self.rotation, self.head_size)  # refuses head sizes it cannot rotate
        except ValueError as e:
            raise ValueError(f"KV scales from {self.scales_source}: {e}") from None
        for kind, tensors in (("k", self.k_scales), ("v", self.v_scales)):
            if len(tensors) != self.num_layers:
                raise ValueError(f"{len(tensors)} {kind} scales from {self.scales_source} for "
                                 f"{self.num_layers} layers")
            for i, t in enumerate(tensors):
                if t.numel() not in (1, self.num_kv_heads):
                    raise ValueError(f"{kind} scale of layer {i} from {self.scales_source} has {t.numel()} "
                                     f"values; expected 1 or num_kv_heads={self.num_kv_heads}")

    @classmethod
    def build(cls, kv_cache_dtype: str, model_dtype: torch.dtype, block_size: int, num_layers: int,
              num_kv_heads: int, head_size: int, scales: kv_scales.KVScales | None, window_size: int = 0,
              window_dtype: torch.dtype | None = None, backend: str = "cpu",
              device: torch.device | str = "cpu", cache_dtype_name: str | None = None, dynamic: bool = False,
              rotation: str = NONE, skip_layers: tuple[int, ...] = (), window_sinks: int = 0) -> KVCacheSpec:
        """The spec for a cache on `device`. scales None: an FP8 cache whose scales the first batch will
        calculate (placeholders of 1.0 until then); an auto cache gets unused ones. cache_dtype_name: kv_cache_dtype
        resolved for `backend` already (the runner resolves it once, before the model loads). dynamic: an FP8
        cache with dynamic scales (`scales` must be None), K/V rotated by `rotation` ("none", "hadamard").
        skip_layers: layers kept in the model dtype (ignored for an auto cache). window_sinks: each sequence's first
        tokens also kept in the window ring (ignored without a window)."""
        name = cache_dtype_name or formats.resolve_kv_cache_dtype(kv_cache_dtype, backend)
        if dynamic:
            if scales is not None:
                raise ValueError(f"dynamic KV scales replace static ones; got scales from {scales.source} too")
            scales = dataclasses.replace(kv_scales.ones(num_layers, name), source=DYNAMIC_SOURCE, rotation=rotation)
        if scales is None and name == formats.AUTO:
            scales = scale_files.resolve_scales(name, num_layers, num_kv_heads)
        ones = kv_scales.ones(num_layers, name)
        spec = cls(kv_cache_dtype, formats.FORMAT_CODES[name], model_dtype, block_size, num_layers, num_kv_heads,
                   head_size, tuple(ones.k), tuple(ones.v), PENDING_SOURCE, None, NONE, window_size,
                   window_dtype, backend, dynamic, tuple(skip_layers), window_sinks)
        return spec if scales is None else spec.with_scales(scales, device)

    def with_scales(self, scales: kv_scales.KVScales, device: torch.device | str = "cpu") -> KVCacheSpec:
        """This spec with `scales` (moved to `device`), their source and their rotation."""
        return dataclasses.replace(
            self, k_scales=tuple(t.to(device, torch.float32).contiguous() for t in scales.k),
            v_scales=tuple(t.to(device, torch.float32).contiguous() for t in scales.v),
            scales_source=scales.source, scales=scales, rotation=scales.rotation)

    @property
    def ring_seats(self) -> int:
        """Seats of one sequence's window ring: the sinks', then the recent window's (0 without a window)."""
        return self.window_sinks + self.window_size if self.window_size else 0

    @property
    def cache_dtype_name(self) -> str:
        """The canonical kv-cache-dtype ("auto", "fp8_e4m3", ...): "fp8" resolved for the backend."""
        return formats.format_name(self.format)

    @property
    def is_fp8(self) -> bool:
        """Whether any layer's cache is FP8."""
        return self.format != formats.CacheFormat.AUTO

    @functools.cached_property
    def layer_formats(self) -> tuple[formats.CacheFormat, ...]:
        """Per layer, the code the ops take: AUTO for skip_layers, `format` for the others."""
        skipped = set(self.skip_layers)
        return tuple(formats.CacheFormat.AUTO if i in skipped else self.format for i in range(self.num_layers))

    def layer_is_fp8(self, layer: int) -> bool:
        return self.layer_formats[layer] != formats.CacheFormat.AUTO

    @property
    def num_fp8_layers(self) -> int:
        return sum(map(self.layer_is_fp8, range(self.num_layers)))

    @property
    def fp8_format(self) -> formats.Fp8Format | None:
        return formats.get_format(self.format)

    @property
    def scales_pending(self) -> bool:
        """An FP8 cache waiting for the first batch to calculate its scales."""
        return self.is_fp8 and self.scales is None

    def storage_dtype(self, layer: int) -> torch.dtype:
        """Element type of a layer's cache tensors: uint8 codes for FP8, the model dtype for auto."""
        return formats.cache_storage_dtype(self.layer_formats[layer], self.model_dtype)

    def scale_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's K (or V) dynamic scale cache: bfloat16 [num_blocks, num_kv_heads, block_size]."""
        return (num_blocks, self.num_kv_heads, self.block_size)

    def allocate_scale_caches(self, num_blocks: int,
                              device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer (k_scale_cache, v_scale_cache) for dynamic scales, () for a skipped layer (the ops then get
        none); None for static ones."""
        if not self.dynamic_scales:
            return None
        return [dynamic_scales.allocate_scale_caches(num_blocks, self.block_size, self.num_kv_heads, device)
                if self.layer_is_fp8(i) else () for i in range(self.num_layers)]

    def cache_shapes(self, num_blocks: int, layer: int = 0,
                     window: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(key_cache, value_cache) shapes of a layer (kvcache.layout); window: the recent-token ring's."""
        x = layout.cache_x(self.window_dtype if window else self.storage_dtype(layer))
        return ((num_blocks, self.num_kv_heads, self.head_size // x, self.block_size, x),
                (num_blocks, self.num_kv_heads, self.head_size, self.block_size))

    @functools.cached_property
    def fingerprint(self) -> str:
        """What the cached bytes mean; prefix-cache hashes include it so changed scales never hit. Cached: the
        engine asks twice a step, and hashing every scale each time is measurable."""
        if not self.is_fp8:
            return f"auto:{self.model_dtype}"
        name = self.cache_dtype_name
        if self.skip_layers:  # those layers' blocks hold model-dtype values, not codes
            name += f":skip{','.join(map(str, self.skip_layers))}:{self.model_dtype}"
        if self.scales is None:
            return f"{name}:pending"
        if self.dynamic_scales:  # each block carries its own scales: nothing else decides what its bytes mean
            return f"{name}:dynamic:{self.rotation}"
        return f"{name}:{self.scales.fingerprint()}:{self.rotation}"


def check_skip_layers(skip_layers: tuple[int, ...] | list[int], num_layers: int) -> tuple[int, ...]:
    """The layer ids sorted, or a ValueError naming the model's layer count."""
    layers = tuple(skip_layers)
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
            raise ValueError(f"kv_cache_dtype_skip_layers names layer {i!r}, but the model has {num_layers} layers "
                             f"(0..{num_layers - 1}); give layer ids from that range")
    if len(set(layers)) != len(layers):
        raise ValueError(f"kv_cache_dtype_skip_layers={list(layers)} names a layer twice; give each once")
    return tuple(sorted(layers))


def check_block_size(block_size: int) -> None:
    """Refuse a block size that holds no token (the runner asks before it builds its spec)."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be a positive number of tokens (8, 16, 32)")
