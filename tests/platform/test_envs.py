"""fp8cache/platform/envs.py lists every FP8KV_* variable the code reads, the Python code reads them only through
it, and docs/usage.md names each one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from fp8cache.platform import envs, paths

ROOT = Path(__file__).resolve().parents[2]
ENV_NAME = re.compile(r"^FP8KV_[A-Z0-9_]+$")
# How C++ and the scripts read a variable: getenv("NAME"), ${NAME...}, $NAME, os.environ.get("NAME").
READ_ELSEWHERE = re.compile(r'getenv\("(FP8KV_\w+)"\)|\$\{?(FP8KV_[A-Z0-9_]+)|environ(?:\.get\(|\.pop\(|\[)"(FP8KV_\w+)"')


def python_env_names(source: str) -> set[str]:
    """String constants that are a whole FP8KV_* name: a read (or a second spelling) outside envs.py."""
    return {node.value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.match(node.value)}


def names_read(text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in READ_ELSEWHERE.finditer(text)}


def test_python_reads_fp8kv_variables_only_through_envs():
    spelled = {}
    for path in [*ROOT.glob("fp8cache/**/*.py"), *ROOT.glob("launcher/**/*.py")]:
        if path.name != "envs.py":
            for name in python_env_names(path.read_text()):
                spelled.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not spelled, f"FP8KV_* names spelled outside fp8cache/platform/envs.py (read them through it): {spelled}"


def test_the_cpp_and_the_scripts_read_only_listed_variables():
    sources = [*ROOT.glob("csrc/**/*.c*"), *ROOT.glob("csrc/**/*.h"), *ROOT.glob("scripts/**/*.sh"),
               *ROOT.glob("scripts/**/*.py")]
    read = {name: str(p.relative_to(ROOT)) for p in sources for name in names_read(p.read_text())}
    assert {"FP8KV_TC_SPLITS", "FP8KV_TC_STAGES", "FP8KV_CACHE_DIR"} <= read.keys()  # the scan sees reads
    unlisted = {name: where for name, where in read.items() if name not in envs.VARIABLES}
    assert not unlisted, f"read but not listed in fp8cache/platform/envs.py: {unlisted}"


def test_the_scans_see_a_read():
    assert python_env_names('import os\nx = os.environ.get("FP8KV_NEW")\n"""FP8KV_NEW in a docstring."""') == {
        "FP8KV_NEW"}
    assert names_read('std::getenv("FP8KV_A"); X="${FP8KV_B:-1}"; y=$FP8KV_C; os.environ.pop("FP8KV_D")\n'
                      "# FP8KV_E in a comment") == {"FP8KV_A", "FP8KV_B", "FP8KV_C", "FP8KV_D"}


def test_docs_list_every_variable_and_the_flag_rule():
    docs = (ROOT / "docs/usage.md").read_text()
    section = docs[docs.index("## Environment variables"):]
    missing = [name for name in envs.VARIABLES if f"`{name}" not in section]
    assert not missing, f"docs/usage.md's environment section does not name {missing}"
    assert "`FP8KV_<FLAG>`" in section and envs.flag_env("kv-cache-dtype") == "FP8KV_KV_CACHE_DTYPE"


def test_every_listed_variable_says_what_it_is():
    for var in envs.VARIABLES.values():
        assert ENV_NAME.match(var.name) and var.type in (str, int, bool) and var.meaning and var.read_by


def test_the_cache_dir_comes_from_its_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(tmp_path / "c"))
    assert paths.ops_dir() == str(tmp_path / "c" / "ops")
    monkeypatch.setenv("FP8KV_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_root() == str(tmp_path / "xdg" / "fp8kv")


def test_configure_logging_reads_0_as_off(monkeypatch):
    monkeypatch.setenv("FP8KV_CONFIGURE_LOGGING", "0")
    assert not envs.configure_logging()
    monkeypatch.delenv("FP8KV_CONFIGURE_LOGGING")
    assert envs.configure_logging()
