"""Load a Hugging Face causal LM for the model runner: from a local folder, a hub id (model/hub.py: the cache
first, a download otherwise) or the default model; with load_format dummy, random weights from its config.json
alone (fp8cache/model/dummy.py).

Quantized checkpoints (model/checkpoints.py) load without the quantization tools' packages: their config is
read here and hidden from transformers, which loads the plain tensors; FP8 weights then become real weights
(model/fp8_weights.py: FP8 matmuls on a GPU with FP8 units, dequantized elsewhere) and KV scales go to the
runner. Tensors the checkpoint holds and nothing uses are reported, never dropped in silence."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fp8cache.config import EngineConfig
from fp8cache.kvcache import scale_files
from fp8cache.model import checkpoints, dummy, fp8_weights, shapes
from fp8cache.model.cpu import dtype_probe

# Re-exported: the loader's callers and tests name them here.
from fp8cache.model.model_path import (  # noqa: F401
    ModelLoadError,
    check_model_folder,
    model_folder,
    resolve_model_path,
    safetensors_files,
    tokenizer_folder,
)
from fp8cache.platform import model_dtype
from fp8cache.platform.device import resolve_device

DTYPES = model_dtype.DTYPES


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    hf_config: object
    model_path: str
    checkpoint_scale_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # Startup lines about the checkpoint for the runner to log (FP8 weights, unused tensors; "warning: ...").
    notes: list[str] = field(default_factory=list)
    quant: checkpoints.CheckpointQuant = field(default_factory=checkpoints.CheckpointQuant)


def resolve_dtype(name: str, device: str | torch.device = "cpu",
                  checkpoint_dtype: torch.dtype | None = None) -> torch.dtype:
    """Model dtype for config.dtype (platform/model_dtype.py; a CPU's auto measured by model/cpu/dtype_probe.py)."""
    return model_dtype.resolve(name, resolve_device(device), checkpoint_dtype, lambda: dtype_probe.cpu_auto_dtype())


def read_scale_tensors(path: str) -> dict[str, torch.Tensor]:
    """KV scale tensors stored beside the weights (every name of docs/design.md section 3, and their zero
    points), read directly from the safetensors files the model's weights are in."""
    tensors = checkpoints.inventory(path)
    names = scale_files.checkpoint_scale_tensor_names(tensors)
    names += [n for n in tensors if scale_files.is_kv_zero_point(n)]
    return checkpoints.read_tensors(names, tensors)


def read_config_dict(path: str) -> dict:
    """config.json as a dict (with a ModelOpt hf_quant_config.json folded in, checkpoints.read_config)."""
    return checkpoints.read_config(path)


def checkpoint_dtype(hf_config: object) -> torch.dtype | None:
    """The dtype the checkpoint's config.json names (transformers 5 calls it `dtype`, 4 `torch_dtype`)."""
    for name in ("dtype", "torch_dtype"):
        value = getattr(hf_config, name, None)
        if isinstance(value, str):
            value = DTYPES.get(value)
        if isinstance(value, torch.dtype):
            return value
    return None


def load_model(config: EngineConfig, progress: bool = True, on_device: bool = True) -> LoadedModel:
    """on_device=False keeps the weights on the CPU (a tensor-parallel rank shards them there first, so that
    only its share ever reaches its GPU); random weights (load_format dummy) then stay on the meta device
    until to_device() fills the rank's share."""
    from transformers import AutoConfig, AutoTokenizer

    is_dummy = shapes.check_load_format(config.load_format) == "dummy"
    path = model_folder(config, progress)
    remote = bool(config.trust_remote_code)
    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=remote, local_files_only=True)
    except ValueError as e:  # unknown model_type, or custom code without trust_remote_code
        raise ModelLoadError(f"cannot read the model config in {path!r}: {e}") from e
    if is_dummy:  # random weights in the model's shapes: its quantization has nothing to act on
        quant = checkpoints.CheckpointQuant()
        checkpoints.strip_quantization(hf_config)
    else:
        quant = checkpoints.describe(checkpoints.read_config(path))
        if quant.own:
            checkpoints.strip_quantization(hf_config)
    dtype = resolve_dtype(config.dtype, config.device, checkpoint_dtype(hf_config))
    tokenizer_path = tokenizer_folder(config, path, progress)
    if is_dummy and config.tokenizer is None and not dummy.has_tokenizer(path):
        tokenizer = dummy.byte_tokenizer(hf_config)  # a config alone (a shipped shape): any id decodes
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=remote,
                                                      local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load a tokenizer from {tokenizer_path!r}: {e}; give one with "
                                 "--tokenizer PATH") from e
    if is_dummy:
        # Straight onto the device (meta for a tensor-parallel rank, which fills only its share: to_device).
        device = resolve_device(config.device) if on_device else "meta"
        model = dummy.build_model(hf_config, dtype, device, remote)
        return LoadedModel(model, tokenizer, model.config, path, {})
    tensors = checkpoints.inventory(path)
    model, unexpected = _from_pretrained(path, hf_config, dtype, remote)
    model.eval()
    device = resolve_device(config.device)
    notes: list[str] = []
    used = _apply_fp8_weights(model, tensors, quant, dtype, device, on_device and _tp_size(config) == 1, notes)
    scale_names = scale_files.checkpoint_scale_tensor_names(tensors)
    scale_names += [n for n in tensors if scale_files.is_kv_zero_point(n)]
    kv_tensors = checkpoints.read_tensors(scale_names, tensors)
    notes += _unused_tensors(unexpected, used | set(scale_names))
    if on_device:
        model.to(device)
    return LoadedModel(model, tokenizer, model.config, path, kv_tensors, notes, quant)


def _tp_size(config: EngineConfig) -> int:
    size = config.tensor_parallel_size
    return size if isinstance(size, int) else 1


def _from_pretrained(path: str, hf_config: object, dtype: torch.dtype, remote: bool) -> tuple[torch.nn.Module,
                                                                                                list[str]]:
    """transformers' load, its report of unexpected tensors returned instead of printed (fp8kv says what they
    are), and missing weights refused: they would run as random values."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, config=hf_config, dtype=dtype, use_safetensors=True, trust_remote_code=remote,
            local_files_only=True, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ModelLoadError(f"the checkpoint in {path} lacks {len(missing)} weights the model needs "
                             f"({checkpoints.group_names(missing, 3)}): they would run as random values; is the "
                             "folder complete, and is it this architecture's checkpoint?")
    return model, sorted(info.get("unexpected_keys") or [])


def _apply_fp8_weights(model: torch.nn.Module, tensors: dict[str, checkpoints.TensorInfo],
                       quant: checkpoints.CheckpointQuant, dtype: torch.dtype, device: torch.device,
                       may_run_fp8: bool, notes: list[str]) -> set[str]:
    """Turn the checkpoint's FP8 layers into real weights (as FP8 matmuls where this device runs them);
    returns the checkpoint names they used. transformers loaded the codes cast to `dtype`, unscaled."""
    if not checkpoints.fp8_weight_names(tensors):
        return set()
    layers, used = checkpoints.fp8_layers(tensors)
    scheme = quant.weights or checkpoints.WeightScheme("FP8 checkpoint", "dynamic-token", name="weights")
    why_not = _why_not_fp8(layers, tensors, scheme, dtype, device, may_run_fp8)
    report = fp8_weights.apply(model, layers, lambda names: checkpoints.read_tensors(names, tensors),
                               scheme.activations, dtype, why_not is None, scheme.block)
    what = f"FP8 weights ({scheme.describe()})"
    if report.fp8_layers:
        modes = ", ".join(f"{n} {mode}" for mode, n in sorted(report.modes.items()))
        rest = (f"; {report.dequantized} dequantized to {_dtype_name(dtype)} (shapes or scales the FP8 kernel "
                "does not take)" if report.dequantized else "")
        notes.append(f"{what}: {report.fp8_layers} linear layers run as FP8 matmuls (torch._scaled_mm, {modes}) "
                     f"on {fp8_weights.fp8_matmul_support(device)[1]}{rest}")
    else:
        notes.append(f"{what}: {report.dequantized} layers dequantized once to {_dtype_name(dtype)} at load "
                     f"(activations stay unquantized): {why_not}")
    return used


def _why_not_fp8(layers: dict[str, dict[str, str]], tensors: dict[str, checkpoints.TensorInfo],
                 scheme: checkpoints.WeightScheme, dtype: torch.dtype, device: torch.device,
                 may_run_fp8: bool) -> str | None:
    """None when the FP8 layers run as FP8 matmuls here, else why they are dequantized."""
    if not may_run_fp8:
        return "tensor parallelism shards plain weights"
    if scheme.activations == "none":
        return "a weight-only scheme keeps 16-bit activations, which the FP8 matmul does not take"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the model runs in {_dtype_name(dtype)} (FP8 matmuls write bfloat16 or float16)"
    supported, reason = fp8_weights.fp8_matmul_support(device)
    if not supported:
        return reason
    modes = set()
    for names in layers.values():
        codes, scale = tensors[names["weight"]], checkpoints.shape_of(tensors[names["scale"]])
        try:
            kind = fp8_weights.scale_kind(scale, *codes.shape, scheme.block)
        except fp8_weights.Fp8WeightsError as exc:
            raise fp8_weights.Fp8WeightsError(f"{names['scale']}: {exc}") from None
        mode = fp8_weights.matmul_mode(kind, scheme.activations, scheme.block)
        if mode is not None:
            modes.add((mode, scheme.activations))
    if not modes:
        return "no layer's scales fit an FP8 matmul kernel"
    if device.type == "cuda":  # the stand-in device of the tests holds no values to check
        failed = fp8_weights.probe(device, dtype, modes)
        if failed is not None:
            return f"the device's self-check failed: {failed}"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _unused_tensors(unexpected: list[str], used: set[str]) -> list[str]:
    """Warnings naming checkpoint tensors nothing reads: scale-like ones (a tool's convention fp8kv does not
    know would otherwise run at scale 1.0 in silence) and the rest."""
    left = [n for n in unexpected if n not in used]
    notes = []
    attention = [n for n in left if scale_files.is_unused_attention_scale(n)]
    scales = [n for n in left if checkpoints.is_scale_like(n) and n not in attention]
    others = [n for n in left if n not in scales and n not in attention]
    if attention:
        notes.append(f"warning: the checkpoint holds Q / attention-probability scales, which fp8kv does not use "
                     f"(it quantizes only K and V): {checkpoints.group_names(attention)}")
    if scales:
        notes.append(f"warning: the checkpoint holds scale tensors fp8kv does not use, so they have no effect: "
                     f"{checkpoints.group_names(scales)}; if they are KV cache scales under a name fp8kv does not "
                     "know, pass them as a scales file (--quantization-param-path)")
    if others:
        notes.append(f"warning: the checkpoint holds tensors the model has no place for (ignored): "
                     f"{checkpoints.group_names(others)}")
    return notes


def to_device(model: torch.nn.Module, device: torch.device | str) -> None:
    """model.to(device), and for random weights still on the meta device (load_model's on_device=False with
    load_format dummy) their memory and values there."""
    if dummy.is_meta(model):
        dummy.materialize(model, device)
    model.to(device)
