"""Checks made before a model loads (seconds to minutes), from what can be read without loading it: a bad
--quantization-param-path fails at once, with the model's layer and head counts when its config.json is at
hand."""

from __future__ import annotations

import json
import os

from fp8cache.config import EngineConfig
from fp8cache.kvcache import scale_files
from fp8cache.model import hub
from fp8cache.model.default_model import default_model_dir, is_converted


def check_engine_scales(config: EngineConfig) -> None:
    """Check config.quantization_param_path against the model's shape where it is known; raises
    ScalesFileError. Without the shape the file is checked for itself."""
    path = config.quantization_param_path
    if not path:
        return
    tp_size = config.tensor_parallel_size if isinstance(config.tensor_parallel_size, int) else 1
    num_layers, num_kv_heads = model_shape(config.model, config.revision, config.download_dir)
    scale_files.check_scales_file(path, config.kv_cache_dtype, config.device, num_layers, num_kv_heads, tp_size)


def model_shape(model: str | None, revision: str | None = None,
                 download_dir: str | None = None) -> tuple[int | None, int | None]:
    """(layers, KV heads) from the model folder's config.json (a hub id's cached snapshot); (None, None) when
    not at hand."""
    if model is None:
        folder = default_model_dir()
        if not is_converted(folder):
            return None, None
    else:
        folder = os.path.abspath(os.path.expanduser(model))
        if not os.path.exists(folder):
            cached = hub.cached_folder(model, revision, download_dir, tokenizer_only=True) \
                if hub.looks_like_repo_id(model) else None
            folder = cached or folder
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None, None  # the loader reports a missing or broken model folder
    if not isinstance(cfg, dict):
        return None, None
    layers, heads = cfg.get("num_hidden_layers"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (layers, heads)):
        return None, None  # e.g. a multimodal config keeps them in text_config: leave those to the runner
    return layers, heads
