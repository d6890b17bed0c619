"""Engine configuration: one place for the knobs that LLM(), `fp8kv run`, eval and bench share."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_KV_RECENT_WINDOW = 32


@dataclass
class EngineConfig:
    model: str | None = None  # a folder, a hub id (org/name), or None: the embedded default model (docs/design.md section 6)
    revision: str | None = None  # hub ids: the branch, tag or commit (None: main)
    download_dir: str | None = None  # hub ids: the Hugging Face cache folder to use (None: $HF_HOME/hub)
    tokenizer: str | None = None  # None: same folder as the model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: the faster of float32 and bfloat16 on a CPU, the checkpoint's 16-bit dtype on a GPU)
    kv_cache_dtype: str = "auto"
    quantization_param_path: str | None = None
    calculate_kv_scales: bool = False
    kv_scales_granularity: str = "tensor"  # tensor | head, for calculate_kv_scales
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
    kv_recent_window_dtype: str = "auto"
    enforce_eager: bool = False  # GPU: run decode steps op by op instead of replaying CUDA graphs (vLLM's name)
    tensor_parallel_size: int = 1  # ranks sharing the model; > 1 needs RANK/WORLD_SIZE/MASTER_* env
    # auto: the model folder's safetensors weights; dummy: random weights from its config.json alone, or a shape
    # shipped with fp8kv by name (benchmarks at a real model's size without its checkpoint; fp8cache/model/dummy.py)
    load_format: str = "auto"
    # Speculative decoding, vLLM's shape: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": m,
    # "prompt_lookup_max": M} (a dict or its JSON text; fp8cache/engine/speculative_config.py). None: off.
    speculative_config: dict | str | None = None
