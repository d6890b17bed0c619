"""Engine configuration: one place for the knobs that LLM(), `fp8kv run`, eval and bench share: each setting's
type, default, check and its flag's --help words, declared with setting(). The command line's engine flags are
made from these fields (launcher/options.py), so a new engine flag is one field here plus its test
(tests/launcher/test_engine_flags.py holds every field to its flag, or to the reason it has none).

A field typed with a Literal accepts those strings only; setting(at_least=) bounds an integer and share=True a
float. A wrong value is a ValueError naming the field, the value and what is valid, when the config is made (LLM(),
a command's start).
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal

DEFAULT_KV_RECENT_WINDOW = 32

# The user's kv-cache-dtype string (fp8cache/kvcache/dtype_names.py lists the same, for the command line).
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz"]
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]


def setting(default: Any, *, help: str | None = None, section: str | None = None, metavar: str | None = None,
            path: Literal["dir", "existing file"] | None = None, choices: tuple | None = None,
            at_least: int | None = None, share: bool = False, size: bool = False, flag_type: type | None = None,
            no_flag: str | None = None) -> Any:
    """An EngineConfig field with what its command-line flag needs (launcher/options.py makes the flag from it,
    named as the field: --max-num-seqs; a bool defaulting to True gets --x/--no-x). Plain data, no click here.

    help, section: the flag's --help words and section (launcher/help_sections.py); "{shapes}" in help becomes the
    model shapes fp8kv ships. metavar: the value's name in --help. path: the value is a folder ("dir") or a file
    that must exist ("existing file"). choices: what the command line offers when it is narrower than what the
    field accepts. at_least: the smallest integer accepted (checked here; the flag's range). share: a float in
    (0, 1]. size: bytes, or text such as "2GiB" (the flag's digits become an int). flag_type: the flag's type
    when not derived (int: any integer). no_flag: why the field has no flag of its own (then no help needed).
    """
    meta = {"help": help, "section": section, "metavar": metavar, "path": path, "choices": choices,
            "at_least": at_least, "share": share, "size": size, "flag_type": flag_type, "no_flag": no_flag}
    if (help is None or section is None) and no_flag is None:
        raise ValueError("an EngineConfig setting needs help and section for its flag, or no_flag naming why not")
    return field(default=default, metadata=meta)


@dataclass
class EngineConfig:
    """The engine's settings. Each field is declared with setting(): its type, default, check and its flag's
    --help words, so that a new engine flag is one field here (plus its test)."""

    # a folder, a hub id (org/name), or None: the embedded default model (docs/design.md section 6)
    model: str | None = setting(None, no_flag="the MODEL argument, or --model (model_option)")
    revision: str | None = setting(  # None: main
        None, section="Model", metavar="REV", help="Hub ids: the branch, tag or commit to use (default: main).")
    download_dir: str | None = setting(  # None: $HF_HOME/hub
        None, section="Model", metavar="DIR", path="dir",
        help="Hub ids: the Hugging Face cache folder to read and download into (default: $HF_HOME/hub).")
    tokenizer: str | None = setting(  # None: same folder as the model
        None, section="Model", metavar="PATH", help="Tokenizer folder, if not the model's.")
    kv_cache_dtype: KVCacheDtype = setting(
        "auto", section="KV cache",
        help="KV cache storage: auto (the model dtype) or an FP8 format; fp8 is E4M3FN on CPU and CUDA, E4M3FNUZ on "
             "ROCm.")
    quantization_param_path: str | None = setting(
        None, section="KV cache", path="existing file", help="JSON file of KV cache scales (vLLM/aphrodite schema).")
    calculate_kv_scales: bool = setting(
        False, section="KV cache",
        help="Compute KV scales from the first batch when no scales file or checkpoint scales exist.")
    kv_scales_granularity: Literal["tensor", "head"] = setting(  # for calculate_kv_scales
        "tensor", section="KV cache", help="Granularity of calculated scales.")
    # static: per-tensor or per-head scales (file, checkpoint, calculate_kv_scales or 1.0); dynamic: a scale per
    # token and KV head computed as the cache is written, no calibration (fp8cache/kvcache/dynamic_scales.py)
    kv_scales: Literal["static", "dynamic"] = setting(
        "static", section="KV cache",
        help="static: per-tensor or per-head scales (scales file, checkpoint, --calculate-kv-scales or 1.0). dynamic: "
             "a scale per token and KV head computed as the cache is written, no calibration (the GPU kernels have "
             "not yet run on a GPU).")
    # Dynamic scales only: auto (the Hadamard rotation where the head size allows it: measured to pay, docs/design.md
    # "Dynamic KV scales"), hadamard or none. Static scales take theirs from their scales file.
    kv_rotation: Literal["auto", "none", "hadamard"] = setting(
        "auto", section="KV cache",
        help="With --kv-scales dynamic: rotate K/V by a Hadamard matrix before quantizing (auto: where the head size "
             "allows). Static scales use the rotation their scales file records.")
    # Layers whose cache is held in the model dtype while the others are FP8 (vLLM's name): where FP8 hurts most
    # (`fp8kv calibrate --skip-layers-kl-budget` names them). No effect with an auto kv_cache_dtype.
    kv_cache_dtype_skip_layers: tuple[int, ...] = setting(
        (), section="KV cache", metavar="0,1,...",
        help="Layers whose KV cache is kept in the model dtype (2 or 4 bytes a value instead of 1) while the others "
             "are FP8, where FP8 hurts most (`fp8kv calibrate --skip-layers-kl-budget` names them). No effect with "
             "kv-cache-dtype auto. Default: none.")
    # Newest tokens per sequence whose K/V are also kept in the model dtype (0: plain FP8 cache);
    # None: DEFAULT_KV_RECENT_WINDOW for FP8 caches, 0 for auto.
    kv_recent_window: int | None = setting(
        None, section="KV cache", at_least=0,
        help="Keep each sequence's newest N tokens' K/V in full precision too (0: plain FP8 cache; default 32 with an "
             "FP8 cache).")
    # The first N tokens of each sequence (attention sinks: rows past the window give the first token much of
    # their weight) also kept in the window's dtype, beside the recent window (docs/design.md section 10).
    kv_recent_window_sinks: int = setting(
        1, section="KV cache", at_least=0,
        help="With kv-recent-window > 0: the first N tokens of each sequence (attention sinks) also kept in the "
             "window's dtype (0: only the recent window).")
    # dtype of that window: auto = the model dtype (exactly the auto cache for the newest tokens);
    # bfloat16 / float16 halve a float32 model's window memory.
    kv_recent_window_dtype: ModelDtype = setting(
        "auto", section="KV cache",
        help="dtype of that window (auto: the model dtype; bfloat16 halves a float32 model's window memory).")
    dtype: ModelDtype = setting(
        "auto", section="Model",
        help="Weights and activations dtype (auto: on a CPU the faster of float32 and bfloat16 there, bfloat16 where "
             "it multiplies bfloat16 natively; on a GPU the checkpoint's 16-bit dtype).")
    block_size: int = setting(16, section="KV cache", at_least=1, choices=(8, 16, 32),
                              help="Tokens per KV cache block.")
    max_model_len: int | None = setting(  # None: the model's own limit
        None, section="Scheduling", at_least=1,
        help="Longest prompt plus completion in tokens (default: the model's own limit).")
    max_num_seqs: int = setting(64, section="Scheduling", at_least=1, help="Most sequences in one batch.")
    max_num_batched_tokens: int = setting(
        2048, section="Scheduling", at_least=1,
        help="Most tokens in one engine step (longer prompts are prefilled in chunks).")
    # bytes or "2GiB"; None: what max_num_seqs x max_model_len need, capped by what the device can give
    # (kv_cache_memory_fraction of the host's available memory; on a GPU, gpu_memory_utilization)
    kv_cache_memory: int | str | None = setting(
        None, section="KV cache", metavar="SIZE", size=True,
        help="Memory for the KV cache: 2GiB, 512MiB or bytes (default: what max-num-seqs x max-model-len need, "
             "capped at 0.3 of free host memory or, on a GPU, by --gpu-memory-utilization).")
    kv_cache_memory_fraction: float = setting(
        0.3, share=True, no_flag="Python API only: --kv-cache-memory gives the budget itself")
    enable_prefix_caching: bool = setting(
        True, section="KV cache", help="Reuse the cached blocks of shared prompt prefixes.")
    seed: int = setting(0, section="Scheduling", at_least=-(2**63), flag_type=int, help="Engine random seed.")
    device: str = setting(  # auto (first GPU, else CPU) | cpu | cuda | cuda:N
        "auto", section="Device", help="auto (the first GPU if torch sees one, else the CPU), cpu, cuda or cuda:N.")
    gpu_memory_utilization: float = setting(  # share of the GPU's memory fp8kv may use in all (vLLM's name)
        0.9, section="Device", share=True,
        help="On a GPU: the share of its memory fp8kv may use in all; the KV cache gets what the weights and "
             "activations leave of it (capped at what max-num-seqs x max-model-len need).")
    enforce_eager: bool = setting(  # vLLM's name
        False, section="Device", help="On a GPU: run decode steps op by op instead of replaying CUDA graphs.")
    # Speculative decoding, vLLM's shape: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": m,
    # "prompt_lookup_max": M} (a dict or its JSON text; fp8cache/engine/speculative_config.py). None: off.
    speculative_config: dict | str | None = setting(
        None, section="Scheduling", metavar="JSON",
        help='Speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' proposes the tokens that followed the last n-gram\'s '
             "previous occurrence and verifies them in one step (same output; faster on text that repeats its "
             'context); "disable_by_batch_size": N (default 8) decodes plainly while more sequences run (on a CPU '
             "fewer drafts a sequence as more run, none from 16). Default: off.")
    trust_remote_code: bool = setting(
        False, section="Model",
        help="Allow Python code shipped in the model folder to run (off: transformers' own architectures only).")
    tensor_parallel_size: int = setting(  # ranks sharing the model; > 1 needs RANK/WORLD_SIZE/MASTER_* env
        1, at_least=1, no_flag="--num-shard, which each command reads itself")
    # auto: the model folder's safetensors weights; dummy: random weights from its config.json alone, or a shape
    # shipped with fp8kv by name (benchmarks at a real model's size without its checkpoint; fp8cache/model/dummy.py)
    load_format: Literal["auto", "dummy"] = setting(
        "auto", section="Model",
        help="auto: the model folder's safetensors weights. dummy: random weights made on the device from config.json "
             "alone, for benchmarks at a model's real size without its checkpoint; MODEL may then be a folder with "
             "only a config (and a tokenizer) or a shape fp8kv ships: {shapes}.")
    # Request defaults (vLLM's flags): auto = the model folder's generation_config.json, vllm/none = fp8kv's
    # neutral ones, or a folder holding a generation_config.json; the override (a dict or JSON object text)
    # replaces single fields (fp8cache/engine/generation_defaults.py).
    generation_config: str = setting(
        "auto", section="Sampling", metavar="auto|vllm|FOLDER",
        help="Request defaults, as vLLM's flag: auto = the model folder's generation_config.json (its temperature, "
             "top_p, top_k, min_p, repetition_penalty and max_new_tokens fill what a request leaves out); vllm or "
             "none = fp8kv's neutral defaults (temperature 1, no top-p/top-k); or a folder holding a "
             "generation_config.json. A request's own field always wins; TGI's routes sample as TGI does (greedy "
             "unless asked).")
    override_generation_config: dict | str | None = setting(
        None, section="Sampling", metavar="JSON",
        help="JSON object replacing single fields of those defaults, e.g. '{\"temperature\": 0}' for reproducible "
             "answers to requests without sampling fields.")

    def __post_init__(self) -> None:
        for name, choices in field_choices().items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name}={value!r} is not known; valid choices: "
                                 + ", ".join("None" if c is None else str(c) for c in choices))
        for name, (least, optional) in _at_least().items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}={value!r} must be an integer >= {least}" + (" (or None)" if optional else ""))
        self.kv_cache_dtype_skip_layers = layer_ids(self.kv_cache_dtype_skip_layers)
        for name in (f.name for f in fields(self) if f.metadata["share"]):
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


@functools.cache
def _at_least() -> dict[str, tuple[int, bool]]:
    """{integer field: (its smallest valid value, whether None is allowed)}, from setting(at_least=)."""
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: (f.metadata["at_least"], type(None) in typing.get_args(hints[f.name]))
            for f in fields(EngineConfig) if f.metadata["at_least"] is not None}


@functools.cache
def field_choices() -> dict[str, tuple]:
    """{field: its valid values} for every field typed with a Literal (None too for an optional one): what the
    command line offers for its flag."""
    hints = typing.get_type_hints(EngineConfig)
    found = {f.name: literal_choices(hints[f.name]) for f in fields(EngineConfig)}
    return {name: choices for name, choices in found.items() if choices}


def literal_choices(hint: object) -> tuple:
    """The values a Literal type hint allows (None too for an optional one); () for any other hint."""
    options = [hint, *typing.get_args(hint)] if typing.get_origin(hint) is typing.Union else [hint]
    literal = [a for o in options if typing.get_origin(o) is Literal for a in typing.get_args(o)]
    if not literal:
        return ()
    return (*literal, *([None] if type(None) in typing.get_args(hint) else []))
