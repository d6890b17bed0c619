"""The warm-up before an engine is declared ready: one prefill and one decode step through the whole path
(scheduler, model, paged attention, sampler, detokenizer), and on a GPU the decode steps' CUDA graphs for every
padded batch size.

A model that cannot run (a checkpoint its code cannot take, an op the device refuses) then fails while the
server is still starting, with one line, instead of reporting healthy and dying on the first request; the
first request also no longer pays for lazy initialisation and graph capture. What the warm-up leaves behind
is undone: its counters, and KV scales it would otherwise have calculated from its own two tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from fp8cache.engine.sampling_params import SamplingParams

WARM_UP_TEXT = "Hello"
MAX_STEPS = 16  # a prefill and a decode take 2 steps (3 with the overlapped loop); more means a stuck engine


class EngineStartError(ValueError):
    """The engine loaded but cannot run its model; the message is one line with the cause."""


def warm_up(engine, log: Callable[[str], None] | None = None) -> None:
    """Run one short greedy request through `engine` (an LLMEngine with no requests yet), capture the decode
    graphs, and reset what the request counted. Raises EngineStartError when the model cannot run."""
    runner = engine.runner
    pending = getattr(runner, "kv_spec", None) is not None and runner.kv_spec.scales_pending
    if pending and runner.tp.is_parallel:
        # Every rank would compute its scales from the warm-up's two tokens; only this one could forget them.
        if log is not None:
            log("warm-up skipped: KV scales are calculated from the first batch on every rank")
        return
    ids = _prompt_ids(engine)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    counters = _counters(engine)
    try:
        with runner.scales_kept_pending():
            engine.add_request("fp8kv-warm-up", ids, params)
            for _ in range(MAX_STEPS):
                engine.step()
                if not engine.has_unfinished_requests():
                    break
            else:
                raise RuntimeError(f"a 2-token request did not finish in {MAX_STEPS} engine steps")
            captured = runner.capture_decode_graphs()
    except EngineStartError:
        raise
    except Exception as exc:  # whatever the model raises is the reason it cannot serve
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise EngineStartError(f"the model failed its warm-up (one prefill and one decode step) and cannot serve: "
                               f"{type(exc).__name__}: {first}") from exc
    _restore(engine, counters)
    if log is not None:
        graphs = f", {captured} decode CUDA graphs captured" if captured else ""
        log(f"warm-up: a prefill and a decode step ran{graphs}")


def _prompt_ids(engine) -> list[int]:
    vocab = getattr(getattr(engine.runner, "hf_config", None), "vocab_size", None)
    try:
        ids = list(engine.tokenizer.encode(WARM_UP_TEXT))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode this still lets the model be tried
        ids = []
    ids = [t for t in ids if isinstance(t, int) and 0 <= t < (vocab or t + 1)][:8]
    return ids or [0]


_COUNTERS = {"engine": ("num_generated_tokens", "num_steps"),
             "scheduler": ("num_preemptions", "num_prefill_tokens_computed", "num_cached_prompt_tokens"),
             "block_manager": ("prefix_cache_queries", "prefix_cache_hits")}


def _owner(engine, name: str):
    return engine if name == "engine" else getattr(engine, name)


def _counters(engine) -> dict[tuple[str, str], int]:
    return {(owner, field): getattr(_owner(engine, owner), field)
            for owner, fields in _COUNTERS.items() for field in fields}


def _restore(engine, counters: dict[tuple[str, str], int]) -> None:
    for (owner, field), value in counters.items():
        setattr(_owner(engine, owner), field, value)
