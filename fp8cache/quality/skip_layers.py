"""Which layers to keep in 16 bits (issue 54 part 3, `fp8kv calibrate --skip-layers-kl-budget`): the smallest set of
layers, taken greedily by their K/V quantization error, whose skipping (kv_cache_dtype_skip_layers) brings the
model's KL against the auto cache under a budget.

The per-layer error is `fp8kv eval --per-layer`'s: the relative MSE of each layer's dequantized K and V, measured
beside the cache write on the same windows. Layers are added in order of K + V error, largest first, and the KL is
measured again with each set (decode-faithful, as `fp8kv eval` scores it), until it is within the budget: each
step is confirmed by a measurement, not predicted. The auto cache's log-probabilities are computed once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from fp8cache.config import EngineConfig
from fp8cache.kvcache import formats
from fp8cache.model.loader import LoadedModel, load_model
from fp8cache.model.runner import ModelRunner
from fp8cache.platform.device import resolve_device
from fp8cache.quality.eval import locate_eval_text, read_text, runner_batch, window_config

DEFAULT_WINDOWS = 2
DEFAULT_WINDOW_LEN = 512


@dataclass(frozen=True)
class Trial:
    skip_layers: tuple[int, ...]
    kl: float


@dataclass
class SkipLayersSuggestion:
    kl_budget: float
    tokens: int  # scored per trial
    layer_errors: list[tuple[int, float]]  # (layer, K + V relative MSE), largest first
    trials: list[Trial] = field(default_factory=list)  # the first skips no layer

    @property
    def skip_layers(self) -> tuple[int, ...]:
        return self.trials[-1].skip_layers

    @property
    def kl(self) -> float:
        return self.trials[-1].kl

    @property
    def within_budget(self) -> bool:
        return self.kl <= self.kl_budget

    @property
    def flag(self) -> str:
        """What to pass to `fp8kv run` ("" when no layer needs skipping)."""
        return f"--kv-cache-dtype-skip-layers {','.join(map(str, self.skip_layers))}" if self.skip_layers else ""


def suggest_skip_layers(config: EngineConfig, kl_budget: float, text_path: str | None = None,
                        windows: int = DEFAULT_WINDOWS, window_len: int | None = None,
                        log: Callable[[str], None] = lambda msg: None, loaded: LoadedModel | None = None,
                        on_trial: Callable[[Trial], None] | None = None) -> SkipLayersSuggestion:
    """The layers of config's FP8 cache (static scales) to keep in the model dtype for a mean per-token KL against
    the auto cache of at most kl_budget, over `windows` windows of window_len tokens (default: 512 or the model's
    limit) of the evaluation text (eval.locate_eval_text)."""
    if isinstance(kl_budget, bool) or not isinstance(kl_budget, (int, float)) or not kl_budget > 0 \
            or math.isinf(kl_budget):
        raise ValueError(f"KL budget {kl_budget!r} must be a number > 0, e.g. 0.005")
    if windows < 1:
        raise ValueError(f"windows={windows} must be >= 1")
    if config.kv_scales != "static":
        raise ValueError("the layers to skip are chosen by their static-scale quantization error; dynamic scales "
                         "have none to measure (use --kv-scales static with a scales file)")
    config = replace(config, device=str(resolve_device(config.device)), kv_cache_dtype_skip_layers=(),
                     enable_prefix_caching=False)
    if formats.resolve_kv_cache_dtype(config.kv_cache_dtype, formats.backend_of(config.device)) == formats.AUTO:
        raise ValueError(f"kv-cache-dtype {config.kv_cache_dtype!r} is not an FP8 cache: no layer to keep in 16 bits")
    loaded = loaded or load_model(config, progress=False)
    hf = loaded.hf_config
    window_len = window_len or min(DEFAULT_WINDOW_LEN, getattr(hf, "max_position_embeddings", DEFAULT_WINDOW_LEN))
    texts = _windows(loaded, text_path, windows, window_len)
    dtype = next(loaded.model.parameters()).dtype

    def runner(kv_cache_dtype: str, skip: tuple[int, ...] = ()) -> ModelRunner:
        wanted = replace(config, kv_cache_dtype_skip_layers=skip)
        return ModelRunner(window_config(wanted, hf, window_len, kv_cache_dtype, dtype), log, loaded)

    baseline = runner("auto")
    base = [_log_probs(baseline, ids) for ids in texts]
    del baseline

    def measure(skip: tuple[int, ...], tested: ModelRunner | None = None) -> Trial:
        tested = tested or runner(config.kv_cache_dtype, skip)
        kl = sum(float((b.exp() * (b - _log_probs(tested, ids))).sum()) for b, ids in zip(base, texts))
        trial = Trial(skip, kl / sum(len(ids) - 1 for ids in texts))
        if on_trial is not None:
            on_trial(trial)
        return trial

    plain = runner(config.kv_cache_dtype)
    plain.saturation.sample_every, plain.saturation.measure_error = 1, True
    trials = [measure((), plain)]
    suggestion = SkipLayersSuggestion(kl_budget, sum(len(ids) - 1 for ids in texts), _ranking(plain), trials)
    del plain
    for layer, _ in suggestion.layer_errors:
        if suggestion.within_budget:
            break
        trials.append(measure(tuple(sorted((*suggestion.skip_layers, layer)))))
    return suggestion


def _windows(loaded: LoadedModel, text_path: str | None, windows: int, window_len: int) -> list[list[int]]:
    tokens = loaded.tokenizer(read_text(locate_eval_text(text_path)))["input_ids"]
    if len(tokens) < windows * window_len:
        raise ValueError(f"the evaluation text has {len(tokens)} tokens, fewer than {windows} windows of "
                         f"{window_len}; give a longer text or fewer windows")
    return [tokens[w * window_len:(w + 1) * window_len] for w in range(windows)]


def _log_probs(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(runner.execute(runner_batch(ids, runner), all_logits=True)[:-1], -1)


def _ranking(runner: ModelRunner) -> list[tuple[int, float]]:
    """(layer, K + V relative MSE) of the runner's counted writes, largest error first."""
    errors: dict[int, float] = {}
    for row in runner.saturation_counts():
        errors[row.layer] = errors.get(row.layer, 0.0) + (row.relative_mse or 0.0)
    return sorted(errors.items(), key=lambda item: (-item[1], item[0]))
