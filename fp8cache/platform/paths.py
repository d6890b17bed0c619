"""Where fp8kv keeps what it makes, so that the op library, the default model and the docs agree.

The environment names are listed in envs.py. The cache root is $FP8KV_CACHE_DIR, else $XDG_CACHE_HOME/fp8kv, else ~/.cache/fp8kv; built op libraries live in
its ops/ folder, converted models in models/, machine measurements beside the op library that made them.
"""

from __future__ import annotations

import os

from fp8cache.platform import envs

# Data that ships inside the package (fp8cache/data): the evaluation text, the dummy models' shapes.
PACKAGE_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def cache_root() -> str:
    """fp8kv's cache folder, absolute."""
    if envs.cache_dir():
        return os.path.abspath(os.path.expanduser(envs.cache_dir()))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "fp8kv"))


def ops_dir() -> str:
    """Built op libraries, one folder per source hash, ISA and compiler."""
    return os.path.join(cache_root(), "ops")


def models_dir() -> str:
    """Models fp8kv converted itself (the default model)."""
    return os.path.join(cache_root(), "models")
