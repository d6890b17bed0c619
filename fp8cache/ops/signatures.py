"""The signatures of the torch.ops.fp8kv ops, each declared once: the schema string that registers it
(`m.def(...)` in csrc/torch_bindings.cpp, or in the fragment beside a backend's kernels), read here.

The other faces of an op are held to that declaration by tests/ops/test_op_signatures.py: the C++ parameter
lists the backends implement (csrc/op_signatures.h), the Python wrappers (fp8cache.ops), the fake kernels
(fp8cache.ops.fake), the pure-torch reference (fp8cache.ops.reference) and the schema a built library registers.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch

# The Python wrappers and the reference take the user's kv-cache-dtype string (or a resolved code) where the
# ops take the format code.
PYTHON_NAMES = {"kv_cache_format": "kv_cache_dtype"}

# m.def( followed by one or more adjacent string literals (C++ joins them), the schema's text.
_DEF = re.compile(r'\bm\.def\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)')
_LITERAL = re.compile(r'"((?:[^"\\]|\\.)*)"')
_SOURCES = (".cpp", ".cu")


def declared_schemas(csrc: Path | None = None) -> dict[str, torch.FunctionSchema]:
    """Every op's schema as the C++ sources under csrc (default: the ones the library builds from) declare it,
    by op name. An op declared twice: ValueError."""
    if csrc is None:
        from fp8cache.ops import _build

        csrc = _build.source_dir()
    schemas: dict[str, torch.FunctionSchema] = {}
    for path in sorted(p for p in csrc.rglob("*") if p.suffix in _SOURCES):
        for match in _DEF.finditer(path.read_text(encoding="utf-8")):
            text = "".join(_LITERAL.findall(match.group(1)))
            schema = torch._C.parse_schema(f"fp8kv::{text}")
            name = schema.name.removeprefix("fp8kv::")
            if name in schemas:
                raise ValueError(f"op {name!r} is declared twice (again in {path})")
            schemas[name] = schema
    return schemas


def parameters(schema: torch.FunctionSchema, python: bool = False) -> list[tuple[str, object]]:
    """(name, default) of the schema's arguments in order, the default inspect.Parameter.empty where it has none.
    python: the names the Python wrappers and the reference use (PYTHON_NAMES)."""
    return [(PYTHON_NAMES.get(a.name, a.name) if python else a.name,
             a.default_value if a.has_default_value() else inspect.Parameter.empty)
            for a in schema.arguments]
