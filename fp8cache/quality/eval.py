"""Quality of an FP8 KV cache against the `auto` cache, "decode-faithful" (docs/design.md section 7).

Each window runs as one prefill through the model runner. Prefill writes K/V into the cache and reads them
back from it, so every position attends to quantized K/V exactly as in generation; with a recent-token window
of N, position i reads positions i-N+1..i in full precision and older ones from FP8, as decode does. The same
weights run
with an `auto` cache for the baseline; we report perplexity of both, the mean per-token KL(baseline || fp8)
and how often the top-1 token agrees.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from fp8cache.config import EngineConfig
from fp8cache.kvcache import formats, sizing
from fp8cache.model.batch import SeqChunk, StepBatch, in_window_ring, window_slot
from fp8cache.model.loader import load_model
from fp8cache.model.runner import ModelRunner
from fp8cache.platform import envs, paths
from fp8cache.platform.device import resolve_device

# WikiText-2's test split ships inside the package (CC BY-SA: its licence notice lies beside it), so eval,
# calibrate and bench work from any install without a download.
SHIPPED_EVAL_TEXT = os.path.join(paths.PACKAGE_DATA, "wikitext-2-raw",
                                 "wiki.test.raw")


def locate_eval_text(text_path: str | None = None) -> str:
    """The evaluation text: the given path, else $FP8KV_EVAL_TEXT, else the WikiText-2 test text shipped in
    the package."""
    if text_path is not None:
        if not os.path.isfile(text_path):
            raise FileNotFoundError(f"evaluation text {text_path!r} does not exist or is not a file; give a UTF-8 "
                                    "text file, or leave it out to use the shipped WikiText-2 test text")
        return text_path
    if envs.eval_text():
        path = envs.eval_text()
        if not os.path.isfile(path):
            raise FileNotFoundError(f"FP8KV_EVAL_TEXT={path!r} is not a file; point it at a UTF-8 text file, "
                                    "or unset it to use the shipped WikiText-2 test text")
        return path
    if not os.path.isfile(SHIPPED_EVAL_TEXT):
        raise FileNotFoundError(f"the WikiText-2 test text that ships with fp8kv is missing ({SHIPPED_EVAL_TEXT}); "
                                "reinstall fp8kv, or give a text file with --text or FP8KV_EVAL_TEXT")
    return SHIPPED_EVAL_TEXT


def read_text(path: str) -> str:
    # newline="" keeps the file's CRLF line ends: its exact bytes decide the token stream.
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def evaluate(config: EngineConfig, text_path: str | None = None, windows: int = 6, window_len: int = 1024,
             progress: bool = True, per_layer: bool = False) -> dict:
    """Quality of config's cache against the auto one over `windows` windows of the text. The result's
    "saturation" rows hold, per layer and for K and V, the values the cache write clipped or flushed to zero
    (static FP8 scales; empty otherwise), with per_layer also their relative MSE after the round trip."""
    if windows < 1 or window_len < 2:
        raise ValueError(f"need windows >= 1 and window_len >= 2, got windows={windows}, "
                         f"window_len={window_len}")
    log = _logger(progress)
    text = read_text(locate_eval_text(text_path))
    config = replace(config, device=str(resolve_device(config.device)))
    loaded = load_model(config, progress=progress)
    tokens = loaded.tokenizer(text)["input_ids"]
    if len(tokens) < windows * window_len:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than windows * window_len = "
                         f"{windows * window_len}; use fewer or shorter windows")
    dtype = next(loaded.model.parameters()).dtype
    baseline = ModelRunner(window_config(config, loaded.hf_config, window_len, "auto", dtype), log, loaded)
    tested = ModelRunner(window_config(config, loaded.hf_config, window_len, config.kv_cache_dtype, dtype), log,
                         loaded)
    if tested.saturation is not None:
        tested.saturation.sample_every = 1  # count every window's writes
        tested.saturation.measure_error = per_layer
    totals = {"nll_base": 0.0, "nll_fp8": 0.0, "kl": 0.0, "agree": 0, "tokens": 0}
    with _progress_bar(progress, windows) as advance:
        for w in range(windows):
            ids = tokens[w * window_len:(w + 1) * window_len]
            _score_window(baseline, tested, ids, totals)
            advance()
    n, spec = totals["tokens"], tested.kv_spec
    return {
        "kv_cache_dtype": spec.cache_dtype_name,
        "ppl": math.exp(totals["nll_fp8"] / n),
        "baseline_ppl": math.exp(totals["nll_base"] / n),
        "kl": totals["kl"] / n,
        "top1_agreement": totals["agree"] / n,
        "tokens": n,
        "windows": windows,
        "scales_source": spec.scales_source,
        "kv_recent_window": spec.window_size,
        "kv_recent_window_sinks": spec.window_sinks,
        "kv_cache_dtype_skip_layers": list(spec.skip_layers),
        "kv_recent_window_dtype": str(spec.window_dtype).removeprefix("torch."),
        "device": str(tested.device),
        # per layer and K/V: values written, clipped at the format's max, flushed to zero (none with auto)
        "saturation": [dataclasses.asdict(row) for row in tested.saturation_counts()],
    }


def window_config(config: EngineConfig, hf_config: object, window_len: int, kv_cache_dtype: str,
                   dtype: torch.dtype) -> EngineConfig:
    """The user's config with a cache of exactly one window (slots 0..window_len-1, reused per window)."""
    blocks = -(-window_len // config.block_size)
    backend = formats.backend_of(config.device)
    num_heads = hf_config.num_attention_heads
    shape = (hf_config.num_hidden_layers, getattr(hf_config, "num_key_value_heads", None) or num_heads,
             getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads)
    dynamic = config.kv_scales == "dynamic" and kv_cache_dtype != formats.AUTO
    skipped = len({i for i in config.kv_cache_dtype_skip_layers if i < shape[0]})  # the runner refuses the others
    memory = blocks * config.block_size * sizing.bytes_per_token(*shape, kv_cache_dtype, dtype, backend, dynamic,
                                                                 skipped)
    if kv_cache_dtype != formats.AUTO and config.kv_recent_window != 0:
        # Room for one seat of the recent-token ring at its largest: the runner caps the window (given, or
        # recorded in the scales file) and its sinks at max_model_len = window_len, and its dtype is at most 4 bytes.
        ring = -(-(window_len + min(config.kv_recent_window_sinks, window_len)) // config.block_size)
        memory += ring * config.block_size * sizing.bytes_per_token(*shape, formats.AUTO, torch.float32, backend)
    return replace(config, kv_cache_dtype=kv_cache_dtype, max_model_len=window_len, max_num_seqs=1,
                   kv_cache_memory=memory)


def window_batch(ids: list[int], block_size: int, recent_window: int = 0, ring_blocks: int = 0,
                 window_sinks: int = 0) -> StepBatch:
    """One prefill of the whole window as the only sequence, in blocks 0.. (and recent-token ring blocks
    0..ring_blocks-1 when recent_window > 0, holding the last recent_window positions and the first
    window_sinks)."""
    n = len(ids)
    chunk = SeqChunk(query_len=n, context_len=n, block_table=list(range(-(-n // block_size))))
    batch = StepBatch(token_ids=list(ids), positions=list(range(n)), slot_mapping=list(range(n)), seqs=[chunk])
    if recent_window:
        chunk.window_block_table = list(range(ring_blocks))
        batch.window_slot_mapping = [window_slot(chunk.window_block_table, p, recent_window, block_size, window_sinks)
                                     if in_window_ring(p, n, recent_window, window_sinks) else -1 for p in range(n)]
    return batch


def runner_batch(ids: list[int], runner: ModelRunner) -> StepBatch:
    """window_batch laid out for `runner`'s cache."""
    spec = runner.kv_spec
    return window_batch(ids, spec.block_size, spec.window_size, runner.cache_plan.window_blocks_per_seat,
                        spec.window_sinks)


def _score_window(baseline: ModelRunner, tested: ModelRunner, ids: list[int], totals: dict) -> None:
    base = torch.log_softmax(baseline.execute(runner_batch(ids, baseline), all_logits=True)[:-1], -1)
    fp8 = torch.log_softmax(tested.execute(runner_batch(ids, tested), all_logits=True)[:-1], -1)
    targets = torch.tensor(ids[1:], dtype=torch.long).to(base.device, non_blocking=True)
    totals["nll_base"] += float(-base.gather(1, targets[:, None]).sum())
    totals["nll_fp8"] += float(-fp8.gather(1, targets[:, None]).sum())
    totals["kl"] += float((base.exp() * (base - fp8)).sum())
    totals["agree"] += int((base.argmax(-1) == fp8.argmax(-1)).sum())
    totals["tokens"] += len(ids) - 1


def _logger(progress: bool) -> Callable[[str], None]:
    from fp8cache.platform.log import configure_default_logging, log_function

    configure_default_logging()  # as LLM() does: a handler unless the application set up its own logging
    write = log_function("fp8kv.eval")

    def log(msg: str) -> None:
        # Warnings always show; the rest only with progress output on.
        if progress or msg.startswith("warning"):
            write(msg)

    return log


@contextmanager
def _progress_bar(enabled: bool, total: int) -> Iterator[Callable[[], None]]:
    from fp8cache.platform.log import is_terminal

    if not enabled or not is_terminal(sys.stderr):  # a log file or journald gets the log lines, not a bar
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task("Evaluating windows", total=total)
        yield lambda: bar.advance(task)
