"""Where a model's files are: resolve_model_path and its checks of a local folder. No torch and no transformers
here: the launcher checks a model folder with them before it loads either (a mistyped path fails in a fraction of
a second instead of after five of imports)."""

from __future__ import annotations

import glob
import os

from fp8cache.config import EngineConfig
from fp8cache.model import hub, shapes


class ModelLoadError(ValueError):
    pass


def resolve_model_path(model: str | None, progress: bool = True, load_format: str = "auto",
                       revision: str | None = None, download_dir: str | None = None,
                       trust_remote_code: bool = False) -> str:
    """The local folder behind config.model; None means the embedded default model. A local folder wins; a
    name that is none and looks like a hub id (`org/name`) resolves through the Hugging Face cache, or a
    download (model/hub.py; `revision`, `download_dir`). With load_format dummy a folder needs only its
    config.json (a hub id fetches only config and tokenizer), and a shape shipped with fp8kv may be named
    instead of a folder (None: the default model's shape)."""
    is_dummy = shapes.check_load_format(load_format) == "dummy"
    if model is None:
        if is_dummy:
            return shapes.shape_path(shapes.DEFAULT_SHAPE)
        from fp8cache.model.default_model import ensure_default_model

        return ensure_default_model(progress=progress)
    path = os.path.abspath(os.path.expanduser(model))
    shape = shapes.shape_path(model) if not os.path.exists(path) else None
    if shape is not None:
        if is_dummy:
            return shape
        raise ModelLoadError(
            f"{model!r} is not a folder here but one of the model shapes fp8kv ships without weights "
            f"({', '.join(shapes.shape_names())}): they run with random weights, for benchmarks; add "
            '--load-format dummy (bench throughput|capacity, run, generate; LLM(load_format="dummy")), '
            "or give a model folder")
    if not os.path.exists(path) and hub.looks_like_repo_id(model):
        return hub.resolve(model, revision, download_dir, trust_remote_code, progress, tokenizer_only=is_dummy)
    if is_dummy:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(
                f"with --load-format dummy, MODEL {model!r} must be a folder holding a config.json (weights "
                f"are not read) or one of the shapes fp8kv ships: {', '.join(shapes.shape_names())}")
        return path
    check_model_folder(path, model)
    return path


def model_folder(config: EngineConfig, progress: bool = True) -> str:
    """resolve_model_path for an EngineConfig's model, revision, download folder and load format."""
    return resolve_model_path(config.model, progress, config.load_format, config.revision, config.download_dir,
                              bool(config.trust_remote_code))


def tokenizer_folder(config: EngineConfig, model_path: str, progress: bool = True) -> str:
    """config.tokenizer as a folder (a hub id resolves to its tokenizer files), else the model's."""
    name = config.tokenizer
    if name is None:
        return model_path
    if not os.path.exists(os.path.expanduser(name)) and hub.looks_like_repo_id(name):
        return hub.resolve(name, config.revision if config.model == name else None, config.download_dir,
                           bool(config.trust_remote_code), progress, tokenizer_only=True)
    return name


def check_model_folder(path: str, given: str | None = None) -> None:
    """Raise ModelLoadError unless `path` is a Hugging Face folder with safetensors weights."""
    given = given or path
    if not os.path.exists(path):
        raise ModelLoadError(
            f"model path {given!r} does not exist; give a local Hugging Face model folder (config.json + "
            "*.safetensors), a Hugging Face hub id (org/name), or no model for the default model")
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
