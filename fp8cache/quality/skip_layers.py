"""Which layers to keep in 16 bits (issue 54 part 3, `fp8kv calibrate --skip-layers-kl-budget`): the smallest set of
layers, taken greedily by their K/V quantization error, whose skipping (kv_cache_dtype_skip_layers) brings the
model's KL against the auto cache under a budget.

Layers are ranked by one of two measures, largest first: "error" (the default, free) is `fp8kv eval --per-layer`'s
relative MSE of each layer's dequantized K plus V, measured beside the cache write on the same windows; "kl" is each
layer's own KL, measured with only that layer in FP8 (one more run per layer: slower, but it sees what the error
misses, such as how sharply a layer attends). Layers are then added in that order and the KL is measured again with
each set (decode-faithful, as `fp8kv eval` scores it) until it is within the budget: each step is confirmed by a
measurement, not predicted. The auto cache's log-probabilities are computed once.
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
RANKINGS = ("error", "kl")


@dataclass(frozen=True)
class Trial:
    skip_layers: tuple[int, ...]
    kl: float


@dataclass
class SkipLayersSuggestion:
    kl_budget: float
    tokens: int  # scored per trial
    ranked_by: str  # one of RANKINGS
    ranking: list[tuple[int, float]]  # (layer, K + V relative MSE or its own KL), largest first
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
                        on_trial: Callable[[Trial], None] | None = None,
                        rank_by: str = "error") -> SkipLayersSuggestion:
    """The layers of config's FP8 cache (static or dynamic scales) to keep in the model dtype for a mean per-token KL against
    the auto cache of at most kl_budget, over `windows` windows of window_len tokens (default: 512 or the model's
    limit) of the evaluation text (eval.locate_eval_text), taken in the order `rank_by` (RANKINGS) gives."""
    if rank_by not in RANKINGS:
        raise ValueError(f"rank_by={rank_by!r} is not one of {', '.join(RANKINGS)}")
    if isinstance(kl_budget, bool) or not isinstance(kl_budget, (int, float)) or not kl_budget > 0 \
            or math.isinf(kl_budget):
        raise ValueError(f"KL budget {kl_budget!r} must be a number > 0, e.g. 0.005")
    if windows < 1:
        raise ValueError(f"windows={windows} must be >= 1")
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
        return Trial(skip, kl / sum(len(ids) - 1 for ids in texts))

    def tried(trial: Trial) -> Trial:
        if on_trial is not None:
            on_trial(trial)
        return trial

    plain = runner(config.kv_cache_dtype)
    plain.saturation.sample_every, plain.saturation.measure_error = 1, True
    trials = [tried(measure((), plain))]
    if rank_by == "error":
        ranking = _error_ranking(plain)
    else:
        layers = range(hf.num_hidden_layers)
        alone = {i: measure(tuple(j for j in layers if j != i)).kl for i in layers}
        ranking = sorted(alone.items(), key=lambda item: (-item[1], item[0]))
    del plain
    suggestion = SkipLayersSuggestion(kl_budget, sum(len(ids) - 1 for ids in texts), rank_by, ranking, trials)
    for layer, _ in ranking:
        if suggestion.within_budget:
            break
        trials.append(tried(measure(tuple(sorted((*suggestion.skip_layers, layer))))))
    return suggestion


def _windows(loaded: LoadedModel, text_path: str | None, windows: int, window_len: int) -> list[list[int]]:
    tokens = loaded.tokenizer(read_text(locate_eval_text(text_path)))["input_ids"]
    if len(tokens) < windows * window_len:
        raise ValueError(f"the evaluation text has {len(tokens)} tokens, fewer than {windows} windows of "
                         f"{window_len}; give a longer text or fewer windows")
    return [tokens[w * window_len:(w + 1) * window_len] for w in range(windows)]


def _log_probs(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(runner.execute(runner_batch(ids, runner), all_logits=True)[:-1], -1)


def _error_ranking(runner: ModelRunner) -> list[tuple[int, float]]:
    """(layer, K + V relative MSE) of the runner's counted writes, largest error first."""
    errors: dict[int, float] = {}
    for row in runner.saturation_counts():
        errors[row.layer] = errors.get(row.layer, 0.0) + (row.relative_mse or 0.0)
    return sorted(errors.items(), key=lambda item: (-item[1], item[0]))
