"""KV scales from files and checkpoints: the scales file (vLLM/aphrodite's schema plus fp8kv's keys), the
names each quantization tool gives KV scales in a checkpoint, and the precedence between them (docs/design.md
section 3). Every reader takes the model's shape (layers, KV heads) as arguments: nothing here loads a model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from fp8cache.jsonkind import json_kind
from fp8cache.kvcache import formats
from fp8cache.kvcache.scales import (
    E4M3_SCALE_UNIT,
    MAX_SCALE,
    MAX_SCALE_F32,
    MIN_SCALE,
    MIN_SCALE_F32,
    ROTATIONS,
    CheckpointScalesError,
    KVScales,
    ScalesFileError,
    check_canonical,
    head_range,
    ones,
)

logger = logging.getLogger(__name__)

# Far above any real scales file (128 layers x 128 heads x 3 tables is ~1.2 MB), far below what a
# mistaken path (a log, a model file, /dev/zero) could cost to read.
MAX_SCALES_FILE_BYTES = 16 * 2**20
_FLAGS_FIX = "--quantization-param-path or --calculate-kv-scales"


# ---------------------------------------------------------------------------------------------------
# Scale files (vLLM/aphrodite schema + fp8kv's k_/v_scaling_factor and kv_rotation)
#
# A rotated file ("kv_rotation": "hadamard") keeps the vLLM schema valid for readers that ignore the key:
# `scaling_factor` holds the scale of the UNROTATED K/V, which is what they will quantize; the scales of
# the rotated K/V, which fp8kv uses, are in k_scaling_factor and v_scaling_factor, required in such a file.

_TABLES = ("scaling_factor", "k_scaling_factor", "v_scaling_factor")


def load_scales_file(path: str | os.PathLike, num_layers: int | None, num_kv_heads: int | None,
                     kv_cache_dtype: str, tp_rank: int = 0, tp_size: int = 1,
                     warn: Callable[[str], None] = logger.warning) -> KVScales:
    """Scales for this rank from a JSON file, converted to the cache format `kv_cache_dtype`.

    The file's kv_cache.dtype must be that format, or E4M3FN for E4M3FNUZ and back (scales x2 / /2): E4M3
    scales on an E5M2 cache (or the reverse) misplace every value on the grid. A file without a dtype is
    taken as made for `kv_cache_dtype`, with a warning showing what its scales' range means there.
    num_layers / num_kv_heads None (the model is not known yet): the file is checked for itself, its tables
    against each other."""
    check_canonical(kv_cache_dtype)
    if num_kv_heads is not None:
        head_range(num_kv_heads, tp_rank, tp_size)  # rejects impossible splits before reading the file
    doc = _read_json(path)
    kv = doc.get("kv_cache")
    if not isinstance(kv, dict):
        problem = "is missing" if kv is None else f"must be an object, not {json_kind(kv)}"
        raise ScalesFileError(path, "kv_cache", problem)
    fmt = _file_format(path, kv, kv_cache_dtype)
    rotation = _file_rotation(path, doc)
    present = [name for name in _TABLES if name in kv]
    if "scaling_factor" not in present and not {"k_scaling_factor", "v_scaling_factor"} <= set(present):
        raise ScalesFileError(path, "kv_cache.scaling_factor", "is missing",
                              "add {\"<tp_rank>\": {\"<layer>\": scale}}, or both k_scaling_factor "
                              "and v_scaling_factor")
    if rotation != "none" and not {"k_scaling_factor", "v_scaling_factor"} <= set(present):
        missing = next(name for name in ("k_scaling_factor", "v_scaling_factor") if name not in present)
        raise ScalesFileError(path, f"kv_cache.{missing}", f"is missing, and a file with kv_rotation {rotation!r} "
                              "needs it: its scaling_factor holds the scales of unrotated K/V (for plain vLLM "
                              "readers), not of the rotated K/V the cache stores",
                              f"make the file again with `fp8kv calibrate --kv-rotation {rotation}`")
    tables = {name: _read_table(path, name, kv[name], num_layers, num_kv_heads, tp_rank, tp_size)
              for name in present}
    counts = {name: len(t) for name, t in tables.items()}
    if len(set(counts.values())) > 1:
        first, *others = counts
        other = next(n for n in others if counts[n] != counts[first])
        raise ScalesFileError(path, f"kv_cache.{other}", f"has {counts[other]} layers, kv_cache.{first} "
                              f"{counts[first]}", "give every table one entry per layer of the model")
    k = tables.get("k_scaling_factor") or tables["scaling_factor"]
    v = tables.get("v_scaling_factor") or tables["scaling_factor"]
    unrotated = None
    if rotation != "none" and "scaling_factor" in tables:
        unrotated = [float(t.max()) for t in tables["scaling_factor"]]
    window = doc.get("kv_recent_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 0):
        raise ScalesFileError(path, "kv_recent_window", f"must be a whole number of tokens >= 0, not {window!r}",
                              "fix it, or drop the key to use fp8kv's default")
    scales = KVScales(k, v, fmt.name, f"file {path}", rotation, unrotated, window)
    if "dtype" not in kv:
        warn(_undeclared_dtype_warning(path, scales, fmt))
    return scales if kv_cache_dtype == formats.AUTO else scales.for_format(kv_cache_dtype)


def _undeclared_dtype_warning(path: str | os.PathLike, scales: KVScales, fmt: formats.Fp8Format) -> str:
    values = torch.cat([t.reshape(-1) for t in scales.k + scales.v])
    low, high = float(values.min()), float(values.max())
    return (f"scales file {path} does not say which FP8 format its scales were made for (no kv_cache.dtype); "
            f"they are used as {fmt.name} scales. They range from {low:.3g} to {high:.3g}, so the cache holds "
            f"|K|, |V| up to {low * fmt.max:.3g}..{high * fmt.max:.3g} ({fmt.name} max {fmt.max:g}): if that "
            "is far from this model's K/V, the file is for another format. Add \"dtype\": "
            f"\"{fmt.scale_file_dtype}\" (or the right one) to its kv_cache, or make it with `fp8kv calibrate`")




def _read_json(path: str | os.PathLike) -> dict:
    remake = "fix the file or make it again with `fp8kv calibrate`"
    data = _read_bounded(path)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and ints past Python's digit limit
        raise ScalesFileError(path, "", f"not valid JSON ({e})", remake) from None
    except RecursionError:
        raise ScalesFileError(path, "", "not valid scales JSON (nested too deeply to read)", remake) from None
    if not isinstance(doc, dict):
        raise ScalesFileError(path, "", f"the top level must be a JSON object, not {json_kind(doc)}")
    return doc


def _read_bounded(path: str | os.PathLike) -> bytes:
    """The file's bytes, refusing what is not a regular file or is larger than MAX_SCALES_FILE_BYTES.

    O_NONBLOCK: opening a FIFO must not wait for a writer; fstat on the open file then refuses it (and a
    device such as /dev/zero, endless to read), with no gap between the check and the read."""
    fix = "give --quantization-param-path a JSON file made by `fp8kv calibrate`"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ScalesFileError(path, "", "the file does not exist",
                              "check --quantization-param-path, or make one with `fp8kv calibrate`") from None
    except OSError as e:
        raise ScalesFileError(path, "", f"cannot be opened ({e.strerror})", fix) from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket")
            raise ScalesFileError(path, "", f"is {kind}, not a regular file", fix)
        data = f.read(MAX_SCALES_FILE_BYTES + 1)
    if len(data) > MAX_SCALES_FILE_BYTES:
        raise ScalesFileError(path, "", f"is larger than {MAX_SCALES_FILE_BYTES // 2**20} MiB, far more than "
                              "scales take (a few KB to 2 MB)", fix)
    return data


def _file_format(path: str | os.PathLike, kv: dict, kv_cache_dtype: str) -> formats.Fp8Format:
    """The format the file's scales are for, refusing one the cache format cannot use."""
    valid = ", ".join(f.scale_file_dtype for f in formats.FP8_FORMATS.values())
    if "dtype" not in kv:
        # vLLM-style files written by hand may leave it out: taken as the cache's format, with a warning.
        return formats.FP8_FORMATS.get(kv_cache_dtype, formats.FP8_FORMATS["fp8_e4m3"])
    try:
        fmt = formats.format_for_scale_file_dtype(kv["dtype"])
    except (formats.KVCacheDtypeError, TypeError):
        raise ScalesFileError(path, "kv_cache.dtype", f"unknown dtype {_preview(kv['dtype'])}",
                              f"use one of: {valid}") from None
    if kv_cache_dtype == formats.AUTO or _convertible(fmt.name, kv_cache_dtype):
        return fmt
    cache = formats.FP8_FORMATS[kv_cache_dtype]
    raise ScalesFileError(path, "kv_cache.dtype", f"the scales were made for {fmt.scale_file_dtype}, but the "
                          f"cache stores {cache.scale_file_dtype} (--kv-cache-dtype {kv_cache_dtype}); they do "
                          "not carry over between these formats",
                          f"serve with --kv-cache-dtype {fmt.name}, or make scales for this cache with "
                          f"`fp8kv calibrate --kv-cache-dtype {kv_cache_dtype}`")


def _convertible(made_for: str, cache: str) -> bool:
    """Whether scales made for one format serve another: the same, or E4M3FN <-> E4M3FNUZ (x2 or /2)."""
    return made_for == cache or (made_for in E4M3_SCALE_UNIT and cache in E4M3_SCALE_UNIT)


def _file_rotation(path: str | os.PathLike, doc: dict) -> str:
    rotation = doc.get("kv_rotation", "none")
    if rotation not in ROTATIONS:
        raise ScalesFileError(path, "kv_rotation", f"unknown rotation {rotation!r}",
                              f"use one of: {', '.join(ROTATIONS)}")
    return rotation


def _int_keys(path: str | os.PathLike, key: str, table: object, what: str) -> dict[int, object]:
    if not isinstance(table, dict) or not table:
        raise ScalesFileError(path, key, f"must be a non-empty object of {what} -> ..., not {_preview(table)}")
    out = {}
    for name, value in table.items():
        if not re.fullmatch(r"0|[1-9][0-9]*", name):
            raise ScalesFileError(path, f"{key}.{name}", f"{what} keys must be integers \"0\", \"1\", ...")
        out[int(name)] = value
    missing = sorted(set(range(len(out))) - set(out))
    if missing:
        raise ScalesFileError(path, f"{key}.{missing[0]}", f"is missing ({what}s must run 0..{len(out) - 1})")
    return out


def _read_table(path: str | os.PathLike, name: str, table: object, num_layers: int | None,
                num_kv_heads: int | None, tp_rank: int, tp_size: int) -> list[torch.Tensor]:
    """One scaling_factor table -> this rank's per-layer float32 tensors."""
    key = f"kv_cache.{name}"
    ranks = _int_keys(path, key, table, "tp rank")
    if len(ranks) not in (1, tp_size):
        raise ScalesFileError(path, key, f"the file has scales for {len(ranks)} tensor-parallel ranks, "
                              f"the engine runs {tp_size}",
                              f"make scales with tensor-parallel size {tp_size}, or keep only rank \"0\", "
                              "which every rank then shares")
    shared = len(ranks) == 1
    rank = 0 if shared else tp_rank
    key = f"{key}.{rank}"
    layers = _int_keys(path, key, ranks[rank], "layer")
    if num_layers is not None and len(layers) != num_layers:
        raise ScalesFileError(path, key, f"the file has {len(layers)} layers, the model {num_layers}",
                              "make scales for this model with `fp8kv calibrate`")
    if num_kv_heads is None:  # model not known yet: any per-head list length
        return [_read_scale(path, f"{key}.{i}", layers[i], None, "") for i in range(len(layers))]
    start, stop = (0, num_kv_heads) if shared else head_range(num_kv_heads, tp_rank, tp_size)
    heads = f"{stop - start} KV heads" + ("" if shared else f" on tp rank {rank}")
    tensors = [_read_scale(path, f"{key}.{i}", layers[i], stop - start, heads) for i in range(len(layers))]
    if shared and tp_size > 1:
        tensors = [t if t.numel() == 1 else t[slice(*head_range(num_kv_heads, tp_rank, tp_size))].clone()
                   for t in tensors]
    return tensors


def _read_scale(path: str | os.PathLike, key: str, value: object, num_heads: int | None,
                heads: str) -> torch.Tensor:
    if isinstance(value, list):
        if num_heads is None and not value:
            raise ScalesFileError(path, key, "an empty per-head list", "give one scale or one per KV head")
        if num_heads is not None and len(value) != num_heads:
            raise ScalesFileError(path, key, f"a per-head list of {len(value)} scales, the model has {heads}",
                                  f"give one scale or a list of {num_heads}")
        return torch.tensor([_scale_value(path, f"{key}[{i}]", x) for i, x in enumerate(value)],
                            dtype=torch.float32)
    return torch.tensor([_scale_value(path, key, value)], dtype=torch.float32)


def _scale_value(path: str | os.PathLike, key: str, value: object) -> float:
    fix = "scales must be positive finite numbers; make them again with `fp8kv calibrate`"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScalesFileError(path, key, f"{_preview(value)} is not a number", fix)
    try:
        as_f32 = float(torch.tensor(float(value), dtype=torch.float32))
    except OverflowError:  # an int beyond float64
        as_f32 = math.inf
    if not math.isfinite(as_f32) or as_f32 <= 0:
        raise ScalesFileError(path, key, f"{_preview(value)} is not a positive finite float32 number", fix)
    if not MIN_SCALE_F32 <= as_f32 <= MAX_SCALE_F32:
        raise ScalesFileError(path, key, f"{value!r} is outside [{MIN_SCALE:g}, {MAX_SCALE:g}], where a scale "
                              "stores nothing useful: every K/V would saturate (too small) or round to zero "
                              "(too large)", "make the scales again with `fp8kv calibrate`; scales of real "
                              "models lie far inside this range")
    return as_f32


def _preview(value: object) -> str:
    # repr of a huge int or deep list costs time and recursion; a bounded repr names it just as well.
    import reprlib

    return reprlib.repr(value)[:40]


def write_scales_file(path: str | os.PathLike, scales: KVScales, model_type: str, num_kv_heads: int) -> None:
    """Write `scales` atomically in the vLLM schema that plain vLLM/aphrodite readers also accept.

    Rotated scales need `scales.unrotated_scales`: they become the plain `scaling_factor`, since readers that
    know no rotation apply it to unrotated K/V (fp8cache.quality.calibrate measures them)."""
    fmt = formats.FP8_FORMATS.get(scales.fmt_name)
    if fmt is None:
        raise ValueError(f"cannot write scales for kv-cache-dtype {scales.fmt_name!r}: need one of "
                         f"{', '.join(formats.FP8_FORMATS)}")
    for kind, tensors in (("k", scales.k), ("v", scales.v)):
        for i, t in enumerate(tensors):
            if t.numel() not in (1, num_kv_heads):
                raise ValueError(f"{kind} scale of layer {i} has {t.numel()} values; expected 1 or "
                                 f"num_kv_heads={num_kv_heads}")
            if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                raise ValueError(f"{kind} scale of layer {i} is not positive and finite: {t.tolist()}")

    def values(t: torch.Tensor) -> float | list[float]:
        t = t.detach().to("cpu", torch.float32)
        return float(t) if t.numel() == 1 else [float(x) for x in t]

    if scales.rotation == "none":
        # Plain readers use one scale for K and V: the largest never saturates what either side stored.
        combined = {str(i): max(float(k.max()), float(v.max())) for i, (k, v) in enumerate(zip(scales.k, scales.v))}
    elif scales.unrotated_scales is None:
        raise ValueError(f"scales with kv rotation {scales.rotation!r} need unrotated_scales (one scale per "
                         "layer for the unrotated K/V) to write the plain vLLM scaling_factor, which readers "
                         "that know no rotation apply to unrotated K/V; calibrate them with "
                         f"`fp8kv calibrate --kv-rotation {scales.rotation}`")
    else:
        combined = {str(i): float(s) for i, s in enumerate(scales.unrotated_scales)}
    kv_cache = {
        "dtype": fmt.scale_file_dtype,
        "scaling_factor": {"0": combined},
        "k_scaling_factor": {"0": {str(i): values(t) for i, t in enumerate(scales.k)}},
        "v_scaling_factor": {"0": {str(i): values(t) for i, t in enumerate(scales.v)}},
    }
    doc: dict[str, object] = {"model_type": model_type, "kv_cache": kv_cache}
    if scales.rotation != "none":
        doc["kv_rotation"] = scales.rotation
    if scales.recent_window is not None:
        doc["kv_recent_window"] = scales.recent_window
    _write_atomically(path, json.dumps(doc, indent=2) + "\n")


def _write_atomically(path: str | os.PathLike, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".scales-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------------------------------
# Checkpoint scales
#
# The names each tool writes, after "layers.<i>.self_attn." (docs/design.md section 3). vLLM's loader
# (maybe_remap_kv_scale_name, the compressed-tensors and Quark cache-scale mappers) reads the same set.

# suffix -> which of K/V it scales
_CHECKPOINT_SUFFIXES = {
    "kv_scale": "kv",  # TGI, AutoFP8: one scale for K and V
    "k_scale": "k", "v_scale": "v",  # llm-compressor / compressed-tensors kv_cache_scheme, vLLM
    "attn.k_scale": "k", "attn.v_scale": "v",  # vLLM's own saved layout
    "k_proj.output_scale": "k", "v_proj.output_scale": "v",  # AMD Quark, older compressed-tensors
    "k_proj.k_scale": "k", "v_proj.v_scale": "v",  # NVIDIA ModelOpt
}
_CHECKPOINT_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.("
                              + "|".join(re.escape(s) for s in _CHECKPOINT_SUFFIXES) + r")$")
# Zero points beside KV scales (compressed-tensors registers them even for symmetric schemes): all zeros
# means symmetric, which is what the cache does; anything else is an asymmetric scheme fp8kv cannot run.
_ZERO_POINT_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?(k|v)_zero_point$")
# Attention tensors the tools write that fp8kv has no use for: fp8kv quantizes K and V only, never Q or the
# attention probabilities. They are reported, never read silently as something else.
_UNUSED_ATTENTION_SCALE = re.compile(r"(?:^|\.)self_attn\.(?:(?:attn\.)?q_scale|q_proj\.output_scale|"
                                     r"(?:attn\.)?prob_scale|prob_output_scale|(?:attn\.)?q_zero_point)$")
_CHECKPOINT_FIX = ("export the checkpoint's KV scales again, or pass --quantization-param-path with a scales "
                   "file (it wins over checkpoint scales)")
# Spellings of a scheme's format in the tools' configs -> canonical kv-cache-dtype.
_E4M3_NAMES = {"fp8", "fp8_e4m3", "fp8_e4m3fn", "float8_e4m3fn", "e4m3", "e4m3fn"}


@dataclass(frozen=True)
class CheckpointKVScheme:
    """What a checkpoint's quantization config says about its KV cache."""

    tool: str  # "compressed-tensors", "ModelOpt", "Quark"
    fmt_name: str  # canonical kv-cache-dtype the scales are for
    granularity: str | None  # "tensor" | "head"; None: not said
    dynamic: bool  # scales computed at run time, none stored

    def describe(self) -> str:
        how = "dynamic" if self.dynamic else {"tensor": "per tensor", "head": "per KV head"}.get(
            self.granularity or "", "static")
        return f"{self.tool} KV cache scheme, {how}"


class CheckpointSchemeError(CheckpointScalesError):
    """A quantization config whose KV cache scheme fp8kv cannot run."""


def checkpoint_scale_tensor_names(names: Iterable[str]) -> list[str]:
    """The tensor names among `names` that hold KV cache scales."""
    return [n for n in names if _CHECKPOINT_NAME.search(n)]


def is_kv_zero_point(name: str) -> bool:
    return bool(_ZERO_POINT_NAME.search(name))


def is_unused_attention_scale(name: str) -> bool:
    """A Q or attention-probability scale (or zero point), which fp8kv has no use for."""
    return bool(_UNUSED_ATTENTION_SCALE.search(name))


def check_kv_zero_points(tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse K/V zero points that are not all zero (an asymmetric scheme)."""
    for name, t in tensors.items():
        if is_kv_zero_point(name) and bool((t.detach().to("cpu", torch.float32) != 0).any()):
            raise CheckpointScalesError(f"checkpoint tensor {name} holds non-zero K/V zero points: an asymmetric "
                                        "KV cache scheme, which fp8kv cannot run (its FP8 cache is symmetric); "
                                        "export the KV scales with symmetric: true")


def checkpoint_kv_scheme(config: Mapping | None) -> CheckpointKVScheme | None:
    """The KV cache scheme declared by a checkpoint's config.json (compressed-tensors kv_cache_scheme,
    ModelOpt kv_cache_quant_algo, Quark kv_cache_group); None when it declares none. An unknown or
    unsupported scheme raises CheckpointSchemeError, naming the key and what fp8kv reads."""
    quant = (config or {}).get("quantization_config")
    if not isinstance(quant, Mapping):
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors_kv(quant.get("kv_cache_scheme"))
    if method == "modelopt":
        inner = quant.get("quantization") if isinstance(quant.get("quantization"), Mapping) else quant
        return _modelopt_kv(inner.get("kv_cache_quant_algo"))
    if method == "quark":
        return _quark_kv(quant)
    return None


def _scheme_error(key: str, problem: str, reads: str) -> CheckpointSchemeError:
    return CheckpointSchemeError(
        f"config.json quantization_config.{key}: {problem}; fp8kv reads {reads}. Remove that key to run the "
        "model without its KV scheme (then --kv-cache-dtype fp8 with --calculate-kv-scales or a scales file)")


_CT_READS = ("FP8 KV cache schemes (type float, num_bits 8, symmetric) with strategy tensor or attn_head, "
             "static (k_scale/v_scale tensors) or dynamic: true")


def _compressed_tensors_kv(scheme: object) -> CheckpointKVScheme | None:
    if scheme is None:
        return None
    if not isinstance(scheme, Mapping):
        raise _scheme_error("kv_cache_scheme", f"{_preview(scheme)} is not an object", _CT_READS)
    kind = str(scheme.get("type", "int")).lower()  # compressed-tensors' default type is int
    bits = scheme.get("num_bits", 8)
    if kind != "float" or bits != 8:
        raise _scheme_error("kv_cache_scheme", f"type {kind} with num_bits {bits} is not an FP8 cache", _CT_READS)
    if scheme.get("symmetric", True) is not True:
        raise _scheme_error("kv_cache_scheme", "symmetric: false (zero points) is not supported", _CT_READS)
    strategy = scheme.get("strategy") or "tensor"
    granularity = {"tensor": "tensor", "attn_head": "head"}.get(str(strategy).lower())
    if granularity is None or scheme.get("group_size") or scheme.get("block_structure"):
        raise _scheme_error("kv_cache_scheme", f"strategy {strategy!r} is not supported", _CT_READS)
    dynamic = scheme.get("dynamic", False)
    if dynamic not in (True, False):
        raise _scheme_error("kv_cache_scheme", f"dynamic: {_preview(dynamic)} is not supported", _CT_READS)
    return CheckpointKVScheme("compressed-tensors", "fp8_e4m3", granularity, bool(dynamic))


def _modelopt_kv(algo: object) -> CheckpointKVScheme | None:
    if algo is None:
        return None
    if str(algo).upper() != "FP8":
        raise _scheme_error("kv_cache_quant_algo", f"{_preview(algo)} is not supported",
                            "kv_cache_quant_algo FP8 (per-tensor k_proj.k_scale / v_proj.v_scale)")
    return CheckpointKVScheme("ModelOpt", "fp8_e4m3", "tensor", False)


def _quark_kv(quant: Mapping) -> CheckpointKVScheme | None:
    export = quant.get("export") if isinstance(quant.get("export"), Mapping) else {}
    groups = export.get("kv_cache_group") or quant.get("kv_cache_group") or []
    if not groups:
        return None
    import fnmatch

    reads = "Quark KV caches of dtype fp8_e4m3 with qscheme per_tensor (k_proj/v_proj output_scale)"
    layers = quant.get("layer_quant_config") if isinstance(quant.get("layer_quant_config"), Mapping) else {}
    specs = [cfg.get("output_tensors") for name, cfg in layers.items() if isinstance(cfg, Mapping)
             and any(fnmatch.fnmatchcase(name, pattern) for pattern in groups)]
    if not specs or not all(isinstance(s, Mapping) for s in specs):
        raise _scheme_error("export.kv_cache_group", f"names {list(groups)} but layer_quant_config has no "
                            "output_tensors for them", reads)
    for spec in specs:
        if str(spec.get("dtype", "")).lower() not in _E4M3_NAMES or spec.get("qscheme") != "per_tensor":
            raise _scheme_error("layer_quant_config", f"KV output_tensors dtype {spec.get('dtype')!r}, qscheme "
                                f"{spec.get('qscheme')!r} are not supported", reads)
    return CheckpointKVScheme("Quark", "fp8_e4m3", "tensor", any(bool(s.get("is_dynamic")) for s in specs))


def scales_from_checkpoint(tensors: Mapping[str, torch.Tensor], num_layers: int, num_kv_heads: int,
                           config: dict | None, kv_cache_dtype: str) -> KVScales | None:
    """KV scales stored in a checkpoint's tensors (full model, all heads); None when it has none.

    Per-head scales may be stored as [heads] or, as compressed-tensors' attn_head strategy writes them,
    [heads, 1, 1]; one scale as [], [1] or [1, 1, 1]."""
    check_canonical(kv_cache_dtype)
    check_kv_zero_points(tensors)
    found: dict[tuple[int, str], list[tuple[str, torch.Tensor]]] = {}
    for name in checkpoint_scale_tensor_names(tensors):
        match = _CHECKPOINT_NAME.search(name)
        layer = int(match.group(1))
        if layer >= num_layers:
            raise CheckpointScalesError(f"checkpoint tensor {name} names layer {layer}, but the model has "
                                        f"{num_layers} layers: {_CHECKPOINT_FIX}")
        value = _checkpoint_value(name, tensors[name], num_kv_heads)
        for kind in _CHECKPOINT_SUFFIXES[match.group(2)]:
            found.setdefault((layer, kind), []).append((name, value))
    if not found:
        return None
    missing = [f"{kind} of layer {i}" for i in range(num_layers) for kind in "kv" if (i, kind) not in found]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointScalesError(f"the checkpoint has KV cache scales for some layers only; missing: "
                                    f"{shown}: {_CHECKPOINT_FIX}")
    k = [_one_value(found[(i, "k")]) for i in range(num_layers)]
    v = [_one_value(found[(i, "v")]) for i in range(num_layers)]
    scheme = checkpoint_kv_scheme(config)
    made_for = _checkpoint_format(config, scheme)
    source = "checkpoint" if scheme is None else f"checkpoint ({scheme.describe()})"
    scales = KVScales(k, v, made_for.name, source)
    return scales if kv_cache_dtype == formats.AUTO else scales.for_format(kv_cache_dtype)


def _checkpoint_value(name: str, tensor: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    t = tensor.detach().to("cpu", torch.float32).reshape(-1)
    if t.numel() not in (1, num_kv_heads) or (t.numel() > 1 and tensor.dim() > 1
                                              and any(d != 1 for d in tensor.shape[1:])):
        raise CheckpointScalesError(f"checkpoint tensor {name} has shape {list(tensor.shape)}; a KV scale has 1 "
                                    f"value or one per KV head (num_kv_heads={num_kv_heads}: [{num_kv_heads}] or "
                                    f"[{num_kv_heads}, 1, 1]): {_CHECKPOINT_FIX}")
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise CheckpointScalesError(f"checkpoint tensor {name} holds {t.tolist()}; scales must be positive "
                                    f"finite numbers: {_CHECKPOINT_FIX}")
    return t.clone()


def _one_value(candidates: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    first_name, first = candidates[0]
    for name, other in candidates[1:]:
        if other.shape != first.shape or not torch.equal(other, first):
            raise CheckpointScalesError(f"checkpoint tensors {first_name} and {name} give different scales "
                                        f"for the same cache: {_CHECKPOINT_FIX}")
    return first


def _checkpoint_format(config: dict | None, scheme: CheckpointKVScheme | None = None) -> formats.Fp8Format:
    """The format the checkpoint's scales were calibrated for (E4M3FN unless config.json says)."""
    config = config or {}
    quant = config.get("quantization_config") or {}
    name = config.get("kv_cache_torch_dtype") or (quant.get("kv_cache_torch_dtype") if isinstance(quant, dict)
                                                  else None)
    if name is None:
        return formats.FP8_FORMATS[scheme.fmt_name if scheme is not None else "fp8_e4m3"]
    try:
        return formats.format_for_scale_file_dtype(str(name).removeprefix("torch."))
    except formats.KVCacheDtypeError as e:
        raise CheckpointScalesError(f"config.json kv_cache_torch_dtype: {e}") from None



# ---------------------------------------------------------------------------------------------------
# Precedence and computed scales

def resolve_scales(kv_cache_dtype: str, num_layers: int, num_kv_heads: int,
                   quantization_param_path: str | os.PathLike | None = None,
                   checkpoint_tensors: Mapping[str, torch.Tensor] | None = None, config: dict | None = None,
                   calculate: bool = False, tp_rank: int = 0, tp_size: int = 1,
                   warn: Callable[[str], None] = logger.warning) -> KVScales | None:
    """Scales by the precedence of docs/design.md section 3: file > checkpoint > calculate (None: caller computes) > 1.0."""
    check_canonical(kv_cache_dtype)
    if kv_cache_dtype == formats.AUTO:
        unused = ones(num_layers, formats.AUTO)
        unused.source = "unused (auto cache)"
        return unused
    has_checkpoint_scales = bool(checkpoint_tensors) and bool(checkpoint_scale_tensor_names(checkpoint_tensors))
    if quantization_param_path is not None:
        scales = load_scales_file(quantization_param_path, num_layers, num_kv_heads, kv_cache_dtype,
                                  tp_rank, tp_size, warn)
        if has_checkpoint_scales:
            warn(f"KV scales from {quantization_param_path} override the scales in the checkpoint")
        if calculate:
            warn(f"--calculate-kv-scales is ignored: KV scales come from {quantization_param_path}")
        return scales
    if has_checkpoint_scales:
        scales = scales_from_checkpoint(checkpoint_tensors, num_layers, num_kv_heads, config, kv_cache_dtype)
        if calculate:
            warn("--calculate-kv-scales is ignored: KV scales come from the checkpoint")
        return scales.shard(tp_rank, tp_size)
    scheme = checkpoint_kv_scheme(config)
    if scheme is not None and scheme.dynamic:
        return None  # the checkpoint asks for scales computed at run time: the caller computes them
    if calculate:
        return None
    if scheme is not None:
        raise CheckpointScalesError(f"config.json declares a static {scheme.describe()}, but the checkpoint holds "
                                    "no k_scale/v_scale tensors: export it again with its scales, or pass "
                                    f"{_FLAGS_FIX}")
    warn(f"kv-cache-dtype {kv_cache_dtype} runs with KV scales of 1.0, which may saturate or lose precision; "
         f"pass {_FLAGS_FIX} to use proper scales")
    return ones(num_layers, kv_cache_dtype)




def check_scales_file(path: str | os.PathLike, kv_cache_dtype: str, device: str | None,
                      num_layers: int | None, num_kv_heads: int | None, tp_size: int = 1) -> None:
    """Check a scales file before the model loads (seconds to minutes), so a bad file fails at once; raises
    ScalesFileError. num_layers / num_kv_heads None: not at hand (the file is checked for itself)."""
    name = kv_cache_dtype
    if name == "fp8":
        try:
            name = formats.resolve_kv_cache_dtype(name, formats.backend_of(device))
        except (RuntimeError, ValueError):
            return  # a device or dtype the engine cannot use: it says so itself, in its own words
    if name not in formats.FP8_FORMATS:
        return  # auto ignores the file (the runner says so); unknown names are the engine's to refuse
    if num_kv_heads is not None and _splits(num_kv_heads, tp_size):
        load_scales_file(path, num_layers, num_kv_heads, name, 0, tp_size, warn=lambda msg: None)
    else:
        load_scales_file(path, num_layers, None, name, warn=lambda msg: None)


def _splits(num_kv_heads: int, tp_size: int) -> bool:
    try:
        head_range(num_kv_heads, 0, max(tp_size, 1))
    except ValueError:
        return False  # the engine refuses the split with its own message
    return True
