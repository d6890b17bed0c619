"""`fp8kv bench throughput`: offline generation throughput per kv-cache dtype, and the peer's in one run.

Every engine gets the same WikiText-2 prompts of exactly input_len tokens and generates exactly
output_len tokens per prompt (ignore_eos, greedy), after a warm-up on other prompts. The peer is
Hugging Face transformers `generate` with its default dynamic cache, on the same weights, batched.

All engines are built up front (the fp8kv ones share one copy of the weights) and the timed runs take
turns: round r runs every engine once on prompt set r. Drift on a shared machine then hits every engine
alike, and the median over rounds is what a row reports.

Workloads: "text" prompts are plain windows of the text (continue it); "repeat" prompts are a passage of it and
the start of that passage again, which the model goes on copying (PromptSource.take_repeat): what n-gram
speculative decoding gains on. With a speculative_config
every fp8kv cache variant runs twice, without and with speculation (rows "<variant> ngram"), and those rows
report the acceptance rate and their output tokens/s over the plain row's (vs_no_spec).

With num_shard N > 1 the fp8kv engines run tensor-parallel: this process is rank 0 and starts N-1 worker
processes (fp8cache/distributed/group.py, as LLM(tensor_parallel_size=N) does), each holding its share of
every engine. The transformers peer stays whole, in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from fp8cache.bench import machine
from fp8cache.bench.prompts import PromptSource
from fp8cache.kvcache import formats

# progress(label, done, total): called as output tokens are generated
Progress = Callable[[str, int, int], None]
PEERS = ("hf",)
WORKLOADS = ("text", "repeat")
SPEC_SUFFIX = " ngram"  # the label of a variant's engine with speculative decoding
# A peer may run another model dtype than fp8kv, e.g. transformers' own default for a float32 checkpoint.
PEER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WARMUP_OUTPUT_LEN = 2  # a prefill and a decode step run every code path
_request_ids = itertools.count()


@dataclass
class StepTimes:
    """Where an engine's time went, step by step: steps that computed prompt tokens (a prefill, or a chunk
    of one, with or without decodes beside it) and steps that only decoded, each timed on the host from the
    end of the step before (the step returns once its sampled tokens are known)."""
    prefill_steps: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0
    decode_tokens: int = 0  # tokens the decode-only steps generated: their batch, summed
    decode_step_s: list[float] = field(default_factory=list)

    def add(self, seconds: float, prefill_tokens: int, generated: int) -> None:
        if prefill_tokens > 0:
            self.prefill_steps += 1
            self.prefill_s += seconds
        else:
            self.decode_steps += 1
            self.decode_s += seconds
            self.decode_tokens += generated
            self.decode_step_s.append(seconds)

    def figures(self, elapsed_s: float) -> dict:
        """For a bench row: the median decode step (ms) and its mean batch, and the seconds in each kind of
        step and outside them (submitting requests, the loop)."""
        ordered = sorted(self.decode_step_s)
        median = ordered[(len(ordered) - 1) // 2] if ordered else None
        return {"steps": self.prefill_steps + self.decode_steps, "prefill_steps": self.prefill_steps,
                "prefill_s": self.prefill_s, "decode_steps": self.decode_steps, "decode_s": self.decode_s,
                "decode_step_ms": None if median is None else 1000 * median,
                "decode_batch": self.decode_tokens / self.decode_steps if self.decode_steps else None,
                "other_s": elapsed_s - self.prefill_s - self.decode_s}


@dataclass
class BatchResult:
    elapsed_s: float
    num_requests: int
    input_tokens: int
    output_tokens: int
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: proposed tokens verified, and of those accepted
    num_accepted_tokens: int = 0
    peak_running: int = 0  # the most sequences the engine ran at once
    finish_reasons: dict[str, int] = field(default_factory=dict)
    steps: StepTimes | None = None  # None for a peer that reports no steps (transformers generate)

    def rates(self) -> dict:
        return {"elapsed_s": self.elapsed_s, "requests_per_s": self.num_requests / self.elapsed_s,
                "output_tokens_per_s": self.output_tokens / self.elapsed_s,
                "total_tokens_per_s": (self.input_tokens + self.output_tokens) / self.elapsed_s}


def check_kv_cache_dtypes(names: list[str], device: torch.device | str) -> list[str]:
    """The canonical names on `device` ("fp8" is its native format: fp8_e4m3fnuz on ROCm), in order, without
    repeats; an unknown name raises naming the valid ones."""
    backend = formats.backend_of(device)
    canonical = [formats.resolve_kv_cache_dtype(n.strip(), backend) for n in names]
    if not canonical:
        raise ValueError(f"give at least one kv-cache-dtype; valid: {', '.join(formats.KV_CACHE_DTYPES)}")
    return list(dict.fromkeys(canonical))


def cache_variants(kv_cache_dtypes: list[str], windows: list[int | None],
                   speculative_config: dict | None = None) -> dict[str, dict]:
    """Engine label -> config overrides: every dtype with every recent-token window (the auto cache, which
    has no window, once). Labels are the dtype names, plus " w<N>" when several windows are compared. With a
    speculative_config each also runs with it (label + SPEC_SUFFIX)."""
    variants = {}
    for kv_dtype in kv_cache_dtypes:
        for window in windows[:1] if kv_dtype == "auto" else windows:
            label = kv_dtype if len(windows) == 1 or kv_dtype == "auto" else f"{kv_dtype} w{window}"
            variants[label] = {"kv_cache_dtype": kv_dtype, "kv_recent_window": window}
            if speculative_config:
                variants[label + SPEC_SUFFIX] = {**variants[label], "speculative_config": speculative_config}
    return variants


def build_engines(model: str | None, kv_cache_dtypes: list[str], log: Callable[[str], None] = print,
                  windows: list[int | None] | None = None, speculative_config: dict | None = None,
                  **config) -> dict[str, object]:
    """One LLMEngine per cache variant (cache_variants), all on one loaded copy of the weights (as eval does)."""
    from fp8cache.config import EngineConfig
    from fp8cache.engine.llm_engine import LLMEngine
    from fp8cache.model.loader import load_model
    from fp8cache.model.runner import ModelRunner

    base = EngineConfig(model=model, **config)
    loaded = load_model(base)
    engines = {}
    for label, overrides in cache_variants(kv_cache_dtypes, windows or [base.kv_recent_window],
                                           speculative_config).items():
        cfg = dataclasses.replace(base, **overrides)
        engines[label] = LLMEngine(cfg, log=log, runner=ModelRunner(cfg, log=log, loaded=loaded))
    return engines


@contextlib.contextmanager
def open_engines(model: str | None, kv_cache_dtypes: list[str], log: Callable[[str], None] = print,
                 num_shard: int = 1, threads_per_rank: int | None = None, windows: list[int | None] | None = None,
                 speculative_config: dict | None = None, **config) -> Iterator[dict[str, object]]:
    """build_engines, or with num_shard > 1 the same engines over a tensor-parallel group whose worker
    processes stop when the block ends (threads_per_rank: torch threads of each worker)."""
    if num_shard == 1:
        yield build_engines(model, kv_cache_dtypes, log, windows, speculative_config, **config)
        return
    from fp8cache.config import EngineConfig
    from fp8cache.engine.llm_engine import LLMEngine
    from fp8cache.model.tp_ranks import start_group

    base = EngineConfig(model=model, tensor_parallel_size=num_shard, **config)
    variants = cache_variants(kv_cache_dtypes, windows or [base.kv_recent_window], speculative_config)
    configs = [dataclasses.replace(base, **overrides) for overrides in variants.values()]
    with start_group(configs, log, threads_per_rank) as group:
        yield {label: LLMEngine(cfg, log=log, runner=runner)
               for label, cfg, runner in zip(variants, configs, group.runners)}


def bench_params(output_len: int):
    from fp8cache.engine.sampling_params import SamplingParams

    # Greedy like the peer; ignore_eos so every request makes exactly output_len tokens.
    return SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)


def run_batch(engine, prompts: list[list[int]], output_len: int,
              on_tokens: Callable[[int], None] | None = None,
              clock: Callable[[], float] = time.perf_counter) -> BatchResult:
    """Time one batch through an LLMEngine, submitted at once. The loop is LLM.generate's own, driven
    here so that progress shows per step, the peak of concurrently running sequences is seen and each
    step's time is kept (StepTimes). clock: seconds, for tests to inject."""
    params = bench_params(output_len)
    before = engine.stats
    ids = [f"bench-{next(_request_ids)}" for _ in prompts]
    done: dict[str, object] = {}
    peak = 0
    steps = StepTimes()
    start = clock()
    try:
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        last, previous = clock(), engine.stats
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            now, stats = clock(), engine.stats
            steps.add(now - last, stats.num_prefill_tokens_computed - previous.num_prefill_tokens_computed,
                      stats.num_generated_tokens - previous.num_generated_tokens)
            last, previous = now, stats
            peak = max(peak, stats.num_running)
            if on_tokens is not None:
                on_tokens(stats.num_generated_tokens - before.num_generated_tokens)
            if len(done) < len(ids) and not engine.has_unfinished_requests():
                raise RuntimeError("the engine dropped benchmark requests without finishing them")
    except BaseException:
        engine.abort_request([i for i in ids if i not in done])
        raise
    elapsed = last - start  # to the end of the last step
    outputs = [done[i].outputs[0] for i in ids]
    reasons: dict[str, int] = {}
    for o in outputs:
        reasons[o.finish_reason] = reasons.get(o.finish_reason, 0) + 1
    after = engine.stats
    return BatchResult(elapsed, len(prompts), sum(len(p) for p in prompts),
                       sum(len(o.token_ids) for o in outputs),
                       after.num_preemptions - before.num_preemptions,
                       after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                       after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
                       peak, reasons, steps)


def step_figures(result: BatchResult) -> dict:
    """A bench row's concurrency and step figures (empty for a result without steps)."""
    if result.steps is None:
        return {}
    return {"peak_running": result.peak_running, **result.steps.figures(result.elapsed_s)}


def run_transformers(model, prompts: list[list[int]], output_len: int, pad_token_id: int) -> BatchResult:
    """One batched `generate` call: left padding, greedy, exactly output_len new tokens per prompt, on the
    model's device."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    input_ids, mask = input_ids.to(device), mask.to(device)
    machine.synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=pad_token_id)
    machine.synchronize(device)
    elapsed = time.perf_counter() - start
    new_tokens = out.shape[1] - width  # min_new_tokens keeps EOS away, so no row stops early
    return BatchResult(elapsed, len(prompts), sum(len(p) for p in prompts), len(prompts) * new_tokens)


@dataclass
class _Contestant:
    engine: str  # "fp8kv" | "transformers"
    kv_cache_dtype: str
    dtype: torch.dtype  # the model's weights and activations
    run: Callable[[list[list[int]], int, Callable[[int], None] | None], BatchResult]
    extra: dict
    variant: str = ""  # the engine's cache variant label (cache_variants)

    @property
    def label(self) -> str:
        return f"fp8kv {self.variant}" if self.engine == "fp8kv" else "transformers generate"


def iter_throughput(model: str | None = None, kv_cache_dtypes: tuple[str, ...] = ("auto", "fp8_e4m3"),
                    num_prompts: int = 16, input_len: int = 256, output_len: int = 128,
                    compare: tuple[str, ...] = (), repeats: int = 1, dtype: str = "auto",
                    kv_cache_memory: int | str | None = None, max_num_seqs: int = 256,
                    max_num_batched_tokens: int = 2048, text_path: str | None = None,
                    progress: Progress | None = None, log: Callable[[str], None] = print,
                    num_shard: int = 1, threads_per_rank: int | None = None,
                    kv_recent_window: int | list[int] | None = None,
                    kv_recent_window_dtype: str = "auto", peer_dtype: str = "same",
                    device: str = "auto", load_format: str = "auto",
                    max_model_len: int | None = None, speculative_config: dict | None = None,
                    workload: str = "text", kv_scales: str = "static", kv_rotation: str = "auto",
                    kv_recent_window_sinks: int = 1) -> Iterator[dict]:
    """Yield one row per fp8kv kv-cache dtype, then one per peer, each after its last timed run.
    peer_dtype: the transformers peer's model dtype, "same" as the fp8kv engines' or a dtype name.
    load_format: "dummy" runs random weights from the model's config.json alone (or a shape shipped with
    fp8kv, by name), the peer the same ones. max_model_len: the engines' (None: the model's own limit).
    num_shard: tensor-parallel ranks of the fp8kv engines (threads_per_rank: torch threads of each worker).
    kv_recent_window: newest tokens kept in full precision beside FP8 (None: the engine's default); a
    list runs every FP8 dtype once per window, side by side (rows then say e.g. "fp8_e4m3 w32").
    speculative_config: also run every variant with it (see the module docstring); workload: text | repeat.
    kv_scales, kv_rotation: the FP8 caches' scales (static | dynamic) and, with dynamic ones, their rotation
    (auto | none | hadamard), as EngineConfig takes them; kv_recent_window_sinks: the window's attention sinks."""
    _check_lengths(num_prompts, input_len, output_len, repeats)
    windows = check_windows(kv_recent_window)
    if isinstance(num_shard, bool) or not isinstance(num_shard, int) or num_shard < 1:
        raise ValueError(f"num_shard={num_shard!r} must be an integer >= 1")
    dtypes = check_kv_cache_dtypes(list(kv_cache_dtypes), device)
    unknown = [p for p in compare if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)} for --compare; valid: {', '.join(PEERS)}")
    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r} is not known; valid: {', '.join(WORKLOADS)}")
    if peer_dtype != "same" and peer_dtype not in PEER_DTYPES:
        raise ValueError(f"peer_dtype={peer_dtype!r} is not known; valid: same, {', '.join(PEER_DTYPES)}")
    if max_model_len is not None and max_model_len < input_len + output_len:
        raise ValueError(f"max_model_len={max_model_len} is shorter than a request ({input_len} + "
                         f"{output_len} tokens); use at least {input_len + output_len}")
    with open_engines(model, dtypes, log, num_shard, threads_per_rank, dtype=dtype, device=device,
                      kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, windows=windows,
                      kv_recent_window_dtype=kv_recent_window_dtype, load_format=load_format,
                      max_model_len=max_model_len, speculative_config=speculative_config, kv_scales=kv_scales,
                      kv_rotation=kv_rotation, kv_recent_window_sinks=kv_recent_window_sinks) as engines:
        yield from _race(engines, num_prompts, input_len, output_len, compare, repeats, text_path, progress,
                         num_shard, peer_dtype, workload)


def _race(engines: dict[str, object], num_prompts: int, input_len: int, output_len: int,
          compare: tuple[str, ...], repeats: int, text_path: str | None, progress: Progress | None,
          num_shard: int, peer_dtype: str = "same", workload: str = "text") -> Iterator[dict]:
    """Warm every contestant up, then time them taking turns; one row each after its last run."""
    runner = next(iter(engines.values())).runner
    contestants = [_engine_contestant(label, e, num_shard) for label, e in engines.items()]
    if "hf" in compare:
        contestants.append(_transformers_contestant(
            runner, runner.dtype if peer_dtype == "same" else PEER_DTYPES[peer_dtype]))
    # On a GPU the warm-up runs the timed batch size, so the decode steps' CUDA graphs are captured before
    # the clock starts.
    warmup = num_prompts if runner.device.type == "cuda" else min(num_prompts, 4)
    sets = _prompt_sets(runner.tokenizer, text_path, num_prompts, input_len, repeats, warmup, workload)
    for c in contestants:
        c.run(sets[0], WARMUP_OUTPUT_LEN, None)
    info = machine.describe()
    results: dict[str, list[BatchResult]] = {c.label: [] for c in contestants}
    total = num_prompts * output_len * repeats
    for r, prompts in enumerate(sets[1:]):
        for c in contestants:
            done_before = r * num_prompts * output_len
            on_tokens = (lambda n, c=c, d=done_before: progress(c.label, d + n, total)) if progress else None
            results[c.label].append(c.run(prompts, output_len, on_tokens))
            if r == repeats - 1:
                yield _row(c, results[c.label], num_prompts, input_len, output_len, info)


def check_windows(kv_recent_window: int | list[int] | tuple[int, ...] | None) -> list[int | None]:
    """[None] (the engine's default), [N], or several distinct windows in order."""
    windows = list(kv_recent_window) if isinstance(kv_recent_window, (list, tuple)) else [kv_recent_window]
    if not windows:
        raise ValueError("give at least one kv_recent_window (0: plain FP8)")
    for w in windows:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise ValueError(f"kv_recent_window={w!r} must be a whole number of tokens >= 0 (0: plain FP8)")
    return list(dict.fromkeys(windows))


def _engine_contestant(label: str, engine, num_shard: int = 1) -> _Contestant:
    runner = engine.runner  # with num_shard > 1, rank 0's: capacity and bytes per token are per rank
    return _Contestant("fp8kv", runner.kv_spec.cache_dtype_name, runner.kv_spec.model_dtype,
                       lambda prompts, n, cb: run_batch(engine, prompts, n, cb),
                       {"num_shard": num_shard, **cache_figures(runner)}, label)


def cache_figures(runner) -> dict:
    """What the engine's cache holds, for a bench row (the recent-token window's memory included)."""
    plan, spec = runner.cache_plan, runner.kv_spec
    return {"capacity_tokens": runner.capacity_tokens, "bytes_per_token": runner.bytes_per_token,
            "kv_recent_window": spec.window_size, "kv_recent_window_sinks": spec.window_sinks,
            "window_dtype": str(spec.window_dtype).removeprefix("torch."), "window_seats": plan.window_seats,
            "window_bytes": plan.window_bytes}


def peer_model(model_path: str, model_dtype: torch.dtype, device: torch.device | str = "cpu",
               load_format: str = "auto") -> torch.nn.Module:
    """transformers' own copy of the model fp8kv runs, on `device`: the checkpoint's weights, or with
    load_format dummy the same random weights (fp8cache.model.dummy seeds each parameter by its name)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":
        from fp8cache.model import dummy

        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        return dummy.build_model(config, model_dtype, device)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=model_dtype, local_files_only=True)
    return model.eval().to(device)


def _transformers_contestant(runner, model_dtype: torch.dtype) -> _Contestant:
    # Its own copy of the weights, on fp8kv's device: fp8kv's runners replace the attention of the model
    # they share. fp8kv's tokenizer (a random model's may exist only in memory) gives the padding id.
    hf_model = peer_model(runner.model_path, model_dtype, runner.device, runner.config.load_format)
    tokenizer = runner.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run(prompts: list[list[int]], n: int, on_tokens: Callable[[int], None] | None) -> BatchResult:
        result = run_transformers(hf_model, prompts, n, pad)
        if on_tokens is not None:  # generate() reports nothing until it returns
            on_tokens(result.output_tokens)
        return result

    return _Contestant("transformers", "auto", next(hf_model.parameters()).dtype, run,
                       {"num_shard": 1, "cache": "DynamicCache",
                        "attn_implementation": hf_model.config._attn_implementation})


def median_result(results: list[BatchResult]) -> BatchResult:
    """The median run by elapsed time (the lower middle of an even count) stands for all repeats."""
    return sorted(results, key=lambda r: r.elapsed_s)[(len(results) - 1) // 2]


def _row(c: _Contestant, results: list[BatchResult], num_prompts: int, input_len: int, output_len: int,
         info: dict) -> dict:
    median = median_result(results)  # every elapsed time is kept beside it
    row = {"engine": c.engine, "kv_cache_dtype": c.kv_cache_dtype, "variant": c.variant or c.kv_cache_dtype,
           "dtype": str(c.dtype).removeprefix("torch."),
           "num_prompts": num_prompts,
           "input_len": input_len, "output_len": output_len, **median.rates(),
           "input_tokens": median.input_tokens, "output_tokens": median.output_tokens,
           "num_preemptions": median.num_preemptions, "repeats": len(results),
           "elapsed_all_s": [r.elapsed_s for r in results], **step_figures(median), **c.extra,
           "machine": info}
    if median.finish_reasons:
        row["finish_reasons"] = median.finish_reasons
    if median.num_draft_tokens:
        row["spec_draft_tokens"], row["spec_accepted_tokens"] = median.num_draft_tokens, median.num_accepted_tokens
        row["spec_acceptance_rate"] = median.num_accepted_tokens / median.num_draft_tokens
    return row


def add_ratios(rows: list[dict]) -> list[dict]:
    """Add each fp8kv row's output tokens/s over the transformers row's and over fp8kv auto's, when present,
    and a windowed FP8 row's over the same dtype's plain (window 0) row (vs_window0)."""
    peer = next((r for r in rows if r["engine"] == "transformers"), None)
    fp8kv = [r for r in rows if r["engine"] == "fp8kv"]
    fp8kv_plain = [r for r in fp8kv if not _variant(r).endswith(SPEC_SUFFIX)]
    auto = next((r for r in fp8kv_plain if r["kv_cache_dtype"] == "auto"), None)
    plain = {r["kv_cache_dtype"]: r for r in fp8kv_plain
             if r["kv_cache_dtype"] != "auto" and r.get("kv_recent_window") == 0}
    by_variant = {_variant(r): r for r in fp8kv_plain}
    for r in fp8kv:
        if peer is not None:
            r["vs_transformers"] = r["output_tokens_per_s"] / peer["output_tokens_per_s"]
        if auto is not None:
            r["vs_auto"] = r["output_tokens_per_s"] / auto["output_tokens_per_s"]
        base = plain.get(r["kv_cache_dtype"])
        if base is not None and r.get("kv_recent_window"):
            r["vs_window0"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        no_spec = by_variant.get(_variant(r).removesuffix(SPEC_SUFFIX))
        if _variant(r).endswith(SPEC_SUFFIX) and no_spec is not None:
            r["vs_no_spec"] = r["output_tokens_per_s"] / no_spec["output_tokens_per_s"]
    return rows


def _variant(row: dict) -> str:
    return row.get("variant", row["kv_cache_dtype"])


def _prompt_sets(tokenizer, text_path: str | None, num_prompts: int, input_len: int,
                 repeats: int, warmup: int | None = None, workload: str = "text") -> list[list[list[int]]]:
    """[warm-up prompts, then one set per repeat]: fresh prompts each, so none is a prefix-cache hit."""
    source = PromptSource(tokenizer, text_path)
    take = source.take_repeat if workload == "repeat" else source.take
    first = take(min(num_prompts, 4) if warmup is None else warmup, input_len)
    return [first] + [take(num_prompts, input_len) for _ in range(repeats)]


def _check_lengths(num_prompts: int, input_len: int, output_len: int, repeats: int) -> None:
    for name, value in (("num_prompts", num_prompts), ("input_len", input_len), ("output_len", output_len),
                        ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
