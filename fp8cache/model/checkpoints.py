"""What a checkpoint carries besides plain weights, as each quantization tool writes it, read without the
tools' packages (docs/design.md section 3, "Bring your checkpoint" in README.md).

| tool | config.json `quantization_config` | tensors |
|---|---|---|
| llm-compressor / compressed-tensors | `quant_method: compressed-tensors`, `config_groups`, `kv_cache_scheme` | `*.weight` (float8) + `weight_scale`, `input_scale`; `self_attn.k_scale` / `v_scale` |
| NVIDIA ModelOpt | `quant_method: modelopt` (or `hf_quant_config.json`), `quant_algo`, `kv_cache_quant_algo` | `weight_scale`, `input_scale`; `k_proj.k_scale` / `v_proj.v_scale` |
| transformers `fp8` (FineGrainedFP8) | `quant_method: fp8`, `weight_block_size`, `activation_scheme` | `weight_scale_inv` per 128x128 block |
| AMD Quark | `quant_method: quark`, `global_quant_config`, `layer_quant_config`, `export.kv_cache_group` | `weight_scale`, `input_scale`; `k_proj.output_scale` / `v_proj.output_scale` |
| fbgemm | `quant_method: fbgemm_fp8` | per-channel `weight_scale` |
| TGI | `kv_cache_torch_dtype` | `self_attn.kv_scale` |

fp8kv reads these itself: transformers never sees a quantization config of these methods (it would need each
tool's package, and compressed-tensors would decompress on the first forward pass, after fp8kv replaced the
layers). Weights stored as float8 codes become real weights in model/fp8_weights.py; KV scales are read by
kvcache/scales.py. A scheme fp8kv cannot run (integer or 4-bit weights, sparsity, transforms) is refused at
start with one line naming the key.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fp8cache.kvcache import scale_files
from fp8cache.model import fp8_weights

# Methods whose config fp8kv reads itself (and hides from transformers).
OWN_METHODS = ("compressed-tensors", "modelopt", "fp8", "quark", "fbgemm_fp8")
_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_E4M3_NAMES = {"fp8_e4m3", "fp8_e4m3fn", "float8_e4m3fn", "e4m3"}
MODELOPT_FILE = "hf_quant_config.json"
# A tensor whose last name part is one of these holds quantization parameters, not a weight.
_SCALE_LIKE = re.compile(r"(?:^|\.)[^.]*(?:scale|scales|scale_inv|zero_point|amax|global_scale|g_idx)$")


class CheckpointFormatError(ValueError):
    """A checkpoint whose quantization fp8kv cannot run; the message names the key and the fix."""


@dataclass(frozen=True)
class WeightScheme:
    """How a checkpoint's FP8 linear weights were made and how their activations are meant to be quantized."""

    tool: str
    activations: str  # fp8_weights.ACTIVATIONS
    block: tuple[int, int] | None = None  # weight block size for block scales
    name: str = ""  # the tool's name for it (FP8_DYNAMIC, FP8, ...), for people

    def describe(self) -> str:
        acts = {"dynamic-token": "dynamic per-token activations", "dynamic-tensor": "dynamic per-tensor activations",
                "static-tensor": "static per-tensor activations", "none": "weight-only",
                "dynamic-group": "dynamic per-128 activations"}[self.activations]
        block = f", {self.block[0]}x{self.block[1]} blocks" if self.block else ""
        return f"{self.tool} {self.name}{block}, {acts}".replace("  ", " ")


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's quantization config as fp8kv understands it."""

    method: str | None = None  # quant_method as written; None: no quantization config
    weights: WeightScheme | None = None
    kv: scale_files.CheckpointKVScheme | None = None

    @property
    def own(self) -> bool:
        """fp8kv reads this config itself; transformers must not see it."""
        return self.method in OWN_METHODS


# ---- config.json ----------------------------------------------------------------------------------------

def read_config(folder: str) -> dict:
    """config.json, with a ModelOpt hf_quant_config.json (older exports keep it beside) folded in as its
    quantization_config when config.json has none."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    modelopt = os.path.join(folder, MODELOPT_FILE)
    if isinstance(config, dict) and "quantization_config" not in config and os.path.isfile(modelopt):
        try:
            with open(modelopt, encoding="utf-8") as f:
                extra = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointFormatError(f"{modelopt} is not readable JSON ({e})") from None
        quant = extra.get("quantization") if isinstance(extra, dict) else None
        if isinstance(quant, dict):
            config["quantization_config"] = {"quant_method": "modelopt", **quant}
    return config


def describe(config: Mapping) -> CheckpointQuant:
    """The quantization of a checkpoint from its config (read_config); raises CheckpointFormatError for one
    fp8kv cannot run, and CheckpointScalesError for an unsupported KV cache scheme."""
    quant = config.get("quantization_config")
    if quant is None:
        return CheckpointQuant()
    if not isinstance(quant, Mapping):
        raise CheckpointFormatError("config.json quantization_config is not an object; fix or remove it")
    method = str(quant.get("quant_method", "")).lower()
    kv = scale_files.checkpoint_kv_scheme(config)
    if method == "compressed-tensors":
        return CheckpointQuant(method, _compressed_tensors_weights(quant), kv)
    if method == "modelopt":
        return CheckpointQuant(method, _modelopt_weights(quant), kv)
    if method == "fp8":
        return CheckpointQuant(method, _transformers_fp8_weights(quant), kv)
    if method == "quark":
        return CheckpointQuant(method, _quark_weights(quant), kv)
    if method == "fbgemm_fp8":
        return CheckpointQuant(method, WeightScheme("fbgemm", "dynamic-token", name="FP8"), kv)
    return CheckpointQuant(method or None, None, kv)  # other methods stay transformers' (its own packages)


def _unsupported(key: str, problem: str, reads: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"config.json quantization_config.{key}: {problem}; fp8kv runs {reads}")


_CT_READS = ("compressed-tensors FP8 weights (FP8, FP8_DYNAMIC, FP8_BLOCK: type float, num_bits 8, strategy "
             "tensor, channel or block) and kv_cache_scheme; for other schemes use the unquantized model")


def _compressed_tensors_weights(quant: Mapping) -> WeightScheme | None:
    if quant.get("sparsity_config"):
        raise _unsupported("sparsity_config", "sparse weights are not supported", _CT_READS)
    if quant.get("transform_config"):
        raise _unsupported("transform_config", "weight transforms (rotations) are not supported", _CT_READS)
    fmt = quant.get("format")
    if fmt not in (None, "dense", "float-quantized", "naive-quantized"):
        raise _unsupported("format", f"{fmt!r} is not supported", _CT_READS)
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise _unsupported("config_groups", "is not an object", _CT_READS)
    schemes = set()
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            raise _unsupported(f"config_groups.{name}", "is not an object", _CT_READS)
        if group.get("output_activations"):
            raise _unsupported(f"config_groups.{name}.output_activations", "output quantization is not supported",
                               _CT_READS)
        weights = group.get("weights")
        if weights is None:
            if group.get("input_activations"):
                raise _unsupported(f"config_groups.{name}", "activation-only quantization is not supported",
                                   _CT_READS)
            continue
        schemes.add(_ct_group(f"config_groups.{name}", weights, group.get("input_activations")))
    if not schemes:
        return None
    if len(schemes) > 1:
        raise _unsupported("config_groups", f"{len(schemes)} different FP8 schemes in one model are not "
                           "supported", _CT_READS)
    return schemes.pop()


def _ct_group(key: str, weights: object, acts: object) -> WeightScheme:
    if not isinstance(weights, Mapping) or str(weights.get("type", "int")).lower() != "float" or \
            weights.get("num_bits") != 8 or weights.get("symmetric", True) is not True:
        what = (f"type {weights.get('type', 'int')}, num_bits {weights.get('num_bits')}"
                if isinstance(weights, Mapping) else _short(weights))
        raise _unsupported(f"{key}.weights", f"{what} is not a symmetric FP8 weight scheme", _CT_READS)
    strategy = str(weights.get("strategy") or "tensor").lower()
    block = None
    if strategy == "block":
        structure = weights.get("block_structure")
        if not (isinstance(structure, list) and len(structure) == 2 and all(isinstance(v, int) and v > 0
                                                                            for v in structure)):
            raise _unsupported(f"{key}.weights.block_structure", f"{_short(structure)} is not [rows, cols]", _CT_READS)
        block = (structure[0], structure[1])
    elif strategy not in ("tensor", "channel"):
        raise _unsupported(f"{key}.weights.strategy", f"{strategy!r} is not supported", _CT_READS)
    if weights.get("dynamic"):
        raise _unsupported(f"{key}.weights.dynamic", "dynamic weight scales are not supported", _CT_READS)
    if acts is None:
        return WeightScheme("compressed-tensors", "none", block, "FP8 weight-only")
    if not isinstance(acts, Mapping) or str(acts.get("type", "int")).lower() != "float" or \
            acts.get("num_bits") != 8 or acts.get("symmetric", True) is not True:
        raise _unsupported(f"{key}.input_activations", f"{_short(acts)} is not a symmetric FP8 activation scheme",
                           _CT_READS)
    act_strategy = str(acts.get("strategy") or "tensor").lower()
    dynamic = acts.get("dynamic") is True
    if act_strategy == "token" and dynamic:
        return WeightScheme("compressed-tensors", "dynamic-token", block, "FP8_DYNAMIC")
    if act_strategy == "tensor":
        return WeightScheme("compressed-tensors", "dynamic-tensor" if dynamic else "static-tensor", block, "FP8")
    if act_strategy == "group" and dynamic and acts.get("group_size") == fp8_weights.BLOCK:
        return WeightScheme("compressed-tensors", "dynamic-group", block, "FP8_BLOCK")
    raise _unsupported(f"{key}.input_activations.strategy", f"{act_strategy!r} (dynamic: {dynamic}) is not supported",
                       _CT_READS)


_MODELOPT_READS = "ModelOpt quant_algo FP8 (and FP8_PER_CHANNEL_PER_TOKEN) with kv_cache_quant_algo FP8 or none"


def _modelopt_weights(quant: Mapping) -> WeightScheme | None:
    inner = quant.get("quantization") if isinstance(quant.get("quantization"), Mapping) else quant
    algo = inner.get("quant_algo")
    if algo is None:
        return None
    algo = str(algo).upper()
    if algo == "FP8":
        return WeightScheme("ModelOpt", "static-tensor", None, "FP8")
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return WeightScheme("ModelOpt", "dynamic-token", None, "FP8_PER_CHANNEL_PER_TOKEN")
    raise _unsupported("quant_algo", f"{algo!r} is not supported", _MODELOPT_READS)


_FP8_READS = "transformers' fp8 method with activation_scheme dynamic"


def _transformers_fp8_weights(quant: Mapping) -> WeightScheme:
    block = quant.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2 and all(isinstance(v, int) and v > 0
                                                                                     for v in block)):
        raise _unsupported("weight_block_size", f"{_short(block)} is not [rows, cols]", _FP8_READS)
    scheme = str(quant.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise _unsupported("activation_scheme", f"{scheme!r} is not supported", _FP8_READS)
    if block is None:
        return WeightScheme("transformers fp8", "dynamic-token", None, "per-tensor")
    return WeightScheme("transformers fp8", "dynamic-group", (block[0], block[1]), "block")


_QUARK_READS = "Quark FP8 weights (dtype fp8_e4m3, qscheme per_tensor or per_channel) and fp8_e4m3 KV caches"


def _quark_weights(quant: Mapping) -> WeightScheme | None:
    configs = [("global_quant_config", quant.get("global_quant_config"))]
    layers = quant.get("layer_quant_config")
    configs += [(f"layer_quant_config.{n}", c) for n, c in layers.items()] if isinstance(layers, Mapping) else []
    found = set()
    for key, cfg in configs:
        if not isinstance(cfg, Mapping) or cfg.get("weight") is None:
            continue
        weight, acts = cfg.get("weight"), cfg.get("input_tensors")
        if not isinstance(weight, Mapping) or str(weight.get("dtype", "")).lower() not in _E4M3_NAMES or \
                weight.get("qscheme") not in ("per_tensor", "per_channel"):
            raise _unsupported(f"{key}.weight", f"{_short(weight)} is not supported", _QUARK_READS)
        if acts is None:
            found.add(WeightScheme("Quark", "none", None, "FP8 weight-only"))
        elif not isinstance(acts, Mapping) or str(acts.get("dtype", "")).lower() not in _E4M3_NAMES:
            raise _unsupported(f"{key}.input_tensors", f"{_short(acts)} is not supported", _QUARK_READS)
        elif acts.get("is_dynamic"):
            found.add(WeightScheme("Quark", "dynamic-tensor" if acts.get("qscheme") == "per_tensor"
                                   else "dynamic-token", None, "FP8"))
        else:
            found.add(WeightScheme("Quark", "static-tensor", None, "FP8"))
    if len(found) > 1:
        raise _unsupported("layer_quant_config", "different FP8 schemes per layer are not supported", _QUARK_READS)
    return found.pop() if found else None


def _short(value: object) -> str:
    import reprlib

    return reprlib.repr(value)[:80]


def strip_quantization(hf_config: object) -> None:
    """Take our own methods' quantization_config off a transformers config: it would otherwise ask for the
    tool's package, or (compressed-tensors) decompress on the first forward pass."""
    if hasattr(hf_config, "quantization_config"):
        delattr(hf_config, "quantization_config")


# ---- the tensors ----------------------------------------------------------------------------------------

def weight_files(folder: str) -> list[str]:
    """The safetensors files the model's weights are in: those the index names, else every *.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map", {})
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointFormatError(f"{index} is not a readable safetensors index ({e})") from None
        files = sorted({os.path.join(folder, name) for name in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise CheckpointFormatError(f"{index} lists {os.path.basename(missing[0])}, which is not in "
                                        f"{folder}: the download is incomplete")
        return files
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


@dataclass
class TensorInfo:
    file: str
    dtype: str  # safetensors' name: F32, BF16, F8_E4M3, ...
    shape: tuple[int, ...]


def inventory(folder: str) -> dict[str, TensorInfo]:
    """Every tensor's file, dtype and shape, from the safetensors headers alone (no tensor is read)."""
    from safetensors import safe_open

    found: dict[str, TensorInfo] = {}
    for file in weight_files(folder):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                piece = f.get_slice(name)
                found[name] = TensorInfo(file, piece.get_dtype(), tuple(piece.get_shape()))
    return found


def read_tensors(names: list[str], tensors: Mapping[str, TensorInfo]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(tensors[name].file, []).append(name)
    for file, wanted in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in wanted:
                out[name] = f.get_tensor(name)
    return out


def fp8_weight_names(tensors: Mapping[str, TensorInfo]) -> list[str]:
    """Layers (module paths) whose `weight` is stored as float8 codes."""
    return sorted(name[:-len(".weight")] for name, info in tensors.items()
                  if name.endswith(".weight") and info.dtype in _SAFETENSORS_DTYPES)


def fp8_layers(tensors: Mapping[str, TensorInfo]) -> tuple[dict[str, dict[str, str]], set[str]]:
    """Per FP8 layer (module path), the checkpoint names of its codes ("weight"), weight scale ("scale") and,
    if stored, static input scale ("input_scale"); and every checkpoint name the FP8 layers account for. Nothing
    is read: a layer's tensors are read when it is converted, one layer at a time."""
    layers: dict[str, dict[str, str]] = {}
    used: set[str] = set()
    for path in fp8_weight_names(tensors):
        scale = next((f"{path}.{n}" for n in ("weight_scale", "weight_scale_inv") if f"{path}.{n}" in tensors), None)
        if scale is None:
            raise CheckpointFormatError(f"checkpoint tensor {path}.weight is stored as float8 but has no "
                                        f"{path}.weight_scale (or weight_scale_inv) beside it: the real weights "
                                        "cannot be recovered; export the model again with its scales")
        names = {"weight": f"{path}.weight", "scale": scale}
        if f"{path}.input_scale" in tensors:
            names["input_scale"] = f"{path}.input_scale"
        layers[path] = names
        used.update(names.values())
        used.update(n for n in (f"{path}.weight_zero_point", f"{path}.input_zero_point") if n in tensors)
    return layers, used


def shape_of(info: TensorInfo) -> torch.Tensor:
    """A meta tensor of a checkpoint tensor's shape (for shape logic without reading it)."""
    return torch.empty(info.shape, device="meta")


def is_scale_like(name: str) -> bool:
    return bool(_SCALE_LIKE.search(name))


def group_names(names: list[str], limit: int = 6) -> str:
    """Tensor names with layer numbers folded: model.layers.{0..29}.self_attn.q_scale (30), ..."""
    patterns: dict[str, list[int]] = {}
    for name in sorted(names):
        match = re.search(r"\.(\d+)\.", name)
        key = name if match is None else name[:match.start(1)] + "{}" + name[match.end(1):]
        patterns.setdefault(key, []).append(int(match.group(1)) if match else -1)
    shown = []
    for key, layers in list(patterns.items())[:limit]:
        if "{}" in key and len(layers) > 1:
            key = key.replace("{}", "{" + f"{min(layers)}..{max(layers)}" + "}") + f" ({len(layers)})"
        elif "{}" in key:
            key = key.replace("{}", str(layers[0]))
        shown.append(key)
    more = len(patterns) - limit
    return ", ".join(shown) + (f" and {more} more kinds" if more > 0 else "")
