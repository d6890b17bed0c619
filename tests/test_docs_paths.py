"""Every file and folder the README and docs/design.md name exists: the maps a new engineer reads first must
match the code. A name is looked up from the repository root, then inside fp8cache/, csrc/, launcher/ and
scripts/ (the docs write `model/runner.py` for fp8cache/model/runner.py); a bare file name must exist somewhere."""

from __future__ import annotations

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
