"""`fp8kv calibrate`: KV cache scales measured on the unquantized model (docs/design.md section 3).

The model runs in its own dtype with transformers' SDPA attention; a thin attention function in front of it
sees post-RoPE K and V of every layer (rotated first when a kv rotation is asked, since the cache then holds
rotated K/V) and records, per layer and KV head, the absolute maximum over all tokens and a fixed-seed
subsample of tokens. The scale of each layer (and head) then comes from one statistic:

- "amax":       absolute maximum -> the format's largest value (never saturates on the calibration data);
- "percentile": the PERCENTILE-th percentile of |x| -> the largest value (clips rare outliers);
- "mse":        the scale, on a grid of SEARCH_STEPS per octave from one octave above the amax scale to
                two below, that minimises the squared quantization error of the subsample.

Which one is the default was decided by measuring KL on held-out text: see docs/kv-cache-quality.md.

With a rotation the file must also serve readers that know no rotation (vLLM's plain `scaling_factor`,
docs/design.md section 3), and they quantize UNROTATED K/V. So the absolute maxima of the unrotated K/V are recorded
too, and the same statistic, per tensor, on the unrotated subsample (the rotated one rotated back: H is its
own inverse) gives each layer's `unrotated_scales` value: the larger of K's and V's.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from fp8cache.config import EngineConfig
from fp8cache.kvcache import formats, rotation, scale_files
from fp8cache.kvcache import scales as kv_scales

STATISTICS = ("amax", "percentile", "mse")
DEFAULT_STATISTIC = "mse"
PERCENTILE = 99.99
SEARCH_STEPS = 16  # candidate scales per octave in the mse search
DEFAULT_MAX_SEQ_LEN = 512
SAMPLE_TOKENS = 2048  # tokens per layer kept for the percentile and mse statistics
ATTENTION_NAME = "fp8kv_calibrate"
# Fewer tokens than this (unless --num-samples x --max-seq-len asks for fewer) means the wrong file, not a
# calibration: a few tokens see a sliver of each head's range and give scales that saturate in use.
MIN_CALIBRATION_TOKENS = 128
_DATASET_KINDS = ("give a .txt file, a .jsonl file with a \"text\" or \"messages\" object per line, or a .json "
                  "list of such objects")
SCALES_FILE_IN_CHECKPOINT = "kv_cache_scales.safetensors"


class CalibrationError(ValueError):
    """Calibration input that cannot be used; the message names the problem and the fix."""


# ---------------------------------------------------------------------------------------------------
# Calibration samples

def read_samples(path: str | None, tokenizer: object, num_samples: int, max_seq_len: int) -> list[list[int]]:
    """Token ids of up to `num_samples` samples of at most `max_seq_len` tokens from a .txt, .jsonl or .json
    file; None: the second half of the evaluation text (fp8cache.quality.eval.locate_eval_text), which `fp8kv eval`
    and the bench prompts do not reach, so scales are never judged on the text they were made from.

    Text files are tokenized as one stream and cut into consecutive windows; JSON lines (or a .json list)
    give one sample per record, from its "text" or its chat "messages" (rendered with the tokenizer's chat
    template). Refuses data that yields fewer than MIN_CALIBRATION_TOKENS tokens (or the whole request, if
    smaller)."""
    if num_samples < 1 or max_seq_len < 2:
        raise CalibrationError(f"need num_samples >= 1 and max_seq_len >= 2, got {num_samples} and {max_seq_len}")
    if path is None:
        samples = _text_samples(_default_text(), tokenizer, num_samples, max_seq_len)
        name = f"the second half of {_default_text_path()}"
    else:
        if not os.path.isfile(path):
            raise CalibrationError(f"dataset {path!r} does not exist or is not a file; {_DATASET_KINDS}")
        lower = path.lower()
        if lower.endswith(".jsonl"):
            samples = list(_jsonl_samples(path, tokenizer, num_samples, max_seq_len))
        elif lower.endswith(".json"):
            samples = _json_samples(path, tokenizer, num_samples, max_seq_len)
        else:
            samples = _text_samples(_read_dataset_text(path), tokenizer, num_samples, max_seq_len)
        name = repr(path)
    if not samples:
        raise CalibrationError(f"dataset {name} holds no text to calibrate on")
    total, needed = sum(len(s) for s in samples), min(MIN_CALIBRATION_TOKENS, num_samples * max_seq_len)
    if total < needed:
        raise CalibrationError(f"dataset {name} gives only {total} tokens, too few to measure K/V ranges: "
                               f"calibration needs at least {needed} (it asks for up to {num_samples} samples "
                               f"x {max_seq_len} tokens); give more text, or leave out --dataset to use the "
                               "shipped WikiText-2 text")
    return samples


def _default_text_path() -> str:
    from fp8cache.quality.eval import locate_eval_text

    return locate_eval_text()


def _default_text() -> str:
    from fp8cache.quality.eval import read_text

    text = read_text(_default_text_path())
    # From the first line start past the middle: eval windows and bench prompts are cut from the beginning.
    middle = text.find("\n", len(text) // 2) + 1
    return text[middle:]


def _read_dataset_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError:
        raise CalibrationError(f"dataset {path!r} is not UTF-8 text; {_DATASET_KINDS}") from None


def _text_samples(text: str, tokenizer: object, num_samples: int, max_seq_len: int) -> list[list[int]]:
    wanted = num_samples * max_seq_len
    # Tokenizing a prefix that surely holds enough tokens keeps huge files cheap (a token is < 8 chars).
    ids = tokenizer(text[:wanted * 8])["input_ids"]
    if len(ids) < wanted and len(text) > wanted * 8:
        ids = tokenizer(text)["input_ids"]
    windows = [ids[i:i + max_seq_len] for i in range(0, min(len(ids), wanted), max_seq_len)]
    return [w for w in windows if len(w) >= 2]


def _jsonl_samples(path: str, tokenizer: object, num_samples: int, max_seq_len: int) -> Iterator[list[int]]:
    taken = 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if taken == num_samples:
                return
            if not line.strip():
                continue
            where = f"dataset {path}, line {number}"
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                raise CalibrationError(f"{where}: not valid JSON ({_json_problem(e)}); each line must be one "
                                       "JSON object") from None
            ids = _record_ids(where, record, tokenizer, line.strip())[:max_seq_len]
            if len(ids) >= 2:
                taken += 1
                yield ids


def _json_samples(path: str, tokenizer: object, num_samples: int, max_seq_len: int) -> list[list[int]]:
    try:
        doc = json.loads(_read_dataset_text(path))
    except (json.JSONDecodeError, RecursionError) as e:
        raise CalibrationError(f"dataset {path!r} ends in .json but is not valid JSON ({_json_problem(e)}); "
                               f"{_DATASET_KINDS} (one object per line is .jsonl: rename the file)") from None
    records = doc if isinstance(doc, list) else [doc]
    samples = []
    for number, record in enumerate(records):
        if len(samples) == num_samples:
            break
        ids = _record_ids(f"dataset {path}, item {number}", record, tokenizer)[:max_seq_len]
        if len(ids) >= 2:
            samples.append(ids)
    return samples


def _json_problem(e: Exception) -> str:
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def _record_ids(where: str, record: object, tokenizer: object, shown: str | None = None) -> list[int]:
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return tokenizer(record["text"])["input_ids"]
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        return _chat_ids(where, record["messages"], tokenizer)
    # reprlib bounds the depth: a parsed record can be nested far deeper than repr() recurses.
    raise CalibrationError(f"{where}: expected an object with a \"text\" string or a \"messages\" list, got "
                           f"{(shown if shown is not None else reprlib.repr(record))[:60]}")


def _chat_ids(where: str, messages: list, tokenizer: object) -> list[int]:
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise CalibrationError(f"{where}: chat \"messages\" need a tokenizer with a chat template; this one "
                               "has none: give \"text\" records instead")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise CalibrationError(f"{where}: each message must be {{\"role\": str, \"content\": str}}, got "
                                   f"{json.dumps(m)[:60]}")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except TemplateError as e:
        raise CalibrationError(f"{where}: the model's chat template cannot render these messages ({e}); "
                               "give \"text\" records instead") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------------
# Statistics of post-RoPE K and V

class KVStatistics:
    """Per layer, separately for K and V: per-head absolute maximum and a token subsample [n, heads, d]."""

    def __init__(self, num_layers: int, tokens_per_sample: int, seed: int = 0):
        self.k_amax: list[torch.Tensor | None] = [None] * num_layers
        self.v_amax: list[torch.Tensor | None] = [None] * num_layers
        self._k_parts: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._v_parts: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.tokens_per_sample = max(1, tokens_per_sample)
        self._generator = torch.Generator().manual_seed(seed)
        self.rotation = rotation.NONE  # the kv rotation applied to K/V before `observe`
        # With a rotation: per-head absolute maxima of the K/V before it (see observe_unrotated).
        self.k_amax_unrotated: list[torch.Tensor | None] = [None] * num_layers
        self.v_amax_unrotated: list[torch.Tensor | None] = [None] * num_layers

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, head_size] of one sample."""
        k, v = k.detach().to("cpu", torch.float32), v.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(k).all()) or not bool(torch.isfinite(v).all()):
            raise CalibrationError(f"layer {layer} produced non-finite K/V on the calibration data; the model "
                                   "overflows in this dtype: calibrate with --dtype float32")
        self.k_amax[layer] = _running_max(self.k_amax[layer], k.abs().amax(dim=(0, 2)))
        self.v_amax[layer] = _running_max(self.v_amax[layer], v.abs().amax(dim=(0, 2)))
        keep = torch.randperm(k.shape[0], generator=self._generator)[:self.tokens_per_sample]
        self._k_parts[layer].append(k[keep])
        self._v_parts[layer].append(v[keep])

    def observe_unrotated(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, head_size] of one sample before the rotation (absolute maxima only)."""
        k, v = k.detach().to("cpu", torch.float32), v.detach().to("cpu", torch.float32)
        self.k_amax_unrotated[layer] = _running_max(self.k_amax_unrotated[layer], k.abs().amax(dim=(0, 2)))
        self.v_amax_unrotated[layer] = _running_max(self.v_amax_unrotated[layer], v.abs().amax(dim=(0, 2)))

    def unrotated_samples(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V subsamples as they were before the rotation."""
        return (rotation.apply_rotation(self.k_samples(layer), self.rotation),
                rotation.apply_rotation(self.v_samples(layer), self.rotation))

    def k_samples(self, layer: int) -> torch.Tensor:
        return torch.cat(self._k_parts[layer])

    def v_samples(self, layer: int) -> torch.Tensor:
        return torch.cat(self._v_parts[layer])

    def check_complete(self) -> None:
        missing = [i for i, a in enumerate(self.k_amax) if a is None]
        if missing:
            raise RuntimeError(f"calibration saw no K/V for layers {missing}: the model does not route every "
                               "attention layer through transformers' AttentionInterface")


def _running_max(current: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if current is None else torch.maximum(current, new)


# The keyword argument under which the statistics ride through the model's forward down to attention.
STATS_KWARG = "fp8kv_statistics"


def _observing_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    stats = kwargs.pop(STATS_KWARG, None)
    if stats is None:
        raise RuntimeError(f"attention {ATTENTION_NAME!r} runs only inside fp8cache.quality.calibrate.collect_statistics")
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, kv_heads, d], post-RoPE
    if stats.rotation != rotation.NONE:
        stats.observe_unrotated(module.layer_idx, k, v)
        k, v = rotation.apply_rotation(k, stats.rotation), rotation.apply_rotation(v, stats.rotation)
    stats.observe(module.layer_idx, k, v)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def collect_statistics(model: torch.nn.Module, samples: list[list[int]], kv_rotation: str = "none",
                       on_sample: Callable[[int], None] | None = None) -> KVStatistics:
    """Run `model` unquantized over `samples` (one at a time) and record post-RoPE K/V statistics."""
    from transformers import AttentionInterface

    cfg = model.config
    num_heads = cfg.num_attention_heads
    head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    device = next(model.parameters()).device
    stats = KVStatistics(cfg.num_hidden_layers, SAMPLE_TOKENS // len(samples))
    rotation.rotation_matrix(kv_rotation, head_size)  # refuses unknown names and head sizes before the run
    stats.rotation = kv_rotation
    AttentionInterface.register(ATTENTION_NAME, _observing_attention)
    model.set_attn_implementation(ATTENTION_NAME)
    with torch.inference_mode():
        for ids in samples:
            model(input_ids=torch.tensor([ids]).to(device), use_cache=False, logits_to_keep=1, **{STATS_KWARG: stats})
            if on_sample is not None:
                on_sample(len(ids))
    stats.check_complete()
    return stats


# ---------------------------------------------------------------------------------------------------
# Scales from statistics

def choose_scale(amax: torch.Tensor, samples: torch.Tensor, fmt: formats.Fp8Format, granularity: str,
                 statistic: str) -> torch.Tensor:
    """float32 scale [1] or [heads] from per-head `amax` [heads] and `samples` [n, heads, d]."""
    if granularity == "tensor":
        groups = [(amax.max(), samples)]
    else:
        groups = [(amax[h], samples[:, h]) for h in range(amax.numel())]
    values = [_group_scale(float(a), x.reshape(-1), fmt, statistic) for a, x in groups]
    return torch.tensor(values, dtype=torch.float32).clamp(min=kv_scales.MIN_SCALE)


def _group_scale(amax: float, x: torch.Tensor, fmt: formats.Fp8Format, statistic: str) -> float:
    if amax == 0.0:
        return kv_scales.MIN_SCALE  # a head that is always zero: any scale stores it exactly
    if statistic == "amax":
        return amax / fmt.max
    if statistic == "percentile":
        top = float(torch.quantile(x.abs(), PERCENTILE / 100))
        return (top or amax) / fmt.max  # a mostly-zero head falls back to its maximum
    if statistic == "mse":
        return mse_scale(amax, x, fmt)
    raise CalibrationError(f"unknown statistic {statistic!r}; valid: {', '.join(STATISTICS)}")


def mse_scale(amax: float, x: torch.Tensor, fmt: formats.Fp8Format) -> float:
    """The candidate scale with the least squared quantization error of `x` (ties: the largest scale)."""
    steps = torch.arange(-SEARCH_STEPS, 2 * SEARCH_STEPS + 1, dtype=torch.float64)
    candidates = (amax / fmt.max) * torch.pow(2.0, -steps / SEARCH_STEPS)
    x = x.to(torch.float32)
    errors = []
    for s in candidates.to(torch.float32):
        stored = torch.clamp(x / s, -fmt.max, fmt.max).to(fmt.torch_dtype).to(torch.float32)
        errors.append(float((stored * s - x).double().pow(2).sum()))
    best = min(range(len(errors)), key=lambda i: (errors[i], i))
    return float(candidates[best])


def scales_from_statistics(stats: KVStatistics, kv_cache_dtype: str, granularity: str, statistic: str,
                           kv_rotation: str, source: str) -> kv_scales.KVScales:
    fmt = formats.FP8_FORMATS[kv_cache_dtype]
    if granularity not in kv_scales.GRANULARITIES:
        raise CalibrationError(f"unknown granularity {granularity!r}; valid: {', '.join(kv_scales.GRANULARITIES)}")
    k = [choose_scale(stats.k_amax[i], stats.k_samples(i), fmt, granularity, statistic)
         for i in range(len(stats.k_amax))]
    v = [choose_scale(stats.v_amax[i], stats.v_samples(i), fmt, granularity, statistic)
         for i in range(len(stats.v_amax))]
    unrotated = None
    if kv_rotation != rotation.NONE:
        unrotated = [unrotated_scale(stats, i, fmt, statistic) for i in range(len(stats.k_amax))]
    return kv_scales.KVScales(k, v, kv_cache_dtype, source, kv_rotation, unrotated)


def unrotated_scale(stats: KVStatistics, layer: int, fmt: formats.Fp8Format, statistic: str) -> float:
    """One scale for the layer's unrotated K and V (the plain vLLM scaling_factor of a rotated file): the
    statistic per tensor on each, then the larger, so that neither saturates more than the statistic lets."""
    if stats.k_amax_unrotated[layer] is None:
        raise RuntimeError(f"calibration recorded no unrotated K/V for layer {layer}; collect the statistics "
                           "with collect_statistics(..., kv_rotation=...)")
    k, v = stats.unrotated_samples(layer)
    return max(float(choose_scale(stats.k_amax_unrotated[layer], k, fmt, "tensor", statistic)[0]),
               float(choose_scale(stats.v_amax_unrotated[layer], v, fmt, "tensor", statistic)[0]))


# ---------------------------------------------------------------------------------------------------
# The whole calibration

@dataclass
class CalibrationResult:
    scales: kv_scales.KVScales
    k_amax: list[torch.Tensor]  # per layer, [num_kv_heads], after the rotation if any
    v_amax: list[torch.Tensor]
    statistic: str
    granularity: str
    num_samples: int
    num_tokens: int
    model_path: str
    model_type: str
    num_kv_heads: int
    # With a rotation: per layer, [num_kv_heads] absolute maxima of the K/V before it (None without).
    k_amax_unrotated: list[torch.Tensor] | None = None
    v_amax_unrotated: list[torch.Tensor] | None = None


def calibrate(model: str | None, dataset: str | None = None, kv_cache_dtype: str = "fp8", num_samples: int = 32,
              max_seq_len: int | None = None, granularity: str = "head", kv_rotation: str = "none",
              statistic: str = DEFAULT_STATISTIC, dtype: str = "auto", device: str = "auto",
              tokenizer: str | None = None, trust_remote_code: bool = False, progress: bool = False,
              on_samples: Callable[[int], Callable[[int], None]] | None = None, revision: str | None = None,
              download_dir: str | None = None) -> CalibrationResult:
    """Scales for `model` from `dataset` (None: the default text of read_samples). max_seq_len None: DEFAULT_MAX_SEQ_LEN or the model's limit if lower.
    `on_samples(n)` is told the sample count and returns a per-sample callback (given the sample's token
    count), e.g. to drive a progress bar."""
    from fp8cache.model.loader import load_model

    fmt_name = formats.resolve_kv_cache_dtype(kv_cache_dtype, formats.backend_of(device))
    if fmt_name == formats.AUTO:
        raise CalibrationError("calibration makes scales for an FP8 cache; choose --kv-cache-dtype fp8, "
                               f"{', '.join(formats.FP8_FORMATS)}")
    if granularity not in kv_scales.GRANULARITIES:
        raise CalibrationError(f"unknown granularity {granularity!r}; valid: {', '.join(kv_scales.GRANULARITIES)}")
    if statistic not in STATISTICS:
        raise CalibrationError(f"unknown statistic {statistic!r}; valid: {', '.join(STATISTICS)}")
    if kv_rotation not in rotation.ROTATIONS:
        raise CalibrationError(f"unknown kv rotation {kv_rotation!r}; valid: {', '.join(rotation.ROTATIONS)}")
    loaded = load_model(EngineConfig(model=model, tokenizer=tokenizer, dtype=dtype, device=device,
                                     trust_remote_code=trust_remote_code, revision=revision,
                                     download_dir=download_dir), progress=progress)
    cfg = loaded.hf_config
    limit = getattr(cfg, "max_position_embeddings", None)
    if max_seq_len is None:
        max_seq_len = min(DEFAULT_MAX_SEQ_LEN, limit or DEFAULT_MAX_SEQ_LEN)
    if limit is not None and max_seq_len > limit:
        raise CalibrationError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                               f"({limit}); use at most {limit}")
    samples = read_samples(dataset, loaded.tokenizer, num_samples, max_seq_len)
    on_sample = on_samples(len(samples)) if on_samples is not None else None
    stats = collect_statistics(loaded.model, samples, kv_rotation, on_sample)
    data = os.path.basename(dataset) if dataset else f"the second half of {os.path.basename(_default_text_path())}"
    source = f"calibrated on {data} ({statistic}, {granularity})"
    scales = scales_from_statistics(stats, fmt_name, granularity, statistic, kv_rotation, source)
    rotated = kv_rotation != rotation.NONE
    return CalibrationResult(scales, list(stats.k_amax), list(stats.v_amax), statistic, granularity,
                             len(samples), sum(len(s) for s in samples), loaded.model_path,
                             getattr(cfg, "model_type", "unknown"),
                             getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                             list(stats.k_amax_unrotated) if rotated else None,
                             list(stats.v_amax_unrotated) if rotated else None)


def write_scales(result: CalibrationResult, path: str) -> None:
    """The docs/design.md section 3 file: vLLM's `scaling_factor` plus fp8kv's per-K/V (and per-head) keys; with a
    rotation, `scaling_factor` holds the unrotated scales and k_/v_scaling_factor the rotated ones."""
    scale_files.write_scales_file(path, result.scales, result.model_type, result.num_kv_heads)


# ---------------------------------------------------------------------------------------------------
# A checkpoint that carries the scales
#
# Written as llm-compressor writes a kv_cache_scheme checkpoint, so that vLLM, SGLang, llm-compressor and
# transformers (with compressed-tensors) read it: config.json's quantization_config (quant_method
# compressed-tensors, a kv_cache_scheme of type float, 8 bits, strategy tensor or attn_head) and, per layer,
# model.layers.<i>.self_attn.k_scale / v_scale of shape [1] or [num_kv_heads, 1, 1] in a safetensors file
# the weight index lists. The weight files are linked, not copied, where the file system allows.

SCALES_FILE_IN_CHECKPOINT = "kv_cache_scales.safetensors"
# compressed-tensors' attn_head strategy (per-head KV scales) first appeared in its 0.13.0.
COMPRESSED_TENSORS_FORMAT_VERSION = "0.13.0"
_SAFETENSORS_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                         "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass
class WrittenCheckpoint:
    path: str
    linked: list[str]  # weight files hard-linked to the model's
    copied: list[str]  # files copied (weights where linking was refused, and the small files)


def kv_cache_scheme(granularity: str) -> dict:
    """compressed-tensors' kv_cache_scheme (QuantizationArgs as it serializes them) for FP8 E4M3 KV scales."""
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
            "strategy": "attn_head" if granularity == "head" else "tensor", "block_structure": None,
            "dynamic": False, "actorder": None, "scale_dtype": None, "zp_dtype": None, "observer": None,
            "observer_kwargs": {}}


def checkpoint_scale_tensors(scales: kv_scales.KVScales, num_kv_heads: int) -> dict[str, torch.Tensor]:
    """model.layers.<i>.self_attn.k_scale / v_scale as compressed-tensors shapes them: [1] per tensor,
    [num_kv_heads, 1, 1] per head (every layer per head when any is)."""
    per_head = scales.per_head()
    tensors = {}
    for i, (k, v) in enumerate(zip(scales.k, scales.v)):
        for kind, t in (("k", k), ("v", v)):
            value = t.detach().to("cpu", torch.float32).reshape(-1)
            value = value.expand(num_kv_heads).reshape(num_kv_heads, 1, 1) if per_head else value.reshape(1)
            tensors[f"model.layers.{i}.self_attn.{kind}_scale"] = value.contiguous()
    return tensors


def write_checkpoint(result: CalibrationResult, out_dir: str) -> WrittenCheckpoint:
    """The model folder at `out_dir` as a compressed-tensors checkpoint carrying the scales (see above).

    Scales are written for E4M3FN, the format compressed-tensors' float 8-bit scheme means (E4M3FNUZ scales are
    halved; E5M2 scales, which it cannot express, are refused). A model whose only weight file is
    model.safetensors gets an index and its weights as model-00001-of-00002.safetensors, since transformers
    reads a lone model.safetensors and never the index."""
    from safetensors.torch import save_file

    from fp8cache.model import checkpoints
    from fp8cache.model.loader import read_scale_tensors

    scales, src = result.scales, result.model_path
    out_dir = os.path.abspath(out_dir)
    if os.path.abspath(src) == out_dir:
        raise CalibrationError(f"--write-checkpoint {out_dir} is the model folder itself; give a new folder")
    check_checkpoint_target(out_dir, scales.rotation, scales.fmt_name)
    existing = sorted(read_scale_tensors(src))
    if existing:
        raise CalibrationError(f"the model already carries KV scales ({existing[0]}, ...); write the checkpoint "
                               "from weights without KV scales")
    config = checkpoints.read_config(src)
    quant = _checkpoint_quantization(config, scales.per_head())
    e4m3 = scales.for_format("fp8_e4m3")
    tensors = checkpoint_scale_tensors(e4m3, result.num_kv_heads)
    weights = checkpoints.weight_files(src)
    single = [os.path.basename(w) for w in weights] == ["model.safetensors"]
    names = {w: ("model-00001-of-00002.safetensors" if single else os.path.basename(w)) for w in weights}
    scales_file = "model-00002-of-00002.safetensors" if single else SCALES_FILE_IN_CHECKPOINT
    os.makedirs(out_dir, exist_ok=True)
    linked, copied = [], []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not os.path.isfile(path) or name.startswith(".") or name in ("config.json", "model.safetensors.index.json",
                                                                        checkpoints.MODELOPT_FILE):
            continue
        if path in names:
            target = os.path.join(out_dir, names[path])
            (linked if _link_or_copy(path, target) else copied).append(names[path])
        elif not name.endswith(".safetensors"):  # small files are copied: editing one must not edit the model's
            shutil.copy2(path, os.path.join(out_dir, name))
            copied.append(name)
    save_file(tensors, os.path.join(out_dir, scales_file), metadata={"format": "pt"})
    _write_index(out_dir, src, weights, names, scales_file, tensors)
    config["quantization_config"] = quant
    config["kv_cache_torch_dtype"] = formats.FP8_FORMATS["fp8_e4m3"].scale_file_dtype  # TGI's key
    _write_json(os.path.join(out_dir, "config.json"), config)
    return WrittenCheckpoint(out_dir, linked, copied)


def _checkpoint_quantization(config: dict, per_head: bool) -> dict:
    """config.json's quantization_config with the KV scheme: a new compressed-tensors one, or the model's own
    compressed-tensors config (FP8 weights) with kv_cache_scheme added."""
    quant = config.get("quantization_config")
    scheme = kv_cache_scheme("head" if per_head else "tensor")
    if quant is None:
        return {"config_groups": {}, "format": "dense", "global_compression_ratio": None, "ignore": [],
                "kv_cache_scheme": scheme, "quant_method": "compressed-tensors", "quantization_status": "compressed",
                "sparsity_config": {}, "transform_config": {}, "version": COMPRESSED_TENSORS_FORMAT_VERSION}
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors":
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise CalibrationError(f"--write-checkpoint writes a compressed-tensors checkpoint, and this model's weights "
                               f"are quantized by {method!r}, which cannot carry its KV scheme; write the scales "
                               "file (--output) and serve with --quantization-param-path")
    return {**quant, "kv_cache_scheme": scheme}


def _link_or_copy(src: str, dst: str) -> bool:
    """Hard-link dst to src (True), or copy it where the file system refuses links (False)."""
    try:
        os.link(os.path.realpath(src), dst)
        return True
    except OSError:
        shutil.copy2(src, dst)
        return False


def _write_index(out_dir: str, src: str, weights: list[str], names: dict[str, str], scales_file: str,
                 tensors: dict[str, torch.Tensor]) -> None:
    from fp8cache.model import checkpoints

    inventory = checkpoints.inventory(src)
    weight_map = {name: names[info.file] for name, info in inventory.items()}
    weight_map.update({name: scales_file for name in tensors})
    total = sum(math.prod(info.shape) * _SAFETENSORS_ITEMSIZE.get(info.dtype, 4) for info in inventory.values())
    total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)


def _write_json(path: str, doc: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")


def check_output_target(path: str, force: bool = False) -> None:
    """Refuse, before calibrating, a scales file that could not be written or would replace another."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CalibrationError(f"--output {path}: the folder {folder} does not exist; create it first, or write "
                               "the scales elsewhere")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CalibrationError(f"--output {path}: the folder {folder} is not writable; write the scales elsewhere")
    if os.path.isdir(path):
        raise CalibrationError(f"--output {path} is a folder; give a file name such as scales.json")
    if os.path.lexists(path) and not force:
        raise CalibrationError(f"--output {path} exists; pass --force to replace it, or give another file name "
                               "(nothing was overwritten)")


def check_checkpoint_target(out_dir: str, kv_rotation: str, kv_cache_dtype: str | None = None) -> None:
    """Refuse a checkpoint request before calibrating rather than after."""
    if kv_rotation != "none":
        raise CalibrationError("--write-checkpoint cannot carry scales made with --kv-rotation "
                               f"{kv_rotation}: checkpoint scales have no rotation field, and other engines "
                               "would apply them to unrotated K/V; use the scales file (--output) instead")
    if kv_cache_dtype == "fp8_e5m2":
        raise CalibrationError("--write-checkpoint writes compressed-tensors' FP8 KV scheme, which means E4M3 scales; "
                               "calibrate the checkpoint with --kv-cache-dtype fp8_e4m3 (or fp8), and keep E5M2 "
                               "scales in the scales file (--output)")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise CalibrationError(f"--write-checkpoint {os.path.abspath(out_dir)} exists and is not an empty "
                               "folder; give a new folder (nothing is overwritten)")
