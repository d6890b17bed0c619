"""Offline batch generation with vLLM's `LLM` interface.

    from fp8cache import LLM, SamplingParams
    llm = LLM(kv_cache_dtype="fp8")
    out = llm.generate("London is the capital of", SamplingParams(temperature=0.7, top_p=0.8))

With tensor_parallel_size=N > 1 this process is rank 0 and starts N-1 worker processes itself (see
fp8cache/distributed/group.py); `with LLM(...) as llm:` or llm.close() stops them, and so does this process's
exit. Under an outside launcher (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, e.g. torchrun) RANK 0 makes the
LLM and the other ranks run `fp8kv run --num-shard N` with the same engine flags.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Self

from fp8cache.config import EngineConfig
from fp8cache.engine.generation_defaults import (
    GenerationDefaults,
    check_generation_flags,
    load_generation_defaults,
)
from fp8cache.engine.llm_engine import LLMEngine
from fp8cache.engine.outputs import RequestOutput
from fp8cache.engine.sampling_params import SamplingParams
from fp8cache.engine.warmup import warm_up
from fp8cache.platform.log import configure_default_logging, log_function

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


class LLM:
    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: str = "auto",
                 kv_cache_dtype: str = "auto", quantization_param_path: str | None = None,
                 calculate_kv_scales: bool = False, block_size: int = 16, max_model_len: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 kv_cache_memory: int | str | None = None, enable_prefix_caching: bool = True, seed: int = 0,
                 trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 log: Callable[[str], None] | None = None, **kwargs) -> None:
        """vLLM's LLM arguments (and any other EngineConfig field as a keyword). log: where loading and
        progress lines go; default the "fp8kv.llm" logger, which writes to stderr unless the application set
        up logging itself (see fp8cache/platform/log.py). Prompts go to the model as given: use chat() for the
        chat template (`fp8kv generate` applies it by default). generation_config="auto" (the default) makes the
        model's generation_config.json the defaults of a call without sampling_params, as in vLLM
        (get_default_sampling_params); "vllm" ignores it."""
        unknown = sorted(set(kwargs) - _CONFIG_FIELDS)
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {', '.join(unknown)}; "
                            f"accepted: {', '.join(sorted(_CONFIG_FIELDS))}")
        config = EngineConfig(model=model, tokenizer=tokenizer, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                              quantization_param_path=quantization_param_path,
                              calculate_kv_scales=calculate_kv_scales, block_size=block_size,
                              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
                              enable_prefix_caching=enable_prefix_caching, seed=seed,
                              trust_remote_code=trust_remote_code, tensor_parallel_size=tensor_parallel_size,
                              **kwargs)
        self._start(config, log)

    @classmethod
    def from_config(cls, config: EngineConfig, log: Callable[[str], None] | None = None) -> LLM:
        """An LLM for a ready EngineConfig (what `fp8kv generate` builds from its flags)."""
        llm = cls.__new__(cls)
        llm._start(config, log)
        return llm

    def _start(self, config: EngineConfig, log: Callable[[str], None] | None) -> None:
        from fp8cache.distributed import parallel_state
        from fp8cache.model.preflight import check_engine_scales

        check_engine_scales(config)  # a bad scales file fails before workers start or weights load
        check_generation_flags(config.generation_config, config.override_generation_config)  # and bad defaults

        if log is None:
            configure_default_logging()
            log = log_function("fp8kv.llm")

        self.tp_group = None  # the worker processes this LLM started, if any
        self.llm_engine: LLMEngine | None = None
        self.generation_defaults = GenerationDefaults()
        self._request_ids = itertools.count()
        runner = None
        size = config.tensor_parallel_size
        if isinstance(size, int) and size > 1:
            rank = parallel_state.env_rank()
            if rank is None:
                from fp8cache.model.preflight import check_model_divisible
                from fp8cache.model.tp_ranks import start_group
                from fp8cache.platform.device import resolve_device

                resolve_device(config.device)  # before the workers start and each load the weights
                check_model_divisible(config)
                self.tp_group = start_group([config], log=log)
                runner = self.tp_group.runners[0]
            elif rank != 0:
                raise ValueError(f"RANK={rank} is set, so an outside launcher started this process as a "
                                 f"worker rank: there, run `fp8kv run --num-shard {size}` with the same "
                                 "engine flags (only RANK 0 makes the LLM), or unset RANK to let LLM start "
                                 "its ranks")
        try:
            self.llm_engine = LLMEngine(config, log=log, runner=runner)
            warm_up(self.llm_engine, log)  # a model that cannot run fails here, not in the first generate()
            model_path = getattr(self.llm_engine.runner, "model_path", None) or config.model
            self.generation_defaults = load_generation_defaults(config.generation_config, model_path,
                                                                config.override_generation_config)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the tensor-parallel workers (if any) and let the model and KV cache go; idempotent."""
        group, self.tp_group = self.tp_group, None
        self.llm_engine = None
        if group is not None:
            group.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def engine(self) -> LLMEngine:
        if self.llm_engine is None:
            raise RuntimeError("this LLM was closed; make a new LLM to generate again")
        return self.llm_engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate(), chat() and stream() use without sampling_params: the model's generation_config.json
        fields (with overrides) over SamplingParams' own defaults, as vLLM's LLM does."""
        return self.generation_defaults.sampling_params()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either (also vLLM's {"prompt": ...} and
        {"prompt_token_ids": [...]} dicts). Returns one RequestOutput per prompt, in input order."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params if sampling_params is not None else self.get_default_sampling_params(),
                                 len(prompts))
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._request_ids))
                text, token_ids = prompt
                self.engine.add_request(rid, text if text is not None else token_ids, p,
                                        prompt_token_ids=token_ids if text is not None else None)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """messages: one conversation ([{"role": ..., "content": ...}, ...]) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate(self._chat_prompts(conversations, add_generation_prompt), sampling_params, use_tqdm)

    def _chat_prompts(self, conversations: list[list[dict]], add_generation_prompt: bool) -> list[dict]:
        tok = self.get_tokenizer()
        if getattr(tok, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; use generate() with plain text")
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
            # The template already holds any BOS; tokenizing it again must not add another.
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return prompts

    def stream(self, prompt: str, sampling_params: SamplingParams | None = None,
               chat: bool | None = None) -> Iterator[RequestOutput]:
        """One prompt's output after each step that adds to it (text so far in .outputs[0].text), until it
        finishes. chat: send the prompt as a user turn through the tokenizer's chat template (None: when the
        tokenizer has one). Closing the iterator early (break, Ctrl-C) aborts the request."""
        tok = self.get_tokenizer()
        if chat is None:
            chat = getattr(tok, "chat_template", None) is not None
        rid = str(next(self._request_ids))
        sampling_params = sampling_params or self.get_default_sampling_params()
        if chat:
            [request] = self._chat_prompts([[{"role": "user", "content": prompt}]], add_generation_prompt=True)
            self.engine.add_request(rid, request["prompt"], sampling_params,
                                    prompt_token_ids=request["prompt_token_ids"])
        else:
            self.engine.add_request(rid, prompt, sampling_params)
        finished = False
        try:
            while not finished and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort_request(rid)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids)) if use_tqdm else None
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        done[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
                if pending and not engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine dropped requests {sorted(pending)} without finishing them")
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _as_prompt_list(prompts) -> list[tuple[str | None, list[int] | None]]:
    """Normalize to (text or None, token ids or None) pairs."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a string, a list of token ids, or a list of those")
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append((p, None))
        elif isinstance(p, dict) and ("prompt" in p or "prompt_token_ids" in p):
            ids = p.get("prompt_token_ids")
            out.append((p.get("prompt"), list(ids) if ids is not None else None))
        elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
            out.append((None, list(p)))
        else:
            raise ValueError(f"cannot use {p!r} as a prompt: give a string, a list of token ids, "
                             "or a dict with 'prompt' or 'prompt_token_ids'")
    return out


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} (one per prompt), "
                         f"got {len(params)} items")
    return params


def _progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="generating")
