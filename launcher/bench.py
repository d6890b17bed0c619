"""`fp8kv bench throughput | capacity | serve`: parse flags, show progress, print a table, --json, --plot.

The measuring lives in fp8cache.bench. Ctrl-C stops a run and prints the rows measured so far (exit 130).
Register on the `bench` group with bench.add_command(throughput) etc.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from launcher.options import SHAPES, speculative_arg

console = Console(stderr=True, soft_wrap=True)
EXIT_INTERRUPTED = 130


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(2)


def _log(message: str) -> None:
    console.print(message.rstrip(), style="dim", markup=False, highlight=False)


def _dtype_list(values: tuple[str, ...], device: str) -> list[str]:
    """--kv-cache-dtype given several times and/or as a comma list, resolved for `device` (a resolved --device)
    and checked before any model loads."""
    from fp8cache.bench.throughput import check_kv_cache_dtypes

    names = [n for v in values for n in v.split(",") if n.strip()]
    try:
        return check_kv_cache_dtypes(names, device)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--kv-cache-dtype") from exc


def _int_list(text: str, param: str, minimum: int = 1, example: str = "512,4096") -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma list of integers, e.g. {example}", param_hint=param)
    if not values or min(values) < minimum:
        raise click.BadParameter(f"{text!r}: give integers >= {minimum}, e.g. {example}", param_hint=param)
    return values


class _Bars:
    """progress(label, done, total) -> one rich progress bar per label."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, int] = {}

    def __call__(self, label: str, done: int, total: int) -> None:
        if label not in self.tasks:
            self.tasks[label] = self.progress.add_task(label, total=total)
        self.progress.update(self.tasks[label], completed=done, total=total)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console)


def _collect(rows_of: Callable[[_Bars], Iterator[dict]]) -> tuple[list[dict], bool]:
    """Run a row generator under a progress bar; on Ctrl-C keep the rows so far. (rows, interrupted)"""
    from fp8cache.distributed.group import WorkerDiedError
    from fp8cache.model.default_model import DefaultModelError

    _quiet_transformers()
    rows: list[dict] = []
    try:
        with _progress() as progress:
            for row in rows_of(_Bars(progress)):
                rows.append(row)
                progress.console.print(f"measured {_row_name(row)}: "
                                       f"{_fmt(row.get('output_tokens_per_s'))} output tok/s", highlight=False)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted:[/] showing the {len(rows)} row(s) measured so far")
        return rows, True
    except (ValueError, OSError, DefaultModelError, WorkerDiedError) as exc:
        _fail(str(exc))
    return rows, False


def _row_name(row: dict) -> str:
    context = f" context {row['context']} batch {row['batch']}" if "context" in row else ""
    return f"{row['engine']} {row['kv_cache_dtype']}{context}"


def _quiet_transformers() -> None:
    # Its per-load weight bars would fight with ours on the terminal.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _finish(payload, as_json: bool, table: Table | None, plot_path: str | None, plot: Callable,
            interrupted: bool) -> None:
    if as_json:
        click.echo(json.dumps(payload, indent=1))
    elif table is not None:
        # Piped output gets the whole table rather than rich's 80-column default with cut-off cells.
        Console(width=None if sys.stdout.isatty() else 200).print(table)
    if plot_path and payload:
        from fp8cache.bench.plot import PlotUnavailable

        try:
            console.print(f"plot written to {plot(payload, plot_path)}")
        except PlotUnavailable as exc:
            _fail(str(exc))
    if interrupted:
        sys.exit(EXIT_INTERRUPTED)


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


# Where an engine's time went (fp8cache.bench.throughput.StepTimes); "-" for a peer without steps.
_STEP_COLUMNS = ("peak running", "decode step ms", "decode batch", "prefill s", "decode s")


def _step_cells(row: dict) -> tuple[str, ...]:
    return (str(row.get("peak_running", "-")), _fmt(row.get("decode_step_ms"), ".2f"),
            _fmt(row.get("decode_batch")), _fmt(row.get("prefill_s"), ".2f"), _fmt(row.get("decode_s"), ".2f"))


def _machine_line(rows: list[dict]) -> str:
    m = rows[0]["machine"] if rows else {}
    return f"{m.get('cpu', '?')}, {m.get('threads', '?')} threads, torch {m.get('torch', '?')}"


def _device(name: str) -> str:
    """--device checked before any engine is built (one line, not a traceback, when there is no GPU)."""
    from fp8cache.platform.device import DeviceError, resolve_device

    try:
        return str(resolve_device(name))
    except DeviceError as exc:
        raise click.BadParameter(str(exc), param_hint="--device") from exc


CPU_ISA_OPT = click.option(
    "--cpu-isa", type=click.Choice(["native", "avx512", "avx2", "scalar"]), default="native", show_default=True,
    help="The CPU kernels to measure: native (the best path this CPU runs), or a lower one it also runs (avx2; "
         "scalar, the portable C++ that Arm machines run), built beside the native one on first use.")


def load_cpu_path(device, cpu_isa: str) -> None:
    """fp8cache.bench.machine.load_cpu_path, its refusal as a flag error."""
    from fp8cache.bench import machine

    try:
        machine.load_cpu_path(device, cpu_isa)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--cpu-isa") from exc


def _check_plot(plot_path: str | None) -> None:
    """Fail before a long run, not after it, when --plot cannot be honoured."""
    if plot_path:
        from fp8cache.bench.plot import PlotUnavailable, require_matplotlib

        try:
            require_matplotlib()
        except PlotUnavailable as exc:
            _fail(str(exc))


_MODEL_ARG = click.argument("model", required=False)
_DTYPE_OPT = click.option("--kv-cache-dtype", "kv_cache_dtypes", multiple=True, default=("auto,fp8_e4m3",),
                          show_default=True,
                          help="Cache dtypes to measure side by side: repeat the option or give a comma list.")
_MODEL_DTYPE_OPT = click.option("--dtype", default="auto", show_default=True,
                                type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                                help="Model dtype (auto: on a CPU the faster of float32 and bfloat16 there, on a GPU the checkpoint's 16-bit dtype).")
_THREADS_OPT = click.option("--threads", default=None, type=click.IntRange(1),
                            help="torch threads for every engine in the run (default: torch's own choice). "
                                 "On a busy machine fewer threads than cores avoids oversubscription.")
_WINDOW_OPT = click.option("--kv-recent-window", type=click.IntRange(min=0), default=None,
                           help="Newest tokens per sequence kept in full precision beside an FP8 cache "
                                "(0: plain FP8; default: the engine's, 32).")
_WINDOW_DTYPE_OPT = click.option("--kv-recent-window-dtype", default="auto", show_default=True,
                                 type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                                 help="dtype of the recent-token window (auto: the model dtype).")
_JSON_OPT = click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON on stdout.")
_DEVICE_OPT = click.option("--device", default="auto", show_default=True,
                           help="auto (the first GPU if torch sees one, else the CPU), cpu, cuda or cuda:N; the "
                                "transformers peer runs there too.")
_PLOT_OPT = click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
                         help="Write a PNG of the figures (needs `pip install fp8kv[plot]`).")
_LOAD_FORMAT_OPT = click.option(
    "--load-format", type=click.Choice(["auto", "dummy"]), default="auto", show_default=True,
    help="dummy: random weights made on the device from the model's config.json alone (MODEL may then be a "
         f"folder with only a config, or a shape fp8kv ships: {SHAPES}), so that memory and speed at a real "
         "model's size need no checkpoint; --compare hf runs the same random weights.")
_TEXT_OPT = click.option("--text", "text_path", type=click.Path(dir_okay=False), default=None,
                         help="UTF-8 text the prompts are cut from (default: $FP8KV_EVAL_TEXT, else the "
                              "WikiText-2 test text shipped with fp8kv).")


def _check_text(text_path: str | None) -> str:
    """The prompt text's path, found before any engine is built (a build takes minutes on a first run)."""
    from fp8cache.quality.eval import locate_eval_text

    try:
        return locate_eval_text(text_path)
    except FileNotFoundError as exc:
        _fail(str(exc))


@click.command("throughput")
@_MODEL_ARG
@click.option("--num-prompts", default=16, show_default=True, type=click.IntRange(1))
@click.option("--input-len", default=256, show_default=True, type=click.IntRange(1),
              help="Prompt tokens per request (cut from the WikiText-2 test text).")
@click.option("--output-len", default=128, show_default=True, type=click.IntRange(1),
              help="Generated tokens per request (ignore_eos: exactly this many).")
@_DTYPE_OPT
@click.option("--compare", multiple=True, type=click.Choice(["hf"]),
              help="Also run a peer in the same run: hf = transformers generate (batched, dynamic cache).")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1),
              help="Timed runs per engine, taking turns (fresh prompts each); the median is reported.")
@_MODEL_DTYPE_OPT
@click.option("--peer-dtype", default="same", show_default=True, type=click.Choice(["same", "float32", "bfloat16"]),
              help="Model dtype of the --compare peer: the same as fp8kv's, or another (e.g. float32, what "
                   "transformers loads a float32 checkpoint as, beside fp8kv in bfloat16). Rows show each dtype.")
@click.option("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB (default: the engine's).")
@click.option("--max-num-seqs", default=256, show_default=True, type=click.IntRange(1))
@click.option("--max-num-batched-tokens", default=2048, show_default=True, type=click.IntRange(1))
@click.option("--max-model-len", default=None, type=click.IntRange(1),
              help="The engines' longest sequence (default: the model's own limit). On a GPU a decode step's "
                   "attention is sized for it, so a model with a 128k limit runs short requests faster with "
                   "--max-model-len near --input-len + --output-len.")
@_LOAD_FORMAT_OPT
@click.option("--num-shard", "--tensor-parallel-size", "num_shard", default=1, show_default=True,
              type=click.IntRange(1),
              help="Tensor-parallel ranks for the fp8kv engines: this process is rank 0 and starts the others "
                   "(gloo on CPU). --threads then applies to every rank. The transformers peer stays whole.")
@click.option("--kv-recent-window", default=None,
              help="Newest tokens per sequence kept in full precision beside an FP8 cache (0: plain FP8; "
                   "default: the engine's, 32). A comma list, e.g. 0,32, runs each FP8 dtype once per window "
                   "side by side and reports the windowed rows over window 0.")
@_WINDOW_DTYPE_OPT
@click.option("--kv-recent-window-sinks", type=click.IntRange(min=0), default=1, show_default=True,
              help="With a recent window: each sequence's first N tokens (attention sinks) also kept beside it.")
@click.option("--kv-scales", type=click.Choice(["static", "dynamic"]), default="static", show_default=True,
              help="The FP8 caches' scales: static (1.0 or the checkpoint's) or dynamic (a scale per token and KV "
                   "head, computed as the cache is written).")
@click.option("--kv-rotation", type=click.Choice(["auto", "none", "hadamard"]), default="auto", show_default=True,
              help="With --kv-scales dynamic: Hadamard-rotate K/V first (auto: where the head size allows).")
@click.option("--speculative-config", metavar="JSON", default=None, callback=speculative_arg,
              help='Also run every fp8kv engine with this speculative decoding, e.g. \'{"method": "ngram", '
                   '"num_speculative_tokens": 4}\': rows "<cache> ngram" with the acceptance rate and "vs no spec".')
@click.option("--workload", default="text", show_default=True, type=click.Choice(["text", "repeat"]),
              help="text: prompts are windows of the text to continue; repeat: a passage of it, a blank line and "
                   "the passage's first 8 tokens again, which the model goes on copying (context that repeats: "
                   "where speculation gains).")
@_THREADS_OPT
@_TEXT_OPT
@_DEVICE_OPT
@CPU_ISA_OPT
@_JSON_OPT
@_PLOT_OPT
def throughput(model, num_prompts, input_len, output_len, kv_cache_dtypes, compare, repeats, dtype, peer_dtype,
               kv_cache_memory, max_num_seqs, max_num_batched_tokens, max_model_len, load_format, num_shard,
               kv_recent_window, kv_recent_window_dtype, kv_recent_window_sinks, kv_scales, kv_rotation,
               speculative_config, workload, threads, text_path, device, cpu_isa, as_json, plot_path) -> None:
    """Offline throughput per kv-cache dtype (and transformers with --compare hf), measured in one run."""
    from fp8cache.bench import machine, plot
    from fp8cache.bench import throughput as bench

    device = _device(device)
    dtypes = _dtype_list(kv_cache_dtypes, device)
    windows = None if kv_recent_window is None else _int_list(kv_recent_window, "--kv-recent-window", 0, "0,32")
    _check_plot(plot_path)
    text_path = _check_text(text_path)
    if cpu_isa != "native" and num_shard > 1:  # the other ranks are processes of their own, which load the native path
        raise click.BadParameter("a lower CPU path runs in this process only; drop --num-shard", param_hint="--cpu-isa")
    if device == "cpu" or cpu_isa != "native":
        load_cpu_path(device, cpu_isa)
    machine.set_threads(threads)
    rows, interrupted = _collect(lambda bar: bench.iter_throughput(
        model, tuple(dtypes), num_prompts, input_len, output_len, tuple(compare), repeats, dtype,
        kv_cache_memory, max_num_seqs, max_num_batched_tokens, progress=bar, log=_log, num_shard=num_shard,
        threads_per_rank=threads, kv_recent_window=windows, kv_recent_window_dtype=kv_recent_window_dtype,
        peer_dtype=peer_dtype, device=device, text_path=text_path, load_format=load_format,
        max_model_len=max_model_len, speculative_config=speculative_config, workload=workload, kv_scales=kv_scales,
        kv_rotation=kv_rotation, kv_recent_window_sinks=kv_recent_window_sinks))
    bench.add_ratios(rows)
    path = machine.cpu_path(device)
    for r in rows:
        if path and r["engine"] == "fp8kv":
            r["cpu_path"] = path
    shards = f", fp8kv over {num_shard} tensor-parallel ranks" if num_shard > 1 else ""
    scales = f", dynamic FP8 scales, rotation {kv_rotation}" if kv_scales == "dynamic" else ""
    table = Table(title=f"offline throughput, {num_prompts} prompts, {input_len} in / {output_len} out"
                        f"{shards}{scales}\n{_machine_line(rows)}" + (f", fp8kv's CPU path {path}" if path else ""))
    by_window = any("vs_window0" in r for r in rows)
    spec_cols = ("accepted", "vs no spec") if speculative_config else ()
    for col in ("engine", "dtype", "kv cache", "req/s", "output tok/s", "total tok/s", "elapsed s", "vs auto",
                "vs transformers") + (("vs window 0",) if by_window else ()) + spec_cols + _STEP_COLUMNS:
        table.add_column(col, justify="right")
    for r in rows:
        spec_cells = (_fmt(r.get("spec_acceptance_rate"), ".0%"), _ratio(r.get("vs_no_spec"))) if spec_cols else ()
        table.add_row(r["engine"], r["dtype"], r.get("variant", r["kv_cache_dtype"]), _fmt(r["requests_per_s"], ".3f"),
                      _fmt(r["output_tokens_per_s"]), _fmt(r["total_tokens_per_s"]), _fmt(r["elapsed_s"], ".2f"),
                      _ratio(r.get("vs_auto")), _ratio(r.get("vs_transformers")),
                      *((_ratio(r.get("vs_window0")),) if by_window else ()), *spec_cells, *_step_cells(r))
    _finish(rows, as_json, table, plot_path, plot.plot_throughput, interrupted)


@click.command("capacity")
@_MODEL_ARG
@click.option("--kv-cache-memory", default="256MiB", show_default=True,
              help="The KV cache budget every dtype gets, e.g. 256MiB, 2GiB.")
@click.option("--context", "contexts", default="4096", show_default=True,
              help="Sequence length(s) (prompt + output), comma list, e.g. 512,4096.")
@click.option("--output-len", default=128, show_default=True, type=click.IntRange(1),
              help="Generated tokens per sequence; the prompt is context - output-len.")
@_DTYPE_OPT
@click.option("--max-num-seqs", default=256, show_default=True, type=click.IntRange(1),
              help="Cap on the batch (set it below what fits to compare dtypes at the same batch).")
@click.option("--max-num-batched-tokens", default=2048, show_default=True, type=click.IntRange(1))
@click.option("--block-size", default=16, show_default=True, type=click.Choice(["8", "16", "32"]))
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1),
              help="Timed runs per dtype and context, taking turns (fresh prompts each); the median is reported.")
@_MODEL_DTYPE_OPT
@_WINDOW_OPT
@_WINDOW_DTYPE_OPT
@click.option("--kv-scales", type=click.Choice(["static", "dynamic", "both"]), default="static", show_default=True,
              help="The FP8 caches' scales: dynamic stores a scale per token and KV head beside the codes (out of "
                   "the same budget); both runs each FP8 dtype with either, side by side.")
@_LOAD_FORMAT_OPT
@_THREADS_OPT
@_TEXT_OPT
@_DEVICE_OPT
@_JSON_OPT
@_PLOT_OPT
def capacity(model, kv_cache_memory, contexts, output_len, kv_cache_dtypes, max_num_seqs,
             max_num_batched_tokens, block_size, repeats, dtype, kv_recent_window, kv_recent_window_dtype,
             kv_scales, load_format, threads, text_path, device, as_json, plot_path) -> None:
    """Tokens that fit a KV-cache budget per dtype, the largest batch per context, and its throughput."""
    from fp8cache.bench import capacity as bench
    from fp8cache.bench import machine, plot

    device = _device(device)
    dtypes = _dtype_list(kv_cache_dtypes, device)
    context_list = _int_list(contexts, "--context")
    _check_plot(plot_path)
    text_path = _check_text(text_path)
    machine.set_threads(threads)
    rows, interrupted = _collect(lambda bar: bench.iter_capacity(
        model, tuple(dtypes), kv_cache_memory, tuple(context_list), output_len, max_num_seqs,
        max_num_batched_tokens, int(block_size), dtype, repeats, progress=bar, log=_log,
        kv_recent_window=kv_recent_window, kv_recent_window_dtype=kv_recent_window_dtype, text_path=text_path,
        device=device, load_format=load_format, kv_scales=kv_scales))
    bench.add_ratios(rows)
    table = Table(title=f"capacity at a {kv_cache_memory} KV cache, {output_len} output tokens per sequence\n"
                        f"{_machine_line(rows)}")
    for col in ("kv cache", "bytes/token", "tokens/GiB", "scales' share", "tokens that fit", "context", "max batch",
                "batch run", "preemptions", "req/s", "output tok/s", "total tok/s", "vs auto") + _STEP_COLUMNS:
        table.add_column(col, justify="right")
    for r in rows:
        preempt = r.get("num_preemptions")
        table.add_row(r["variant"], str(r["bytes_per_token"]), f"{r['tokens_per_gib']:,.0f}",
                      _fmt(r["scales_share"], ".1%") if r["kv_scales"] == "dynamic" else "-",
                      str(r["capacity_tokens"]), str(r["context"]),
                      str(r["max_batch"]), str(r["batch"]),
                      "-" if preempt is None else ("[green]0[/]" if preempt == 0 else f"[red]{preempt}[/]"),
                      _fmt(r.get("requests_per_s"), ".3f"), _fmt(r.get("output_tokens_per_s")),
                      _fmt(r.get("total_tokens_per_s")), _ratio(r.get("vs_auto")), *_step_cells(r))
    _finish(rows, as_json, table, plot_path, plot.plot_capacity, interrupted)


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a number of requests per second or inf",
                                 param_hint="--request-rate")
    if not rate > 0:
        raise click.BadParameter(f"{text!r} must be > 0 (or inf: all at once)", param_hint="--request-rate")
    return rate


@click.command("serve")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="Base URL of a running `fp8kv run` or any OpenAI-compatible server.")
@click.option("--model", default=None, help="Model name to request (default: the first one /v1/models lists).")
@click.option("--tokenizer", default=None, help="Tokenizer folder that cuts the prompts (default: the default "
                                                "model's; give the served model's folder, or its shape's name "
                                                "for a server on random weights, e.g. llama-3.1-8b).")
@click.option("--num-prompts", default=64, show_default=True, type=click.IntRange(1))
@click.option("--input-len", default=256, show_default=True, type=click.IntRange(1))
@click.option("--output-len", default=128, show_default=True, type=click.IntRange(1))
@click.option("--request-rate", default="inf", show_default=True,
              help="Requests per second, Poisson arrivals (seeded); inf sends all at once.")
@click.option("--max-concurrency", default=None, type=click.IntRange(1), help="Most requests in flight.")
@click.option("--seed", default=0, show_default=True, help="Seed of the arrival times.")
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
              help="Ask for exactly --output-len tokens (a vLLM extension that fp8kv run accepts).")
@click.option("--api-key", default=None, help="Sent as Authorization: Bearer.")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds one request may take.")
@_TEXT_OPT
@_JSON_OPT
@_PLOT_OPT
def serve(url, model, tokenizer, num_prompts, input_len, output_len, request_rate, max_concurrency, seed,
          ignore_eos, api_key, timeout, text_path, as_json, plot_path) -> None:
    """Latency and throughput of a running server under load, over HTTP with streaming."""
    import asyncio

    from fp8cache.bench import plot
    from fp8cache.bench import serve as bench

    rate = _rate(request_rate)
    _check_plot(plot_path)
    text_path = _check_text(text_path)
    try:
        name = model or bench.fetch_model_name(url, api_key)
        prompts, lens = bench.make_prompts(bench.load_tokenizer(tokenizer), num_prompts, input_len, text_path)
    except (ConnectionError, ValueError, OSError) as exc:
        _fail(str(exc))
    run = bench.ServeBench(url, name, prompts, lens, output_len, rate, max_concurrency, seed, ignore_eos,
                           api_key, timeout)
    interrupted = False
    with _progress() as progress:
        task = progress.add_task(f"requests to {url}", total=num_prompts)
        try:
            asyncio.run(run.run(on_result=lambda r: progress.advance(task)))
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        console.print(f"[yellow]interrupted:[/] summarizing the {len(run.results)} request(s) that finished")
    summary = {"url": url, "model": name, "num_prompts": num_prompts, "input_len": input_len,
               "output_len": output_len, "request_rate": "inf" if math.isinf(rate) else rate,
               "max_concurrency": max_concurrency, "seed": seed, **bench.summarize(run.results, run.duration_s)}
    _finish(summary, as_json, _serve_table(summary), plot_path, plot.plot_serve, interrupted)


def _serve_table(s: dict) -> Table:
    rate = s["request_rate"]
    table = Table(title=f"{s['model']} at {s['url']}: {s['num_prompts']} prompts, {s['input_len']} in / "
                        f"{s['output_len']} out, rate {rate}, max concurrency {s['max_concurrency'] or 'none'}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    failed = f"[red]{s['failed']}[/]" if s["failed"] else "0"
    for name, value in (("completed requests", str(s["completed"])), ("failed requests", failed),
                        ("duration s", _fmt(s["duration_s"], ".2f")),
                        ("request throughput (req/s)", _fmt(s["request_throughput"], ".3f")),
                        ("output tokens/s", _fmt(s["output_tokens_per_s"])),
                        ("total tokens/s", _fmt(s["total_tokens_per_s"]))):
        table.add_row(name, value)
    for key, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        for stat in ("mean", "median", "p90", "p99"):
            table.add_row(f"{title} {stat} (ms)", _fmt(s[key][stat], ".1f"))
    for message, count in s["errors"].items():
        table.add_row(f"[red]error x{count}[/]", message)
    return table
