"""The model shapes fp8kv ships for random-weight benchmarks (`--load-format dummy`, model/dummy.py) and the load
formats, without torch: the command line lists them in its help.

Named shapes: fp8cache/data/shapes/<name>/config.json (package data; the table is in its README.md).
"""

from __future__ import annotations

from pathlib import Path

from fp8cache.platform import paths

LOAD_FORMATS = ("auto", "dummy")
SHAPES_DIR = Path(paths.PACKAGE_DATA) / "shapes"
DEFAULT_SHAPE = "smollm2-135m"  # the default model's shape: LLM(load_format="dummy") without a model


def check_load_format(name: str) -> str:
    if name not in LOAD_FORMATS:
        raise ValueError(f"load_format={name!r} is not known; valid: auto (the model folder's safetensors "
                         "weights), dummy (random weights from config.json alone, for benchmarks)")
    return name


def shape_names() -> list[str]:
    """The model shapes shipped with fp8kv (folder names under fp8cache/data/shapes)."""
    return sorted(p.parent.name for p in SHAPES_DIR.glob("*/config.json"))


def shape_path(name: str) -> str | None:
    """The folder of a shipped shape by its name (any case), None when `name` is not one."""
    wanted = name.strip().lower()
    return next((str(SHAPES_DIR / n) for n in shape_names() if n == wanted), None)
