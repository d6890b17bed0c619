"""fp8kv: serve language models with an FP8 KV cache."""

from __future__ import annotations

from fp8cache.version import __version__

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `from fp8cache import ops` does not pull in transformers.
    if name == "LLM":
        from fp8cache.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fp8cache.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from fp8cache.engine.structured_output import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(name)
