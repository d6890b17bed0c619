"""FP8 formats, the kv-cache-dtype strings users pass (docs/design.md section 2) and the format codes the ops take.

This is the one alias table: a string is resolved here, once, to a canonical name and a CacheFormat code; the
compiled ops only ever see the code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from fp8cache.kvcache.dtype_names import AUTO, BACKENDS, KV_CACHE_DTYPES


@dataclass(frozen=True)
class Fp8Format:
    """One 8-bit float encoding as stored in the cache (as uint8)."""

    name: str  # canonical kv-cache-dtype string
    torch_dtype: torch.dtype
    scale_file_dtype: str  # how scale files name it ("float8_e4m3fn", ...)
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float  # largest finite magnitude; quantization saturates here
    nan_codes: tuple[int, ...]
    has_inf: bool
    has_negative_zero: bool
    backends: frozenset[str]


FP8_FORMATS: dict[str, Fp8Format] = {
    "fp8_e4m3": Fp8Format(
        "fp8_e4m3", torch.float8_e4m3fn, "float8_e4m3fn", 4, 3, 7, 448.0, (0x7F, 0xFF),
        has_inf=False, has_negative_zero=True, backends=frozenset(BACKENDS)),
    "fp8_e5m2": Fp8Format(
        "fp8_e5m2", torch.float8_e5m2, "float8_e5m2", 5, 2, 15, 57344.0,
        tuple(range(0x7D, 0x80)) + tuple(range(0xFD, 0x100)),
        has_inf=True, has_negative_zero=True, backends=frozenset(BACKENDS)),
    "fp8_e4m3fnuz": Fp8Format(
        "fp8_e4m3fnuz", torch.float8_e4m3fnuz, "float8_e4m3fnuz", 4, 3, 8, 240.0, (0x80,),
        has_inf=False, has_negative_zero=False, backends=frozenset(BACKENDS)),
}

# What plain "fp8" means on each backend: the format its hardware converts natively.
DEFAULT_FP8 = {"cpu": "fp8_e4m3", "cuda": "fp8_e4m3", "rocm": "fp8_e4m3fnuz"}


class KVCacheDtypeError(ValueError):
    pass


class CacheFormat(enum.IntEnum):
    """The `int kv_cache_format` of the compiled ops: csrc/common/cache_format.h's KVFormat, same names and
    values (tests/kvcache/test_formats.py parses the header to hold them equal)."""

    AUTO = 0
    E4M3FN = 1
    E5M2 = 2
    E4M3FNUZ = 3


# canonical name <-> code
FORMAT_CODES = {AUTO: CacheFormat.AUTO, "fp8_e4m3": CacheFormat.E4M3FN, "fp8_e5m2": CacheFormat.E5M2,
                "fp8_e4m3fnuz": CacheFormat.E4M3FNUZ}
_CODE_NAMES = {code: name for name, code in FORMAT_CODES.items()}


def backend_of(device: torch.device | str | None = None) -> str:
    """The kernel backend that serves `device`: cpu, cuda or rocm (any other device stands in for a GPU)."""
    from fp8cache.platform.device import kernel_backend, resolve_device

    return kernel_backend(resolve_device(device or "cpu") if device is None or isinstance(device, str) else device)


def resolve_kv_cache_dtype(name: str, backend: str = "cpu") -> str:
    """Canonical name ("auto" or a key of FP8_FORMATS) for a user's kv-cache-dtype string."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise KVCacheDtypeError(
            f"unknown kv-cache-dtype {name!r}; valid choices are: {', '.join(KV_CACHE_DTYPES)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    canonical = DEFAULT_FP8[backend] if name == "fp8" else name
    if canonical != AUTO and backend not in FP8_FORMATS[canonical].backends:
        supported = [n for n, f in FP8_FORMATS.items() if backend in f.backends]
        raise KVCacheDtypeError(
            f"kv-cache-dtype {name!r} is not supported on {backend}; choose one of: auto, fp8, "
            + ", ".join(supported))
    return canonical


def format_code(name: str | int, backend: str = "cpu") -> CacheFormat:
    """The ops' code for a kv-cache-dtype string on `backend` ("fp8" is the backend's native format), or for a
    code already resolved (returned as a CacheFormat; an int that names none raises)."""
    if isinstance(name, str):
        return FORMAT_CODES[resolve_kv_cache_dtype(name, backend)]
    if isinstance(name, bool) or not isinstance(name, int) or name not in _CODE_NAMES:
        raise KVCacheDtypeError(f"unknown kv cache format code {name!r}; valid: "
                                + ", ".join(f"{int(c)} ({n})" for c, n in _CODE_NAMES.items()))
    return CacheFormat(name)


def format_name(code: str | int, backend: str = "cpu") -> str:
    """The canonical kv-cache-dtype name ("auto", "fp8_e4m3", ...) of a code or a string."""
    return _CODE_NAMES[format_code(code, backend)]


def is_fp8(name: str | int) -> bool:
    return name != AUTO and name != CacheFormat.AUTO


def get_format(name: str | int, backend: str = "cpu") -> Fp8Format | None:
    """The FP8 format behind a kv-cache-dtype string or a format code, None for "auto"."""
    canonical = format_name(name, backend)
    return None if canonical == AUTO else FP8_FORMATS[canonical]


def format_for_scale_file_dtype(dtype_name: str) -> Fp8Format:
    for fmt in FP8_FORMATS.values():
        if fmt.scale_file_dtype == dtype_name:
            return fmt
    valid = ", ".join(f.scale_file_dtype for f in FP8_FORMATS.values())
    raise KVCacheDtypeError(f"unknown FP8 dtype {dtype_name!r}; valid: {valid}")


def cache_storage_dtype(name: str | int, model_dtype: torch.dtype, backend: str = "cpu") -> torch.dtype:
    """Element type of the cache tensors: uint8 for FP8 formats, the model dtype for auto."""
    return model_dtype if format_code(name, backend) == CacheFormat.AUTO else torch.uint8


def bytes_per_element(name: str | int, model_dtype: torch.dtype, backend: str = "cpu") -> int:
    return torch.empty((), dtype=cache_storage_dtype(name, model_dtype, backend)).element_size()
