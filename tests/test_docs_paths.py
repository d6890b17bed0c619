"""Every file and folder the README and docs/design.md name exists: the maps a new engineer reads first must
match the code. A name is looked up from the repository root, then inside fp8cache/, csrc/, launcher/ and
scripts/ (the docs write `model/runner.py` for fp8cache/model/runner.py); a bare file name must exist somewhere."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/design.md", "docs/usage.md", "docs/development.md", "docs/benchmarks.md")
BASES = ("", "fp8cache", "csrc", "launcher", "scripts", "fp8cache/server")
SOURCE = r"[A-Za-z0-9_][\w./-]*\.(?:py|sh|cpp|cu|cuh|h)"
# Folder names the docs use for this repository's folders (first part of a name like `model/cpu/`).
FOLDERS = {"fp8cache", "launcher", "csrc", "scripts", "tests", "docs", "model", "kvcache", "engine", "ops", "server",
           "bench", "distributed", "platform", "quality", "systemd", "common", "cpu", "cuda", "protocol"}


# Named in the docs, not files of this repository: another project, and system headers.
NOT_OURS = {"llama.cpp", "cuda_fp8.h", "cusparse.h", "hip_fp8.h"}
THEIR_FOLDERS = {"ATen", "c10", "torch", "cub", "thrust", "hip"}  # headers of torch, CUDA and ROCm


def repo_files() -> list[str]:
    """Tracked files and new ones not ignored (the docs may name a file before its first commit)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=False).stdout.split()
    return out or [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]


def named_paths(text: str) -> tuple[set[str], set[str]]:
    """(source files named anywhere in the text, folders of ours named in backticks like `model/cpu/`)."""
    files = {m.group(0) for m in re.finditer(r"(?<![\w/$.~<-])" + SOURCE + r"(?![\w/])", text)}
    files = {f for f in files if f not in NOT_OURS and f.split("/")[0] not in THEIR_FOLDERS}
    folders = {m.group(1).rstrip("/") for m in re.finditer(r"`([A-Za-z_][\w/.-]*/)`", text)}
    return files, {f for f in folders if f.split("/")[0] in FOLDERS}


def missing(text: str, files: list[str]) -> list[str]:
    folders = {str(p) for f in files for p in Path(f).parents}
    files_named, folders_named = named_paths(text)
    gone = []
    for name in sorted(files_named):
        if "/" not in name:
            if not any(f == name or f.endswith("/" + name) for f in files):
                gone.append(name)
        elif not any(str(Path(base) / name) in files for base in BASES):
            gone.append(name)
    for name in sorted(folders_named):
        if not any(str(Path(base) / name) in folders for base in BASES):
            gone.append(name + "/")
    return gone


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_the_docs_name_exists(doc):
    files = repo_files()
    gone = missing((ROOT / doc).read_text(), files)
    assert not gone, f"{doc} names paths that do not exist: {', '.join(gone)}"


def test_the_check_sees_a_moved_file():
    files = ["fp8cache/model/runner.py", "fp8cache/model/cpu/packed_linear.py", "tests/test_x.py"]
    text = ("runs in `model/runner.py` and backends/cpu/fused_layer.py; see `model/cpu/`, `tests/test_x.py`, "
            "gone.py, `model/cuda/`")
    assert missing(text, files) == ["backends/cpu/fused_layer.py", "gone.py", "model/cuda/"]


# ---- names: every `module.name` / `Class.attribute` docs/design.md and the package docstrings cite exists ----

CITED = re.compile(r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?=[\s(`),;:\[]|$)")
FILE_ENDINGS = {"py", "sh", "h", "cpp", "cu", "cuh", "md", "json", "gguf", "async"}
# Dotted names that are not ours: torch's, checkpoint tensor names, a placeholder.
NOT_CODE_HEADS = {"torch", "attn", "k_proj", "q_proj", "v_proj", "protocol"}
PACKAGES = ("fp8cache", "launcher")


def cited_names(text: str, code_only: bool) -> set[str]:
    """Dotted names in `backticks` and ```python blocks (the whole text for a docstring), less a code block's
    own variables (`llm = LLM(...)` makes `llm.generate` an example, not a module name)."""
    spans = [text] if not code_only else re.findall(r"`([^`\n]+)`", text) + re.findall(r"```python\n(.*?)```",
                                                                                           text, re.DOTALL)
    names = set()
    for span in spans:
        local = set(re.findall(r"^\s*(\w+)\s*=", span, re.MULTILINE))
        names |= {m.group(1) for m in CITED.finditer(span)
                  if m.group(1).split(".")[0] not in NOT_CODE_HEADS | local
                  and m.group(1).rsplit(".", 1)[1] not in FILE_ENDINGS}
    return names


def _modules() -> dict[str, list[str]]:
    """Short name (last part) -> dotted module names in fp8cache/ and launcher/."""
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found.setdefault(dotted.rsplit(".", 1)[-1], []).append(dotted)
    return found


def _classes(name: str) -> list[str]:
    """Dotted modules that define `class name`."""
    pattern = re.compile(rf"^class {re.escape(name)}\b", re.MULTILINE)
    return [".".join(p.relative_to(ROOT).with_suffix("").parts) for package in PACKAGES
            for p in (ROOT / package).rglob("*.py") if pattern.search(p.read_text())]


def _has(obj, attrs: list[str]) -> bool:
    for attr in attrs:
        if dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
            return True  # a field without a class default is no class attribute
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def resolves(name: str, modules: dict[str, list[str]]) -> bool:
    """Whether `name` is a module of ours, or an attribute of one reached from a module or class name."""
    head, *rest = name.split(".")
    if head in PACKAGES:
        for cut in range(len(rest) + 1, 0, -1):
            try:
                module = importlib.import_module(".".join([head, *rest[:cut - 1]]))
            except ImportError:
                continue
            return _has(module, rest[cut - 1:])
        return False
    for dotted in modules.get(head, []):
        if _has(importlib.import_module(dotted), rest):
            return True
    return any(_has(cls, rest) or _sets_on_self(cls, rest)
               for cls in (getattr(importlib.import_module(m), head) for m in _classes(head)))


def _sets_on_self(cls: type, rest: list[str]) -> bool:
    """An instance attribute: `self.name = ...` (or `self.name: T = ...`) in the class's code."""
    return len(rest) == 1 and re.search(rf"self\.{re.escape(rest[0])}\s*[:=]", inspect.getsource(cls)) is not None


def design_and_docstring_names() -> dict[str, set[str]]:
    cited = {"docs/design.md": cited_names((ROOT / "docs/design.md").read_text(), code_only=True)}
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            cited[str(init.relative_to(ROOT))] = cited_names(doc, code_only=False)
    return cited


def test_every_name_design_md_and_the_package_docstrings_cite_exists():
    modules = _modules()
    cited = design_and_docstring_names()
    assert len(cited["docs/design.md"]) > 20  # the scan reads the names
    gone = {where: sorted(n for n in names if not resolves(n, modules)) for where, names in cited.items()}
    gone = {where: names for where, names in gone.items() if names}
    assert not gone, f"names cited that the code does not have: {gone}"


def test_the_name_check_sees_a_moved_name():
    modules = _modules()
    text = ("`ops.allocate_kv_cache(...)`, `layout.allocate_kv_cache`, `ModelRunner.execute`, `Runner.go`, `x.py`"
            ", `LLMEngine.trace`, `LLMEngine.tracer`")
    names = cited_names(text, code_only=True)
    assert names == {"ops.allocate_kv_cache", "layout.allocate_kv_cache", "ModelRunner.execute", "Runner.go",
                     "LLMEngine.trace", "LLMEngine.tracer"}
    assert sorted(n for n in names if not resolves(n, modules)) == ["LLMEngine.tracer", "Runner.go",
                                                                    "ops.allocate_kv_cache"]
