"""Engine configuration: one place for the knobs that LLM(), `fp8kv run`, eval and bench share: each setting's
type, default and check. The command line's engine flags take their defaults from these fields
(launcher/options.py; tests/launcher/test_engine_flags.py holds every field to a flag or a reason it has none).

A field typed with a Literal accepts those strings only; _AT_LEAST bounds the numbers. A wrong value is a
ValueError naming the field, the value and what is valid, when the config is made (LLM(), a command's start).
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, fields
from typing import Literal

DEFAULT_KV_RECENT_WINDOW = 32

# The user's kv-cache-dtype string (fp8cache/kvcache/dtype_names.py lists the same, for the command line).
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz"]
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass
class EngineConfig:
    model: str | None = None  # a folder, a hub id (org/name), or None: the embedded default model (docs/design.md section 6)
    revision: str | None = None  # hub ids: the branch, tag or commit (None: main)
    download_dir: str | None = None  # hub ids: the Hugging Face cache folder to use (None: $HF_HOME/hub)
    tokenizer: str | None = None  # None: same folder as the model
    dtype: ModelDtype = "auto"  # auto | float32 | bfloat16 | float16 (auto: the faster of float32 and bfloat16 on a CPU, the checkpoint's 16-bit dtype on a GPU)
    kv_cache_dtype: KVCacheDtype = "auto"
    quantization_param_path: str | None = None
    calculate_kv_scales: bool = False
    kv_scales_granularity: Literal["tensor", "head"] = "tensor"  # tensor | head, for calculate_kv_scales
    # static: per-tensor or per-head scales (file, checkpoint, calculate_kv_scales or 1.0); dynamic: a scale per
    # token and KV head computed as the cache is written, no calibration (fp8cache/kvcache/dynamic_scales.py)
    kv_scales: Literal["static", "dynamic"] = "static"
    # Dynamic scales only: auto (the Hadamard rotation where the head size allows it: measured to pay, docs/design.md
    # "Dynamic KV scales"), hadamard or none. Static scales take theirs from their scales file.
    kv_rotation: Literal["auto", "none", "hadamard"] = "auto"
    # Layers whose cache is held in the model dtype while the others are FP8 (vLLM's name): where FP8 hurts most
    # (`fp8kv calibrate --skip-layers-kl-budget` names them). No effect with an auto kv_cache_dtype.
    kv_cache_dtype_skip_layers: tuple[int, ...] = ()
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's own limit
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # bytes or "2GiB"; None: what max_num_seqs x max_model_len need, capped by what the device can give
    # (kv_cache_memory_fraction of the host's available memory; on a GPU, gpu_memory_utilization)
    kv_cache_memory: int | str | None = None
    kv_cache_memory_fraction: float = 0.3
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory fp8kv may use in all (vLLM's name)
    enable_prefix_caching: bool = True
    seed: int = 0
    trust_remote_code: bool = False
    device: str = "auto"  # auto (first GPU, else CPU) | cpu | cuda | cuda:N
    # Newest tokens per sequence whose K/V are also kept in the model dtype (0: plain FP8 cache);
    # None: DEFAULT_KV_RECENT_WINDOW for FP8 caches, 0 for auto.
    kv_recent_window: int | None = None
    # dtype of that window: auto = the model dtype (exactly the auto cache for the newest tokens);
    # bfloat16 / float16 halve a float32 model's window memory.
    kv_recent_window_dtype: ModelDtype = "auto"
    enforce_eager: bool = False  # GPU: run decode steps op by op instead of replaying CUDA graphs (vLLM's name)
    tensor_parallel_size: int = 1  # ranks sharing the model; > 1 needs RANK/WORLD_SIZE/MASTER_* env
    # auto: the model folder's safetensors weights; dummy: random weights from its config.json alone, or a shape
    # shipped with fp8kv by name (benchmarks at a real model's size without its checkpoint; fp8cache/model/dummy.py)
    load_format: Literal["auto", "dummy"] = "auto"
    # Request defaults (vLLM's flags): auto = the model folder's generation_config.json, vllm/none = fp8kv's
    # neutral ones, or a folder holding a generation_config.json; the override (a dict or JSON object text)
    # replaces single fields (fp8cache/engine/generation_defaults.py).
    generation_config: str = "auto"
    override_generation_config: dict | str | None = None
    # Speculative decoding, vLLM's shape: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": m,
    # "prompt_lookup_max": M} (a dict or its JSON text; fp8cache/engine/speculative_config.py). None: off.
    speculative_config: dict | str | None = None

    def __post_init__(self) -> None:
        for name, choices in field_choices().items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name}={value!r} is not known; valid choices: "
                                 + ", ".join("None" if c is None else str(c) for c in choices))
        for name, (least, optional) in _AT_LEAST.items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}={value!r} must be an integer >= {least}" + (" (or None)" if optional else ""))
        self.kv_cache_dtype_skip_layers = layer_ids(self.kv_cache_dtype_skip_layers)
        for name in ("gpu_memory_utilization", "kv_cache_memory_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"{name}={value!r} must be a share in (0, 1]")


def layer_ids(value: object, field: str = "kv_cache_dtype_skip_layers") -> tuple[int, ...]:
    """Layer ids as a sorted tuple, from a list/tuple of ints or text such as "0,1,5"; each >= 0 and given once
    (the model's layer count bounds them when it loads)."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if not all(p.isdigit() for p in parts):
            raise ValueError(f"{field}={value!r} is not a list of layer ids; give them as 0,1,5")
        value = [int(p) for p in parts]
    if not isinstance(value, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                   for i in value):
        raise ValueError(f"{field}={value!r} must be a list of layer ids (integers >= 0), e.g. [0, 1]")
    if len(set(value)) != len(value):
        raise ValueError(f"{field}={list(value)} names a layer twice; give each once")
    return tuple(sorted(value))


# Integer fields: (smallest valid value, None allowed).
_AT_LEAST = {"block_size": (1, False), "max_model_len": (1, True), "max_num_seqs": (1, False),
             "max_num_batched_tokens": (1, False), "seed": (-(2**63), False), "kv_recent_window": (0, True),
             "tensor_parallel_size": (1, False)}


@functools.cache
def field_choices() -> dict[str, tuple]:
    """{field: its valid values} for every field typed with a Literal (None too for an optional one): what the
    command line offers for its flag."""
    hints = typing.get_type_hints(EngineConfig)
    found = {}
    for f in fields(EngineConfig):
        hint = hints[f.name]
        options = [hint, *typing.get_args(hint)] if typing.get_origin(hint) is typing.Union else [hint]
        literal = [a for o in options if typing.get_origin(o) is Literal for a in typing.get_args(o)]
        if literal:
            found[f.name] = (*literal, *([None] if type(None) in typing.get_args(hint) else []))
    return found
