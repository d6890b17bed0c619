"""Checks made before a model loads (seconds to minutes), from what can be read without loading it: a bad
--quantization-param-path fails at once, with the model's layer and head counts when its config.json is at
hand. check_before_loading needs neither torch nor transformers: the commands call it before they import them
(five seconds here), so a mistyped model folder or a --num-shard the model does not allow fails at once."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from fp8cache.config import EngineConfig
from fp8cache.distributed.layout import check_divisible
from fp8cache.model import hub, model_path, shapes
from fp8cache.model.default_model import default_model_dir, is_converted


def check_engine_scales(config: EngineConfig) -> None:
    """Check config.quantization_param_path against the model's shape where it is known; raises
    ScalesFileError. Without the shape the file is checked for itself."""
    path = config.quantization_param_path
    if not path:
        return
    from fp8cache.kvcache import scale_files

    tp_size = config.tensor_parallel_size if isinstance(config.tensor_parallel_size, int) else 1
    num_layers, num_kv_heads = model_shape(config.model, config.revision, config.download_dir)
    scale_files.check_scales_file(path, config.kv_cache_dtype, config.device, num_layers, num_kv_heads, tp_size)


def model_shape(model: str | None, revision: str | None = None,
                 download_dir: str | None = None) -> tuple[int | None, int | None]:
    """(layers, KV heads) from the model folder's config.json (a hub id's cached snapshot); (None, None) when
    not at hand."""
    cfg = _config_json(model, revision, download_dir)
    if cfg is None:
        return None, None
    layers, heads = cfg.get("num_hidden_layers"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if not all(_positive_int(x) for x in (layers, heads)):
        return None, None  # e.g. a multimodal config keeps them in text_config: leave those to the runner
    return layers, heads


def _config_json(model: str | None, revision: str | None = None, download_dir: str | None = None) -> dict | None:
    """The model folder's config.json (a hub id's cached snapshot; the converted default model) as a dict; None
    when it is not at hand or not a JSON object (the loader then reports it)."""
    if model is None:
        folder = default_model_dir()
        if not is_converted(folder):
            return None
    else:
        folder = os.path.abspath(os.path.expanduser(model))
        if not os.path.exists(folder):
            cached = shapes.shape_path(model) or (hub.cached_folder(model, revision, download_dir, tokenizer_only=True)
                                                  if hub.looks_like_repo_id(model) else None)
            folder = cached or folder
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return cfg if isinstance(cfg, dict) else None


def check_before_loading(config: EngineConfig) -> None:
    """A local model folder that is not one, or a --num-shard its heads do not allow: ValueError."""
    check_local_model(config)
    check_model_divisible(config)


def check_local_model(config: EngineConfig) -> None:
    """resolve_model_path's refusals of a local path (ModelLoadError). A hub id is left to the load, which may
    download it; the default model, which may be converted first, too."""
    model = config.model
    if model is None:
        return
    exists = os.path.exists(os.path.abspath(os.path.expanduser(model)))
    if not exists and shapes.shape_path(model) is None and hub.looks_like_repo_id(model):
        return
    model_path.resolve_model_path(model, False, config.load_format, config.revision, config.download_dir)


def check_model_divisible(config: EngineConfig) -> None:
    """check_divisible from the model's config.json alone, before any rank is started: a --num-shard the
    heads do not allow is then one error, not one traceback per rank after each loaded the weights. A config
    whose head counts are not at its top level (a multimodal model's text_config) is read by transformers; one
    that cannot be read here is left for the ranks to report."""
    size = config.tensor_parallel_size
    if not isinstance(size, int) or size <= 1:
        return
    cfg = _config_json(config.model, config.revision, config.download_dir)
    if cfg is None:
        return
    sizes = {key: cfg.get(key) for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
    if all(value is None or _positive_int(value) for value in sizes.values()) and sizes["num_attention_heads"]:
        check_divisible(SimpleNamespace(**sizes), size)
        return
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(model_path.model_folder(config, progress=False),
                                               trust_remote_code=bool(config.trust_remote_code),
                                               local_files_only=True)
    except (OSError, ValueError):
        return
    check_divisible(hf_config, size)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
