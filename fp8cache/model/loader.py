"""Load a Hugging Face causal LM from a local folder (or the default model) for the model runner; with
load_format dummy, random weights from its config.json alone (fp8cache/model/dummy.py)."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

import torch

from fp8cache.config import EngineConfig
from fp8cache.device import default_model_dtype, resolve_device
from fp8cache.model import dummy

# Tensor names that carry KV cache scales (docs/design.md section 3); transformers drops these as unknown weights.
SCALE_TENSOR_SUFFIXES = ("self_attn.kv_scale", "self_attn.k_scale", "self_attn.v_scale",
                         "k_proj.output_scale", "v_proj.output_scale")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_DTYPES = (torch.float32, torch.bfloat16)


class ModelLoadError(ValueError):
    pass


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    hf_config: object
    model_path: str
    checkpoint_scale_tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def resolve_model_path(model: str | None, progress: bool = True, load_format: str = "auto") -> str:
    """The local folder behind config.model; None means the embedded default model. With load_format dummy
    a folder needs only its config.json, and a shape shipped with fp8kv may be named instead of a folder
    (None: the default model's shape)."""
    is_dummy = dummy.check_load_format(load_format) == "dummy"
    if model is None:
        if is_dummy:
            return dummy.shape_path(dummy.DEFAULT_SHAPE)
        from fp8cache.model.default_model import ensure_default_model

        return ensure_default_model(progress=progress)
    path = os.path.abspath(os.path.expanduser(model))
    shape = dummy.shape_path(model) if not os.path.exists(path) else None
    if shape is not None:
        if is_dummy:
            return shape
        raise ModelLoadError(
            f"{model!r} is not a folder here but one of the model shapes fp8kv ships without weights "
            f"({', '.join(dummy.shape_names())}): they run with random weights, for benchmarks; add "
            '--load-format dummy (bench throughput|capacity, run, generate; LLM(load_format="dummy")), '
            "or give a model folder")
    if is_dummy:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(
                f"with --load-format dummy, MODEL {model!r} must be a folder holding a config.json (weights "
                f"are not read) or one of the shapes fp8kv ships: {', '.join(dummy.shape_names())}")
        return path
    check_model_folder(path, model)
    return path


def check_model_folder(path: str, given: str | None = None) -> None:
    """Raise ModelLoadError unless `path` is a Hugging Face folder with safetensors weights."""
    given = given or path
    if not os.path.exists(path):
        raise ModelLoadError(
            f"model path {given!r} does not exist; give a local Hugging Face model folder (config.json + "
            "*.safetensors), or no model for the default model (no model hub is used)")
    if not os.path.isdir(path):
        raise ModelLoadError(
            f"model path {given!r} is not a folder; give the folder that holds config.json and the "
            "*.safetensors weights")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"model folder {given!r} has no config.json; is it a Hugging Face model folder?")
    if not safetensors_files(path):
        pickles = [f for pat in ("*.bin", "*.pt", "*.pth") for f in glob.glob(os.path.join(path, pat))]
        if pickles:
            raise ModelLoadError(
                f"model folder {given!r} holds only pickle weights ({os.path.basename(pickles[0])}); fp8kv "
                "loads safetensors only (use_safetensors=True) because unpickling can run arbitrary code. "
                "Convert it once: AutoModelForCausalLM.from_pretrained(path).save_pretrained(out, "
                "safe_serialization=True)")
        raise ModelLoadError(f"model folder {given!r} has no *.safetensors weights")


def safetensors_files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def resolve_dtype(name: str, device: str | torch.device = "cpu",
                  checkpoint_dtype: torch.dtype | None = None) -> torch.dtype:
    """Model dtype for config.dtype: auto is the faster of float32 and bfloat16 on a CPU, the checkpoint's
    16-bit dtype on a GPU (fp8cache.device.default_model_dtype)."""
    if name == "auto":
        return default_model_dtype(resolve_device(device), checkpoint_dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not known; valid: auto, {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    if resolve_device(device).type == "cpu" and dtype not in _CPU_DTYPES:
        raise ValueError(f"dtype {name!r} is not supported on CPU; use auto, float32 or bfloat16")
    return dtype


def read_scale_tensors(path: str) -> dict[str, torch.Tensor]:
    """KV scale tensors stored beside the weights, read directly from the safetensors files."""
    from safetensors import safe_open

    found = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            names = [n for n in f.keys() if n.endswith(SCALE_TENSOR_SUFFIXES)]  # noqa: SIM118 (no __iter__)
            for name in names:
                found[name] = f.get_tensor(name)
    return found


def read_config_dict(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    is_dummy = dummy.check_load_format(config.load_format) == "dummy"
    path = resolve_model_path(config.model, progress=progress, load_format=config.load_format)
    remote = bool(config.trust_remote_code)
    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=remote, local_files_only=True)
    except ValueError as e:  # unknown model_type, or custom code without trust_remote_code
        raise ModelLoadError(f"cannot read the model config in {path!r}: {e}") from e
    dtype = resolve_dtype(config.dtype, config.device, checkpoint_dtype(hf_config))
    tokenizer_path = config.tokenizer or path
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
    model = AutoModelForCausalLM.from_pretrained(
        path, config=hf_config, dtype=dtype, use_safetensors=True, trust_remote_code=remote,
        local_files_only=True)
    model.eval()
    if on_device:
        model.to(resolve_device(config.device))
    return LoadedModel(model, tokenizer, model.config, path, read_scale_tensors(path))


def to_device(model: torch.nn.Module, device: torch.device | str) -> None:
    """model.to(device), and for random weights still on the meta device (load_model's on_device=False with
    load_format dummy) their memory and values there."""
    if dummy.is_meta(model):
        dummy.materialize(model, device)
    model.to(device)
