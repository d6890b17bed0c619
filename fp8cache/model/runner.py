"""The model runner: one forward pass of a Hugging Face causal LM per engine step, over the paged cache."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator

import numpy as np
import torch

from fp8cache import ops
from fp8cache.config import DEFAULT_KV_RECENT_WINDOW, EngineConfig
from fp8cache.distributed import parallel_state, sharding
from fp8cache.distributed import worker as tp_worker
from fp8cache.kvcache import dynamic_scales, formats, saturation, scale_files, sizing
from fp8cache.kvcache import scales as kv_scales
from fp8cache.kvcache.layout import allocate_kv_cache
from fp8cache.kvcache.rotation import HADAMARD, NONE, rotation_matrix
from fp8cache.kvcache.spec import PENDING_SOURCE, KVCacheSpec, check_block_size, check_skip_layers
from fp8cache.model import attention, forward_context, fused_layer, sink_seats, step_metadata
from fp8cache.model.batch import StepBatch
from fp8cache.model.cpu import dtype_probe, packed_linear
from fp8cache.model.cuda import cuda_graph, float32_logits, gpu_errors
from fp8cache.model.forward_context import CONTEXT_KWARG, ForwardContext, ScaleCalculator
from fp8cache.model.loader import DTYPES, LoadedModel, load_model, read_config_dict, to_device
from fp8cache.platform import malloc_tuning, model_dtype
from fp8cache.platform.device import describe as describe_device
from fp8cache.platform.device import resolve_device


class ModelRunner:
    def __init__(self, config: EngineConfig, log: Callable[[str], None] = print,
                 loaded: LoadedModel | None = None):
        """`loaded` lets several runners share one model's weights (eval compares caches this way)."""
        config = dataclasses.replace(config, device=str(resolve_device(config.device)))
        config, self.tp = parallel_state.initialize(config)  # single process: unchanged config, rank 0 of 1
        self.config, self.log = config, log
        self.device = torch.device(config.device)
        backend = formats.backend_of(self.device)
        log(f"device: {describe_device(self.device)}")
        # Resolved once, before the model loads, so that a bad name fails fast; the spec keeps it.
        cache_dtype_name = formats.resolve_kv_cache_dtype(config.kv_cache_dtype, backend)
        if config.kv_scales_granularity not in kv_scales.GRANULARITIES:
            raise ValueError(f"kv_scales_granularity={config.kv_scales_granularity!r} is not known; valid: "
                             f"{', '.join(kv_scales.GRANULARITIES)}")
        self.dynamic_scales = self._resolve_dynamic_scales(cache_dtype_name)
        # A tensor-parallel rank shards on the host first, so only its share of the weights reaches its GPU.
        loaded = loaded or load_model(config, on_device=not self.tp.is_parallel)
        self.model, self.tokenizer, self.hf_config = loaded.model, loaded.tokenizer, loaded.hf_config
        self.model_path = loaded.model_path
        if self.tp.is_parallel:  # keep only this rank's heads and MLP columns
            sharding.shard_model(self.model, self.hf_config, self.tp.rank, self.tp.world_size)
            if next(self.model.parameters()).device != self.device:
                # Only a model that is not there yet (runners sharing one loaded model: the first moved it; a
                # CPU model's packed linears keep shape-only meta buffers, which cannot be moved).
                to_device(self.model, self.device)  # random weights (load_format dummy) get filled there
            if self.tp.is_driver:
                tp_worker.register_driver()
        self.dtype = next(self.model.parameters()).dtype
        log(f"model dtype: {model_dtype.describe(config.dtype, self.device, self.dtype, dtype_probe.cpu_auto_dtype)}")
        for note in loaded.notes:  # what the checkpoint holds besides plain weights (model/loader.py)
            log(note)
        ops.load(self.device)  # compiled once per source hash and cached on disk
        self._describe_ops(log)
        self._kernel_errors = gpu_errors.for_device(self.device)
        packed = packed_linear.pack_linears(self.model, self.device)
        if packed:
            panels = any(getattr(m, "panels", False) for m in self.model.modules())
            log(f"{packed} linear layers packed for {'fp8kv panels' if panels else 'oneDNN'}")
        if self.device.type == "cpu":
            malloc_tuning.keep_freed_memory_mapped()
        else:
            float32_logits.install(self.model, self.device)
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if getattr(head, "float32_out", False):  # only ever set on a 16-bit model's head
            log("logits in float32: the output projection's sums are not rounded to the model dtype")
        attention.install(self.model)
        # Projecting only the positions we need onto the vocabulary saves most of a prefill's lm_head work.
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._read_shapes()
        self.max_model_len = self._resolve_max_model_len()
        self.eos_token_ids = self._eos_token_ids()
        self.attention_window = attention.model_window(self.model)  # 0: some layer reads all its context
        fused = fused_layer.install(self.model)
        if fused:
            log(f"{fused} decoder layers run fp8kv's fused forward")
        scales = self._resolve_scales(loaded, cache_dtype_name)
        window, window_dtype = self._resolve_recent_window(cache_dtype_name, scales), self._resolve_window_dtype()
        # The one resolved description of the cache; only calculated scales replace it (_use_scales).
        self.kv_spec = KVCacheSpec.build(config.kv_cache_dtype, self.dtype, self.block_size, self.num_layers,
                                         self.num_kv_heads, self.head_size, scales, window, window_dtype,
                                         backend, self.device, cache_dtype_name=cache_dtype_name,
                                         dynamic=self.dynamic_scales,
                                         rotation=self._resolve_dynamic_rotation(),
                                         skip_layers=self._resolve_skip_layers(cache_dtype_name),
                                         window_sinks=self._resolve_window_sinks(window))
        self._init_cache()
        self._graphs = self._decode_graphs()
        self.saturation = self._saturation_counter()

    # ---- setup -------------------------------------------------------------------------------------

    def _describe_ops(self, log: Callable[[str], None]) -> None:
        from fp8cache.ops import _build

        built = _build.last_build()
        if built is None:
            return
        where = "CPU and CUDA kernels" if built.with_cuda else "CPU kernels only"
        log(f"op library: {built.path} ({where}, CPU path {built.isa})")
        if self.device.type == "cuda" and not built.with_cuda:
            raise RuntimeError(f"the fp8kv op library at {built.path} was built without its CUDA sources, so it "
                               f"cannot run on {self.device}; rebuild it on this machine with `fp8kv build` "
                               "(needs nvcc, or hipcc on ROCm)")

    def _read_shapes(self) -> None:
        cfg = self.hf_config
        self.num_layers = cfg.num_hidden_layers
        num_heads = cfg.num_attention_heads
        self.total_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        self.num_kv_heads = self.total_kv_heads // self.tp.world_size  # this rank's share (cache, scales)
        self.head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        self.block_size = self.config.block_size
        check_block_size(self.block_size)

    def _resolve_max_model_len(self) -> int:
        model_limit = getattr(self.hf_config, "max_position_embeddings", None)
        wanted = self.config.max_model_len
        if wanted is not None and model_limit is not None and wanted > model_limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's max_position_embeddings "
                             f"({model_limit}); use at most {model_limit}")
        length = wanted or model_limit
        if length is None:
            raise ValueError("the model config has no max_position_embeddings; set max_model_len")
        return int(length)  # sliding-window models too: the ops attend to each layer's window

    def _resolve_recent_window(self, cache_dtype_name: str, scales: kv_scales.KVScales | None) -> int:
        wanted = self.config.kv_recent_window
        if wanted is not None and (not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 0):
            raise ValueError(f"kv_recent_window={wanted!r} must be a whole number of tokens >= 0 "
                             "(0 keeps every token in FP8)")
        if cache_dtype_name == formats.AUTO:
            if wanted:
                self.log("note: kv_recent_window is ignored with kv-cache-dtype auto (the cache is full precision)")
            return 0
        recorded = scales.recent_window if scales is not None else None
        if wanted is None and recorded is not None:
            self.log(f"recent-token window: {recorded} tokens, as recorded in the KV scales ({scales.source})")
        window = wanted if wanted is not None else recorded if recorded is not None else DEFAULT_KV_RECENT_WINDOW
        return min(window, self.max_model_len)  # a longer ring could never fill

    def _resolve_window_sinks(self, window: int) -> int:
        """config.kv_recent_window_sinks: each sequence's first tokens kept in the ring beside the recent window
        (none without a window: the auto cache's note says why)."""
        sinks = self.config.kv_recent_window_sinks
        if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
            raise ValueError(f"kv_recent_window_sinks={sinks!r} must be a whole number of tokens >= 0 "
                             "(0: only the recent window)")
        return min(sinks, self.max_model_len) if window else 0

    def _resolve_window_dtype(self) -> torch.dtype:
        name = self.config.kv_recent_window_dtype
        if name == "auto":
            return self.dtype
        if name not in DTYPES:
            raise ValueError(f"kv_recent_window_dtype={name!r} is not known; valid: auto, {', '.join(DTYPES)}")
        return DTYPES[name]

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        generation_config = getattr(self.model, "generation_config", None)
        for source in (self.hf_config, generation_config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update([value] if isinstance(value, int) else list(value or []))
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _resolve_dynamic_scales(self, cache_dtype_name: str) -> bool:
        """Whether the cache keeps dynamic scales (config.kv_scales), refusing what cannot go with them."""
        config = self.config
        if dynamic_scales.check_kv_scales(config.kv_scales) != dynamic_scales.DYNAMIC:
            return False
        if cache_dtype_name == formats.AUTO:
            self.log("note: --kv-scales dynamic is ignored with kv-cache-dtype auto (the cache is full precision)")
            return False
        conflicts = [flag for flag, given in (("--quantization-param-path", config.quantization_param_path),
                                              ("--calculate-kv-scales", config.calculate_kv_scales)) if given]
        if conflicts:
            raise ValueError(f"--kv-scales dynamic computes a scale per token as the cache is written, so "
                             f"{' and '.join(conflicts)} would go unused; drop {' and '.join(conflicts)}, or use "
                             "--kv-scales static to use those scales")
        return True

    def _resolve_skip_layers(self, cache_dtype_name: str) -> tuple[int, ...]:
        """config.kv_cache_dtype_skip_layers, checked against the model's layers (a no-op for an auto cache)."""
        skip = check_skip_layers(self.config.kv_cache_dtype_skip_layers, self.num_layers)
        if skip and cache_dtype_name == formats.AUTO:
            self.log("note: kv_cache_dtype_skip_layers is ignored with kv-cache-dtype auto (every layer is full "
                     "precision)")
            return ()
        if len(skip) == self.num_layers:
            self.log("note: kv_cache_dtype_skip_layers names every layer: the cache is an auto cache")
        return skip

    def _resolve_dynamic_rotation(self) -> str:
        """config.kv_rotation for dynamic scales: auto is the Hadamard rotation where the head size allows it."""
        wanted = self.config.kv_rotation
        if wanted not in ("auto", NONE, HADAMARD):
            raise ValueError(f"kv_rotation={wanted!r} is not one of auto, none, hadamard")
        if not self.dynamic_scales:
            if wanted != "auto":
                self.log("note: --kv-rotation applies to --kv-scales dynamic; static scales use the rotation their "
                         "scales file records (fp8kv calibrate --kv-rotation)")
            return NONE
        if wanted != "auto":
            rotation_matrix(wanted, self.head_size)  # refuses a head size it cannot rotate, naming the fix
            return wanted
        try:
            rotation_matrix(HADAMARD, self.head_size)
        except ValueError:
            return NONE
        return HADAMARD

    def _resolve_scales(self, loaded: LoadedModel, cache_dtype_name: str) -> kv_scales.KVScales | None:
        """The scales by their precedence (None: calculated from the first batch, or dynamic scales)."""
        if self.dynamic_scales:
            if loaded.checkpoint_scale_tensors:
                self.log("note: the checkpoint's KV scales are not used: --kv-scales dynamic computes a scale per "
                         "token and KV head (use --kv-scales static to use them)")
            return None
        if cache_dtype_name == formats.AUTO and self.config.quantization_param_path:
            self.log("warning: --quantization-param-path is ignored with kv-cache-dtype auto")
        scales = scale_files.resolve_scales(
            cache_dtype_name, self.num_layers, self.total_kv_heads,
            quantization_param_path=self.config.quantization_param_path, tp_rank=self.tp.rank,
            tp_size=self.tp.world_size,
            checkpoint_tensors=loaded.checkpoint_scale_tensors, config=read_config_dict(self.model_path),
            calculate=self.config.calculate_kv_scales, warn=lambda msg: self.log(f"warning: {msg}"))
        self.log(f"KV scales: {scales.source if scales is not None else PENDING_SOURCE}")
        return scales

    @contextlib.contextmanager
    def scales_kept_pending(self) -> Iterator[None]:
        """Scales still to be calculated stay so after the block (the engine's warm-up must not calculate them
        from its own two tokens)."""
        spec = self.kv_spec
        try:
            yield
        finally:
            if spec.scales_pending and not self.kv_spec.scales_pending:
                self._replace_spec(spec)

    def capture_decode_graphs(self) -> int:
        """Capture the decode CUDA graphs of every padded batch size now (from the last decode step's shape), not
        on first use; how many were captured (0 where decode steps run without graphs)."""
        return self._graphs.capture_all() if self._graphs is not None else 0

    def _use_scales(self, scales: kv_scales.KVScales) -> None:
        self._replace_spec(self.kv_spec.with_scales(scales, self.device))

    def _replace_spec(self, spec: KVCacheSpec) -> None:
        self.kv_spec = spec
        if getattr(self, "_graphs", None) is not None:
            self._graphs.invalidate()  # they read the old scale tensors

    def _init_cache(self) -> None:
        spec = self.kv_spec
        self.bytes_per_token = sizing.spec_bytes_per_token(spec)
        plan = sizing.plan_for(spec, self.config.kv_cache_memory, self.config.kv_cache_memory_fraction,
                               self.config.max_num_seqs, self.max_model_len, self._device_limit())
        # Rank 0 hands out block ids, so every rank needs at least as many blocks as rank 0 plans.
        plan.num_blocks = parallel_state.all_reduce_min_int(plan.num_blocks)
        if plan.window_seats:
            plan.window_seats = parallel_state.all_reduce_min_int(plan.window_seats)
        self.cache_plan = plan
        self.num_blocks, self.capacity_tokens = plan.num_blocks, plan.capacity_tokens
        self.kv_caches = sizing.allocate_caches(allocate_kv_cache, spec, self.num_blocks, self.device)
        self.window_caches = sizing.allocate_caches(allocate_kv_cache, spec, plan.window_num_blocks,
                                                    self.device, window=True) if plan.window_seats else None
        self.scale_caches = spec.allocate_scale_caches(self.num_blocks, self.device)
        for line in sizing.describe(plan, _cache_label(spec), self.max_model_len, self.config.max_num_seqs,
                                    spec.model_dtype, spec.window_dtype):
            self.log(line)
        if spec.dynamic_scales:
            scale_bytes = dynamic_scales.bytes_per_token(spec.num_fp8_layers, spec.num_kv_heads)
            self.log(f"KV scales: dynamic, {scale_bytes} of the {self.bytes_per_token} bytes per token "
                     f"({100 * scale_bytes / self.bytes_per_token:.1f}%), rotation {spec.rotation}")

    def _saturation_counter(self) -> saturation.SaturationCounter | None:
        """Counts of clipped and flushed K/V values for an FP8 cache (dynamic scales never clip, but flush)."""
        spec = self.kv_spec
        fmt = formats.get_format(spec.format)
        if fmt is None:
            return None
        return saturation.SaturationCounter(self.num_layers, fmt, self.device,
                                            warn=lambda msg: self.log(f"warning: {msg}"), dynamic=spec.dynamic_scales)

    def saturation_counts(self) -> list[saturation.LayerSaturation]:
        """Per layer and for K and V: values counted, clipped, flushed to zero (empty: nothing is counted)."""
        return self.saturation.snapshot() if self.saturation is not None else []

    def _decode_graphs(self) -> cuda_graph.DecodeGraphs | None:
        """CUDA graphs for decode steps: on a GPU with the compiled ops and fp8kv's lean layers (whose steps
        never wait for the GPU), unless enforce_eager."""
        if self.device.type != "cuda" or self.config.enforce_eager or self.tp.is_parallel:
            return None
        if not any(isinstance(m.__dict__.get("forward"), fused_layer.FusedDecoderLayer) for m in self.model.modules()):
            return None
        self.log("decode steps replay CUDA graphs (captured per padded batch size on first use; --enforce-eager "
                 "runs them op by op)")
        table_width = -(-self.max_model_len // self.block_size)
        return cuda_graph.DecodeGraphs(self.device, self.config.max_num_seqs, table_width, self.max_model_len,
                                       self._build_context, lambda ids, pos, ctx: self._forward(ids, pos, None, ctx),
                                       self.log)

    def _build_context(self, batch: StepBatch, extra: dict[str, np.ndarray] | None = None, arrays_only: bool = False,
                       **shape) -> ForwardContext | dict[str, np.ndarray]:
        if arrays_only:
            return forward_context.step_arrays(batch, self.kv_caches, self.kv_spec.block_size, self.kv_spec.window_size,
                                               self.window_caches, extra, shape.get("table_width"),
                                               self.kv_spec.window_sinks)[0]
        return forward_context.build_forward_context(
            batch, ops=ops, kv_caches=self.kv_caches, spec=self.kv_spec,
            device=self.device, window_caches=self.window_caches, extra=extra, scale_caches=self.scale_caches,
            **shape)

    def _device_limit(self) -> sizing.DeviceLimit | None:
        """What the cache may take on a GPU (None: the host's share, see sizing.plan_cache)."""
        if self.device.type != "cuda":
            return None
        return sizing.gpu_limit(self.device, self.config.gpu_memory_utilization, self._activation_bytes())

    def _activation_bytes(self) -> int:
        """A bound on what one forward pass of max_num_batched_tokens tokens allocates besides the cache: the
        widest layer's temporaries (hidden, q/k/v, gate/up in the model dtype, attention's float32 scratch)
        and float32 logits for the rows that keep them. The caching allocator keeps what it once held, so
        this is kept free for it, with 256 MiB for the CUDA context's own growth (graphs, cuBLAS)."""
        cfg, tokens = self.hf_config, self.config.max_num_batched_tokens
        element = torch.empty((), dtype=self.dtype).element_size()
        heads = cfg.num_attention_heads // self.tp.world_size
        width = (4 * cfg.hidden_size + (heads + 2 * self.num_kv_heads) * self.head_size
                 + 3 * getattr(cfg, "intermediate_size", 4 * cfg.hidden_size) // self.tp.world_size)
        logits_rows = max(self.config.max_num_seqs, tokens)  # prompt logprobs keep every fed row
        return tokens * width * element * 2 + 2 * logits_rows * cfg.vocab_size * 4 + (256 << 20)

    @property
    def supports_overlap(self) -> bool:
        """Whether execute() can take input ids from the previous step's tokens on the device (the engine's
        overlapped loop). Not with tensor parallelism: the other ranks would need those tokens too."""
        return not self.tp.is_parallel

    @property
    def cache_fingerprint(self) -> str:
        """What the cached bytes mean; prefix-cache hashes include it so changed scales never hit."""
        return self.kv_spec.fingerprint

    # Read-only views of kv_spec under the names the engine, server, bench and tests read.

    @property
    def cache_dtype_name(self) -> str:
        """The canonical kv-cache-dtype ("fp8" resolved for the device); config.kv_cache_dtype is the user's."""
        return self.kv_spec.cache_dtype_name

    @property
    def kv_recent_window(self) -> int:
        return self.kv_spec.window_size

    @property
    def kv_recent_window_sinks(self) -> int:
        return self.kv_spec.window_sinks

    @property
    def window_dtype(self) -> torch.dtype:
        return self.kv_spec.window_dtype

    @property
    def scales(self) -> kv_scales.KVScales | None:
        return self.kv_spec.scales

    @property
    def scales_source(self) -> str:
        return self.kv_spec.scales_source

    @property
    def _k_scales(self) -> list[torch.Tensor]:
        return list(self.kv_spec.k_scales)

    @property
    def _v_scales(self) -> list[torch.Tensor]:
        return list(self.kv_spec.v_scales)

    @property
    def kv_rotation(self) -> str:
        return self.kv_spec.rotation

    @kv_rotation.setter
    def kv_rotation(self, rotation: str) -> None:
        # Tests rotate a runner whose scales were made for unrotated K/V, to compare the two paths.
        self._replace_spec(dataclasses.replace(self.kv_spec, rotation=rotation))

    # ---- one step ----------------------------------------------------------------------------------

    def execute(self, batch: StepBatch, all_logits: bool = False,
                prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits, [rows, vocab]: in seq order, every fed token of a prompt_logits chunk, the last one of
        a want_logits chunk (the last 1 + num_draft_tokens of a verify chunk); with all_logits every token. Queued on a GPU, not waited for.

        prev_tokens: the previous step's sampled tokens, on the device, when batch.future_rows take their input
        ids from them (the overlapped loop)."""
        self._check_batch(batch, prev_tokens)
        with tp_worker.driver_step(batch, all_logits):  # rank 0 of several: the other ranks run it too
            return self._execute(batch, all_logits, prev_tokens)

    def _execute(self, batch: StepBatch, all_logits: bool, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        if self._kernel_errors is not None:
            self._kernel_errors.check()  # what an earlier step's kernels reported, now that it has landed
        rows = None if all_logits else self._logits_rows(batch)
        if self.kv_spec.window_sinks:  # before any layer reads them, decode steps' graphs too
            sink_seats.fill_sink_seats(self.kv_spec, self.kv_caches, self.scale_caches, self.window_caches,
                                       *sink_seats.sink_fills(batch, self.kv_spec))
        calculating = self.kv_spec.scales_pending
        counting = self.saturation is not None and self.saturation.start_step()
        # A verify step (speculative decoding) runs eagerly: the graphs are captured for one-token decode rows, and
        # a verify chunk of 1 + K tokens attends through the paged prefill path. Graphs for its shapes would pay
        # little: the step waits for its logits on the host anyway (acceptance), and its launches serve K + 1 tokens.
        if self._graphs is not None and rows is None and not calculating and not counting and not all_logits \
                and not batch.num_draft_tokens:
            logits = self._graphs.run(batch, prev_tokens)
            if logits is not None:
                if self._kernel_errors is not None:
                    self._kernel_errors.after_step()
                return logits
        extra = {"input_ids": np.asarray(batch.token_ids, dtype=np.int64)[None],
                 "positions": np.asarray(batch.positions, dtype=np.int64)[None]}
        if rows is not None:
            extra["logits_rows"] = rows
        ctx = self._build_context(batch, extra | step_metadata.future_arrays(batch))
        step_metadata.feed_tokens(ctx.extra["input_ids"], ctx.extra, prev_tokens)
        amax: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if calculating:
            ctx.calculate_scales = self._scale_calculator(ctx.slot_mapping, amax)
        if counting:
            ctx.saturation = self.saturation
        logits = self._forward(ctx.extra["input_ids"], ctx.extra["positions"], ctx.extra.get("logits_rows"), ctx)
        if calculating:
            self._finish_calculation(amax)
        if counting:
            self.saturation.finish_step()
        if self._kernel_errors is not None:
            self._kernel_errors.after_step()
        return logits if logits.dtype == torch.float32 else logits.to(torch.float32)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None,
                 ctx: ForwardContext) -> torch.Tensor:
        """The model's logits [rows, vocab] (every position when rows is None) in the model dtype. The step's
        context rides down to every attention layer as a keyword argument of the model's forward."""
        step = {CONTEXT_KWARG: ctx}
        with torch.inference_mode():
            if self._takes_logits_to_keep:
                return self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                  logits_to_keep=0 if rows is None else rows, **step).logits[0]
            # older remote-code models: project every position, then pick
            logits = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, **step).logits[0]
            return logits if rows is None else logits.index_select(0, rows)

    def _check_batch(self, batch: StepBatch, prev_tokens: torch.Tensor | None = None) -> None:
        n = len(batch.token_ids)
        if not batch.seqs or n == 0:
            raise ValueError("StepBatch holds no sequences or no tokens")
        if batch.future_rows:
            _check_future_rows(batch, n, prev_tokens)
        if len(batch.positions) != n or len(batch.slot_mapping) != n:
            raise ValueError(f"StepBatch has {n} token_ids but {len(batch.positions)} positions and "
                             f"{len(batch.slot_mapping)} slot_mapping entries; they must match")
        if sum(s.query_len for s in batch.seqs) != n:
            raise ValueError(f"StepBatch seqs' query_len add up to {sum(s.query_len for s in batch.seqs)}, "
                             f"but it has {n} tokens")
        if self.kv_recent_window and len(batch.window_slot_mapping) != n:
            raise ValueError(f"StepBatch has {n} token_ids but {len(batch.window_slot_mapping)} "
                             f"window_slot_mapping entries; with kv_recent_window they must match")
        ring_blocks = self.cache_plan.window_blocks_per_seat
        for i, s in enumerate(batch.seqs):
            if self.kv_recent_window and len(s.window_block_table) != ring_blocks:
                raise ValueError(f"seq {i}: window_block_table has {len(s.window_block_table)} blocks; the "
                                 f"recent-token window of {self.kv_recent_window} tokens and "
                                 f"{self.kv_spec.window_sinks} sinks needs {ring_blocks}")
            if s.query_len < 1 or s.context_len < s.query_len:
                raise ValueError(f"seq {i}: query_len {s.query_len} and context_len {s.context_len} need "
                                 "1 <= query_len <= context_len")
            if s.context_len > self.max_model_len:
                raise ValueError(f"seq {i}: context_len {s.context_len} exceeds max_model_len "
                                 f"{self.max_model_len}")
            if len(s.block_table) * self.block_size < s.context_len:
                raise ValueError(f"seq {i}: block_table of {len(s.block_table)} blocks cannot hold "
                                 f"context_len {s.context_len} with block_size {self.block_size}")

    @staticmethod
    def _logits_rows(batch: StepBatch) -> np.ndarray | None:
        """The packed rows whose logits the step returns; None when that is every row (a decode step)."""
        rows, offset = [], 0
        for s in batch.seqs:
            if s.prompt_logits:
                rows.extend(range(offset, offset + s.query_len))
            elif s.want_logits:  # a verify chunk: its drafts' rows and the row before them
                rows.extend(range(offset + s.query_len - 1 - s.num_draft_tokens, offset + s.query_len))
            offset += s.query_len
        return None if len(rows) == offset else np.asarray(rows, dtype=np.int64)

    # ---- calculate_kv_scales -----------------------------------------------------------------------

    def _scale_calculator(self, slot_mapping: torch.Tensor,
                          amax: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> ScaleCalculator:
        # Padding tokens are not stored, so they do not shape the scales (a mask, not a boolean index: no
        # wait for the device to count the valid rows).
        padding = (slot_mapping < 0)[:, None, None]
        fmt, granularity = self.kv_spec.cache_dtype_name, self.config.kv_scales_granularity

        def calculate(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k_amax = k.abs().masked_fill(padding, 0).amax(dim=(0, 2)).to(torch.float32)  # per KV head
            v_amax = v.abs().masked_fill(padding, 0).amax(dim=(0, 2)).to(torch.float32)
            if granularity == "tensor" and self.tp.is_parallel:  # one scale per layer across all ranks' heads
                k_amax = parallel_state.all_reduce_max(k_amax.max().reshape(1))
                v_amax = parallel_state.all_reduce_max(v_amax.max().reshape(1))
            amax[layer] = (k_amax, v_amax)
            one = kv_scales.compute_scales([k_amax], [v_amax], fmt, granularity)
            return one.k[0].to(self.device), one.v[0].to(self.device)

        return calculate

    def _finish_calculation(self, amax: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        if sorted(amax) != list(range(self.num_layers)):
            raise RuntimeError(f"calculate_kv_scales saw layers {sorted(amax)} of {self.num_layers}")
        scales = kv_scales.compute_scales([amax[i][0].cpu() for i in range(self.num_layers)],
                                          [amax[i][1].cpu() for i in range(self.num_layers)],
                                          self.kv_spec.cache_dtype_name, self.config.kv_scales_granularity)
        self._use_scales(scales)
        self.log(f"KV scales calculated from the first batch ({self.config.kv_scales_granularity}), "
                 f"fingerprint {scales.fingerprint()}")


def _cache_label(spec: KVCacheSpec) -> str:
    """The cache's dtype for the start log: with skipped layers, which of them hold the model dtype."""
    if not spec.skip_layers:
        return spec.cache_dtype_name
    dtype = str(spec.model_dtype).removeprefix("torch.")
    s = "s" if len(spec.skip_layers) > 1 else ""
    return f"{spec.cache_dtype_name} ({dtype} in layer{s} {','.join(map(str, spec.skip_layers))})"


def _check_future_rows(batch: StepBatch, n: int, prev_tokens: torch.Tensor | None) -> None:
    """Rows fed from the previous step's tokens must name a token row and a row of those tokens (checked here,
    on the host: a bad index on the device would be a kernel fault, not an error)."""
    if prev_tokens is None:
        raise ValueError("StepBatch.future_rows take tokens of the previous step, but execute() got no prev_tokens")
    if len(batch.future_src) != len(batch.future_rows):
        raise ValueError(f"StepBatch has {len(batch.future_rows)} future_rows but {len(batch.future_src)} future_src")
    if min(batch.future_rows) < 0 or max(batch.future_rows) >= n:
        raise ValueError(f"StepBatch future_rows must lie in [0, {n})")
    if min(batch.future_src) < 0 or max(batch.future_src) >= prev_tokens.shape[0]:
        raise ValueError(f"StepBatch future_src must lie in [0, {prev_tokens.shape[0]}): the previous step's rows")
