"""The model runner: one forward pass of a Hugging Face causal LM per engine step, over the paged cache."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

import torch

from fp8cache import formats, ops
from fp8cache import scales as kv_scales
from fp8cache.config import DEFAULT_KV_RECENT_WINDOW, EngineConfig
from fp8cache.distributed import parallel_state, sharding
from fp8cache.distributed import worker as tp_worker
from fp8cache.model import attention, fused_layer, kv_cache, malloc_tuning, packed_linear
from fp8cache.model.batch import StepBatch
from fp8cache.model.loader import DTYPES, LoadedModel, load_model, read_config_dict
from fp8cache.rotation import rotation_matrix


def select_ops(log: Callable[[str], None]) -> tuple[object, Callable]:
    """(ops namespace, gather_kv): the compiled ops, or the pure-torch reference if FP8KV_REFERENCE_OPS=1."""
    if os.environ.get("FP8KV_REFERENCE_OPS") == "1":
        log("Using the pure-torch reference ops (FP8KV_REFERENCE_OPS=1): slow, for testing")
        return ops.reference, ops.reference.gather_kv
    ops.load()
    # A compiled gather is used when the ops library offers one; the reference reads the same bytes.
    return ops, getattr(ops, "gather_kv", ops.reference.gather_kv)


class ModelRunner:
    def __init__(self, config: EngineConfig, log: Callable[[str], None] = print,
                 loaded: LoadedModel | None = None):
        """`loaded` lets several runners share one model's weights (eval compares caches this way)."""
        config, self.tp = parallel_state.initialize(config)  # single process: unchanged config, rank 0 of 1
        self.config, self.log = config, log
        self.device = torch.device(config.device)
        backend = formats.backend_of(self.device)
        self.kv_cache_dtype = formats.resolve_kv_cache_dtype(config.kv_cache_dtype, backend)
        if config.kv_scales_granularity not in kv_scales.GRANULARITIES:
            raise ValueError(f"kv_scales_granularity={config.kv_scales_granularity!r} is not known; valid: "
                             f"{', '.join(kv_scales.GRANULARITIES)}")
        loaded = loaded or load_model(config)
        self.model, self.tokenizer, self.hf_config = loaded.model, loaded.tokenizer, loaded.hf_config
        self.model_path = loaded.model_path
        if self.tp.is_parallel:  # keep only this rank's heads and MLP columns
            sharding.shard_model(self.model, self.hf_config, self.tp.rank, self.tp.world_size)
            if self.tp.is_driver:
                tp_worker.register_driver()
        self.dtype = next(self.model.parameters()).dtype
        self._ops, self._gather_kv = select_ops(log)
        packed = packed_linear.pack_linears(self.model, self.device, compiled_ops=self._ops is ops)
        if packed:
            panels = any(getattr(m, "panels", False) for m in self.model.modules())
            log(f"{packed} linear layers packed for {'fp8kv float32 panels' if panels else 'oneDNN'} "
                "(FP8KV_PACK_LINEARS=0 keeps them plain)")
        if self.device.type == "cpu":
            malloc_tuning.keep_freed_memory_mapped()
        attention.install(self.model)
        # Projecting only the positions we need onto the vocabulary saves most of a prefill's lm_head work.
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._read_shapes()
        self.max_model_len = self._resolve_max_model_len()
        self.eos_token_ids = self._eos_token_ids()
        if self.device.type == "cpu":
            fused = fused_layer.install(self.model, compiled=self._ops is ops)
            if fused:
                log(f"{fused} decoder layers run fp8kv's fused forward (FP8KV_FUSED_LAYERS=0 keeps transformers')")
        self._init_scales(loaded)
        self.kv_recent_window = self._resolve_recent_window()
        self.window_dtype = self._resolve_window_dtype()
        self._init_cache(backend)

    # ---- setup -------------------------------------------------------------------------------------

    def _read_shapes(self) -> None:
        cfg = self.hf_config
        self.num_layers = cfg.num_hidden_layers
        num_heads = cfg.num_attention_heads
        self.total_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        self.num_kv_heads = self.total_kv_heads // self.tp.world_size  # this rank's share (cache, scales)
        self.head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        self.block_size = self.config.block_size
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be a positive number of tokens (8, 16, 32)")

    def _resolve_max_model_len(self) -> int:
        model_limit = getattr(self.hf_config, "max_position_embeddings", None)
        wanted = self.config.max_model_len
        if wanted is not None and model_limit is not None and wanted > model_limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's max_position_embeddings "
                             f"({model_limit}); use at most {model_limit}")
        length = wanted or model_limit
        if length is None:
            raise ValueError("the model config has no max_position_embeddings; set max_model_len")
        window = getattr(self.hf_config, "sliding_window", None)
        if window and getattr(self.hf_config, "use_sliding_window", True) and length > window:
            # Our attention is full attention; beyond the window it would differ from the model's own.
            self.log(f"max_model_len {length} is capped to the model's sliding window {window}")
            length = window
        return int(length)

    def _resolve_recent_window(self) -> int:
        wanted = self.config.kv_recent_window
        if wanted is not None and (not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 0):
            raise ValueError(f"kv_recent_window={wanted!r} must be a whole number of tokens >= 0 "
                             "(0 keeps every token in FP8)")
        if self.kv_cache_dtype == formats.AUTO:
            if wanted:
                self.log("note: kv_recent_window is ignored with kv-cache-dtype auto (the cache is full precision)")
            return 0
        recorded = self.scales.recent_window if self.scales is not None else None
        if wanted is None and recorded is not None:
            self.log(f"recent-token window: {recorded} tokens, as recorded in the KV scales ({self.scales.source})")
        window = wanted if wanted is not None else recorded if recorded is not None else DEFAULT_KV_RECENT_WINDOW
        return min(window, self.max_model_len)  # a longer ring could never fill

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

    def _init_scales(self, loaded: LoadedModel) -> None:
        if self.kv_cache_dtype == formats.AUTO and self.config.quantization_param_path:
            self.log("warning: --quantization-param-path is ignored with kv-cache-dtype auto")
        self.kv_rotation = "none"  # "hadamard" when the scales were made for rotated K/V
        self.scales = kv_scales.resolve_scales(
            self.kv_cache_dtype, self.num_layers, self.total_kv_heads,
            quantization_param_path=self.config.quantization_param_path, tp_rank=self.tp.rank,
            tp_size=self.tp.world_size,
            checkpoint_tensors=loaded.checkpoint_scale_tensors, config=read_config_dict(self.model_path),
            calculate=self.config.calculate_kv_scales, warn=lambda msg: self.log(f"warning: {msg}"))
        if self.scales is None:
            self.scales_source = "pending: calculated from the first batch"
            ones = kv_scales.ones(self.num_layers, self.kv_cache_dtype)
            self._k_scales, self._v_scales = ones.k, ones.v  # placeholders until the first step
        else:
            self._use_scales(self.scales)
        self.log(f"KV scales: {self.scales_source}")

    def _use_scales(self, scales: kv_scales.KVScales) -> None:
        try:
            rotation_matrix(scales.rotation, self.head_size)  # refuses head sizes it cannot rotate
        except ValueError as e:
            raise ValueError(f"KV scales from {scales.source}: {e}") from None
        for kind, tensors in (("k", scales.k), ("v", scales.v)):
            for i, t in enumerate(tensors):
                if t.numel() not in (1, self.num_kv_heads):
                    raise ValueError(f"{kind} scale of layer {i} from {scales.source} has {t.numel()} values; "
                                     f"expected 1 or num_kv_heads={self.num_kv_heads}")
        self.scales, self.scales_source, self.kv_rotation = scales, scales.source, scales.rotation
        self._k_scales = [t.to(self.device, torch.float32).contiguous() for t in scales.k]
        self._v_scales = [t.to(self.device, torch.float32).contiguous() for t in scales.v]

    def _init_cache(self, backend: str) -> None:
        self.bytes_per_token = kv_cache.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_size,
                                                        self.kv_cache_dtype, self.dtype, backend)
        window_token_bytes = kv_cache.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_size,
                                                      formats.AUTO, self.window_dtype, backend)
        plan = kv_cache.plan_cache(self.config.kv_cache_memory, self.config.kv_cache_memory_fraction,
                                   self.block_size, self.bytes_per_token, self.kv_recent_window,
                                   window_token_bytes, self.config.max_num_seqs, self.max_model_len)
        # Rank 0 hands out block ids, so every rank needs at least as many blocks as rank 0 plans.
        plan.num_blocks = parallel_state.all_reduce_min_int(plan.num_blocks)
        if plan.window_seats:
            plan.window_seats = parallel_state.all_reduce_min_int(plan.window_seats)
        self.cache_plan = plan
        self.num_blocks, self.capacity_tokens = plan.num_blocks, plan.capacity_tokens
        self.kv_caches = kv_cache.allocate_caches(
            ops.allocate_kv_cache, self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads,
            self.head_size, self.kv_cache_dtype, self.dtype, str(self.device))
        self.window_caches = kv_cache.allocate_caches(
            ops.allocate_kv_cache, self.num_layers, plan.window_num_blocks, self.block_size, self.num_kv_heads,
            self.head_size, formats.AUTO, self.window_dtype, str(self.device)) if plan.window_seats else None
        for line in kv_cache.describe(plan, self.kv_cache_dtype, self.max_model_len, self.config.max_num_seqs,
                                      self.dtype, self.window_dtype):
            self.log(line)

    @property
    def cache_fingerprint(self) -> str:
        """What the cached bytes mean; prefix-cache hashes include it so changed scales never hit."""
        if self.kv_cache_dtype == formats.AUTO:
            return f"auto:{self.dtype}"
        if self.scales is None:
            return f"{self.kv_cache_dtype}:pending"
        # The engine asks twice a step; hashing every scale each time is measurable. New scales are a new object.
        key = (self.scales, self.scales.rotation)
        memo = getattr(self, "_fingerprint_memo", None)
        if memo is None or memo[0] is not key[0] or memo[1] != key[1]:
            memo = self._fingerprint_memo = (*key, self.scales.fingerprint())
        return f"{self.kv_cache_dtype}:{memo[2]}:{self.scales.rotation}"

    # ---- one step ----------------------------------------------------------------------------------

    def execute(self, batch: StepBatch, all_logits: bool = False) -> torch.Tensor:
        """float32 logits, [rows, vocab]: in seq order, every fed token of a prompt_logits chunk, the last one of
        a want_logits chunk; with all_logits every token."""
        self._check_batch(batch)
        with tp_worker.driver_step(batch, all_logits):  # rank 0 of several: the other ranks run it too
            return self._execute(batch, all_logits)

    def _execute(self, batch: StepBatch, all_logits: bool) -> torch.Tensor:
        ctx = attention.build_forward_context(
            batch, ops=self._ops, gather_kv=self._gather_kv, kv_caches=self.kv_caches,
            k_scales=self._k_scales, v_scales=self._v_scales, kv_cache_dtype=self.kv_cache_dtype,
            block_size=self.block_size, device=self.device,
            rotation=self.kv_rotation,
            window_size=self.kv_recent_window, window_caches=self.window_caches)
        calculating = self.scales is None and self.kv_cache_dtype != formats.AUTO
        amax: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if calculating:
            ctx.calculate_scales = self._scale_calculator(ctx.slot_mapping, amax)
        input_ids = torch.tensor([batch.token_ids], dtype=torch.long, device=self.device)
        positions = torch.tensor([batch.positions], dtype=torch.long, device=self.device)
        keep = self._logits_index(batch, all_logits)
        with torch.inference_mode(), attention.forward_context(ctx):
            if self._takes_logits_to_keep:
                logits = self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                    logits_to_keep=keep).logits[0]
            else:  # older remote-code models: project every position, then pick
                logits = self.model(input_ids=input_ids, position_ids=positions, use_cache=False).logits[0]
                logits = logits if all_logits else logits[keep]
        if calculating:
            self._finish_calculation(amax)
        return logits.to(torch.float32)

    def _check_batch(self, batch: StepBatch) -> None:
        n = len(batch.token_ids)
        if not batch.seqs or n == 0:
            raise ValueError("StepBatch holds no sequences or no tokens")
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
                                 f"recent-token window of {self.kv_recent_window} tokens needs {ring_blocks}")
            if s.query_len < 1 or s.context_len < s.query_len:
                raise ValueError(f"seq {i}: query_len {s.query_len} and context_len {s.context_len} need "
                                 "1 <= query_len <= context_len")
            if s.context_len > self.max_model_len:
                raise ValueError(f"seq {i}: context_len {s.context_len} exceeds max_model_len "
                                 f"{self.max_model_len}")
            if len(s.block_table) * self.block_size < s.context_len:
                raise ValueError(f"seq {i}: block_table of {len(s.block_table)} blocks cannot hold "
                                 f"context_len {s.context_len} with block_size {self.block_size}")

    def _logits_index(self, batch: StepBatch, all_logits: bool) -> int | torch.Tensor:
        if all_logits:
            return 0  # transformers: 0 keeps every position
        rows, offset = [], 0
        for s in batch.seqs:
            if s.prompt_logits:
                rows.extend(range(offset, offset + s.query_len))
            elif s.want_logits:
                rows.append(offset + s.query_len - 1)
            offset += s.query_len
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    # ---- calculate_kv_scales -----------------------------------------------------------------------

    def _scale_calculator(self, slot_mapping: torch.Tensor,
                          amax: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> attention.ScaleCalculator:
        valid = slot_mapping >= 0  # padding tokens are not stored, so they do not shape the scales
        fmt, granularity = self.kv_cache_dtype, self.config.kv_scales_granularity

        def calculate(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k_amax = k[valid].abs().amax(dim=(0, 2)).to(torch.float32)  # per KV head
            v_amax = v[valid].abs().amax(dim=(0, 2)).to(torch.float32)
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
                                          self.kv_cache_dtype, self.config.kv_scales_granularity)
        self._use_scales(scales)
        self.log(f"KV scales calculated from the first batch ({self.config.kv_scales_granularity}), "
                 f"fingerprint {scales.fingerprint()}")
