"""`fp8kv calibrate`: flags in, fp8cache.quality.calibrate out, a progress bar and a per-layer table of scales."""

from __future__ import annotations

import dataclasses
import sys

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fp8cache.config import EngineConfig
from fp8cache.kvcache import formats
from fp8cache.kvcache.rotation import ROTATIONS
from fp8cache.kvcache.scales import GRANULARITIES
from fp8cache.quality.calibrate import DEFAULT_STATISTIC, STATISTICS
from launcher.supervisor import owns_its_children

console = Console(stderr=True, soft_wrap=True)


@click.command("calibrate", context_settings={"show_default": True})
@click.argument("model", required=False, metavar="[MODEL]")
@click.option("--dataset", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Calibration text: a .txt file, .jsonl with a \"text\" string or chat \"messages\" per line, "
                   "or a .json list of such objects [default: the second half of the WikiText-2 test text "
                   "shipped with fp8kv ($FP8KV_EVAL_TEXT if set); eval and bench use its start].")
@click.option("--num-samples", type=click.IntRange(min=1), default=32, help="Samples to run through the model.")
@click.option("--max-seq-len", type=click.IntRange(min=2), default=None,
              help="Most tokens per sample [default: 512, or the model's limit if lower].")
@click.option("--granularity", type=click.Choice(GRANULARITIES), default="head",
              help="One scale per layer (tensor) or per layer and KV head (head), separately for K and V.")
@click.option("--kv-rotation", type=click.Choice(ROTATIONS), default="none",
              help="Hadamard-rotate K/Q/V over the head dimension before FP8 (fp8kv only; recorded in the "
                   "file).")
@click.option("--kv-cache-dtype", type=click.Choice([d for d in formats.KV_CACHE_DTYPES if d != formats.AUTO]),
              default="fp8", help="FP8 format the scales are made for.")
@click.option("--statistic", type=click.Choice(STATISTICS), default=DEFAULT_STATISTIC,
              help="amax, a percentile of |x|, or the scale with the least squared error (mse).")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False),
              help="Scales JSON to write (vLLM/aphrodite schema plus fp8kv keys).")
@click.option("--force", is_flag=True, help="Replace an existing --output file.")
@click.option("--write-checkpoint", metavar="DIR", type=click.Path(file_okay=False),
              help="Also write the model as a compressed-tensors checkpoint carrying the scales (kv_cache_scheme; "
                   "k_scale/v_scale in its indexed weights), as llm-compressor does: vLLM, SGLang and "
                   "llm-compressor load it. Weight files are linked, not copied, where the file system allows.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              help="Dtype the model runs in (auto: as fp8kv run picks it).")
@click.option("--device", default="auto", show_default=True,
              help="auto (the first GPU if torch sees one, else the CPU), cpu, cuda or cuda:N.")
@click.option("--tokenizer", metavar="PATH", help="Tokenizer folder, if not the model's.")
@click.option("--kv-recent-window", type=click.IntRange(min=0), default=None,
              help="Record the recent-token window (newest tokens kept in full precision) to use with these scales; "
                   "run/eval/bench take it when not given one.")
@click.option("--skip-layers-kl-budget", type=click.FloatRange(min=0, min_open=True), default=None, metavar="KL",
              help="Also name the fewest layers to keep in 16 bits (--kv-cache-dtype-skip-layers) for a KL against "
                   "the auto cache of at most KL with these scales: layers added in --skip-layers-rank order, each "
                   "set's KL measured on the evaluation text (as fp8kv eval scores it).")
@click.option("--skip-layers-rank", type=click.Choice(["error", "kl"]), default="error",
              help="Order in which --skip-layers-kl-budget tries layers: error = each layer's K/V quantization error "
                   "(eval --per-layer; no extra run), kl = each layer's own KL with only it in FP8 (one run per "
                   "layer; slower, often fewer layers).")
@click.option("--skip-layers-kv-scales", type=click.Choice(["static", "dynamic"]), default="static",
              help="Scales --skip-layers-kl-budget measures the layers with: static = the scales written here, "
                   "dynamic = a scale per token and head (fp8kv run --kv-scales dynamic), which needs no file.")
@click.option("--skip-layers-windows", type=click.IntRange(min=1), default=2,
              help="Windows of the evaluation text (512 tokens, or the model's limit) each KL of "
                   "--skip-layers-kl-budget is measured on.")
@click.option("--trust-remote-code", is_flag=True, help="Allow Python code shipped in the model folder to run.")
@click.option("--revision", metavar="REV", help="Hub ids: the branch, tag or commit to use (default: main).")
@click.option("--download-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="Hub ids: the Hugging Face cache folder to read and download into (default: $HF_HOME/hub).")
@owns_its_children
def calibrate(model: str | None, dataset: str | None, num_samples: int, max_seq_len: int | None,
              granularity: str, kv_rotation: str, kv_cache_dtype: str, statistic: str, output: str, force: bool,
              write_checkpoint: str | None, dtype: str, device: str, tokenizer: str | None,
              kv_recent_window: int | None, skip_layers_kl_budget: float | None, skip_layers_rank: str,
              skip_layers_kv_scales: str, skip_layers_windows: int,
              trust_remote_code: bool, revision: str | None, download_dir: str | None) -> None:
    """Measure KV cache scales of MODEL (default: the embedded model) on a calibration dataset.

    Example: fp8kv calibrate ./my-model --dataset calib.txt --kv-cache-dtype fp8 --output scales.json
    """
    from fp8cache.model.default_model import DefaultModelError
    from fp8cache.quality import calibrate as cal

    try:
        # Everything that can be refused without the model is, before minutes of loading and calibrating.
        cal.check_output_target(output, force)
        if write_checkpoint:
            cal.check_checkpoint_target(write_checkpoint, kv_rotation, kv_cache_dtype)
        with _progress() as on_samples:
            result = cal.calibrate(
                model, dataset, kv_cache_dtype=kv_cache_dtype, num_samples=num_samples, max_seq_len=max_seq_len,
                granularity=granularity, kv_rotation=kv_rotation, statistic=statistic, dtype=dtype,
                device=device, tokenizer=tokenizer, trust_remote_code=trust_remote_code, progress=True,
                on_samples=on_samples, revision=revision, download_dir=download_dir)
        if kv_recent_window is not None:
            result.scales = dataclasses.replace(result.scales, recent_window=kv_recent_window)
        cal.write_scales(result, output)
        checkpoint = cal.write_checkpoint(result, write_checkpoint) if write_checkpoint else None
        Console().print(_table(result))
        fmt = result.scales.fmt_name
        console.print(f"[green]wrote[/] {output}: {result.num_samples} samples, {result.num_tokens} tokens, "
                      f"{fmt}, {result.granularity}, rotation {kv_rotation}", highlight=False)
        suggestion = None
        if skip_layers_kl_budget is not None:
            dynamic = skip_layers_kv_scales == "dynamic"
            engine = EngineConfig(model=model, kv_cache_dtype=fmt, dtype=dtype, device=device, tokenizer=tokenizer,
                                  quantization_param_path=None if dynamic else output,
                                  kv_scales=skip_layers_kv_scales, kv_recent_window=kv_recent_window,
                                  trust_remote_code=trust_remote_code, revision=revision, download_dir=download_dir)
            suggestion = _suggest_skip_layers(engine, skip_layers_kl_budget, skip_layers_windows, skip_layers_rank)
    except (ValueError, OSError, DefaultModelError) as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(2)
    scales = "--kv-scales dynamic" if suggestion and skip_layers_kv_scales == "dynamic" \
        else f"--quantization-param-path {output}"
    run = " ".join(["fp8kv run", *([model] if model else []), f"--kv-cache-dtype {fmt}", scales,
                    *([suggestion.flag] if suggestion and suggestion.flag else [])])
    console.print(f"use it: {run}", highlight=False)
    if checkpoint:
        copied = [n for n in checkpoint.copied if n.endswith(".safetensors")]
        how = f"{len(checkpoint.linked)} weight files linked" + (
            f", {len(copied)} copied (this file system refused links)" if copied else "")
        console.print(f"[green]wrote[/] checkpoint {checkpoint.path} (compressed-tensors kv_cache_scheme, "
                      f"{'attn_head' if result.scales.per_head() else 'tensor'}; {how}): fp8kv run "
                      f"{checkpoint.path} --kv-cache-dtype fp8, or vLLM: LLM(model=..., kv_cache_dtype=\"fp8\")",
                      highlight=False)


def _suggest_skip_layers(engine: EngineConfig, kl_budget: float, windows: int, rank_by: str):
    """suggest_skip_layers with a line per measured set and a closing verdict; the suggestion."""
    from fp8cache.quality.skip_layers import suggest_skip_layers

    def show(trial) -> None:
        which = ",".join(map(str, trial.skip_layers)) or "none"
        console.print(f"layers in 16 bits: {which:<20} KL {trial.kl:.5f}", highlight=False)

    console.print(f"choosing layers to keep in 16 bits for KL <= {kl_budget:g} ({windows} windows of the evaluation "
                  f"text, {engine.kv_scales} scales, ranked by {rank_by})", highlight=False)
    suggestion = suggest_skip_layers(engine, kl_budget, windows=windows, on_trial=show, rank_by=rank_by)
    measure = "K+V relative MSE" if rank_by == "error" else "KL with only that layer in FP8"
    worst = ", ".join(f"{layer} ({value:.2e})" for layer, value in suggestion.ranking[:5])
    console.print(f"largest {measure}: layers {worst}", highlight=False)
    first = suggestion.trials[0].kl
    if not suggestion.skip_layers:
        console.print(f"[green]no layer needs 16 bits[/]: KL {first:.5f} <= {kl_budget:g} with every layer in FP8",
                      highlight=False)
    elif suggestion.within_budget:
        console.print(f"[green]keep layers {','.join(map(str, suggestion.skip_layers))} in 16 bits[/]: KL "
                      f"{first:.5f} -> {suggestion.kl:.5f} <= {kl_budget:g} ({suggestion.tokens} tokens); pass "
                      f"{suggestion.flag}", highlight=False)
    else:
        console.print(f"[yellow]KL {suggestion.kl:.5f} stays above {kl_budget:g} even with every layer in 16 bits[/]"
                      " (the auto cache's own run-to-run difference); raise the budget", highlight=False)
    return suggestion


class _progress:
    """Context manager yielding calibrate's on_samples: a rich bar over samples once their count is known."""

    def __enter__(self):
        self._bar = Progress(TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[tokens]} tokens"), TimeElapsedColumn(), console=console)
        self._bar.__enter__()
        return self._on_samples

    def _on_samples(self, total: int):
        task = self._bar.add_task("calibrating", total=total, tokens=0)
        tokens = 0

        def advance(n: int) -> None:
            nonlocal tokens
            tokens += n
            self._bar.update(task, advance=1, tokens=tokens)

        return advance

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)


def _table(result) -> Table:
    scales = result.scales
    table = Table(title=f"KV scales ({scales.fmt_name}, {result.statistic}, {result.granularity}, rotation "
                        f"{scales.rotation})")
    # With a rotation the scales and maxima are of the rotated K/V; the file's plain vLLM scaling_factor,
    # for readers that know no rotation, is of the unrotated K/V: shown as its own column.
    plain = scales.unrotated_scales
    columns = ["layer", "K scale", "V scale", "K amax", "V amax"] + (["vLLM scale"] if plain else [])
    for col in columns:
        table.add_column(col, justify="right")
    for i, (k, v) in enumerate(zip(scales.k, scales.v)):
        row = [str(i), _values(k), _values(v), _values(result.k_amax[i]), _values(result.v_amax[i])]
        table.add_row(*row, *([f"{plain[i]:.4g}"] if plain else []))
    return table


def _values(t: torch.Tensor) -> str:
    return " ".join(f"{float(x):.4g}" for x in t.reshape(-1))
