"""What a fresh install gets: every module the tests import comes with `pip install -e ".[test]"`."""

from __future__ import annotations

import ast
import configparser
import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def declared_requirements(extras: tuple[str, ...] = ("test",)) -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in extras:
        lines += cfg["options.extras_require"][extra].splitlines()
    return [Requirement(line) for line in lines if line.strip()]


def installed_closure(requirements: list[Requirement]) -> set[str]:
    """Canonical names of the distributions those requirements pull in, their dependencies included."""
    seen: set[str] = set()
    todo = [(r, ("",)) for r in requirements]
    while todo:
        req, extras = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(req.name) or []
        except md.PackageNotFoundError:
            continue  # not installed here: the import check below names whatever it would have provided
        todo += [(Requirement(r), ("", *req.extras)) for r in requires]
    return seen


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside a try whose handler catches ImportError: an optional import the test copes without."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                names = [handler.type] if not isinstance(handler.type, ast.Tuple) else handler.type.elts
                if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names):
                    return True
    return False


def required_test_imports() -> dict[str, str]:
    """Top-level module -> a test file that imports it unguarded (stdlib and our own modules left out)."""
    local = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"fp8cache", "launcher"}
    found: dict[str, str] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            if _guarded(node, parents):
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in local and top not in sys.stdlib_module_names:
                    found.setdefault(top, path.name)
    return found


def test_every_module_the_tests_import_is_declared_for_the_test_extra():
    closure = installed_closure(declared_requirements())
    providers = md.packages_distributions()
    missing = {module: where for module, where in required_test_imports().items()
               if not any(canonicalize_name(d) in closure for d in providers.get(module, []))}
    assert not missing, ("imported by the tests but not installed by `pip install -e \".[test]\"`: "
                         + ", ".join(f"{m} ({w})" for m, w in sorted(missing.items()))
                         + "; add it to the test extra in setup.cfg or drop the import")


def test_the_check_sees_an_undeclared_import():
    # The check above must be able to fail: a module no declared requirement provides is reported.
    closure = installed_closure(declared_requirements())
    providers = md.packages_distributions()
    assert "pytest" in closure and any(canonicalize_name(d) in closure for d in providers["torch"])
    assert not any(canonicalize_name(d) in closure for d in providers.get("matplotlib", ["matplotlib"]))


def test_the_version_is_one_number():
    """setup.cfg's version (what pip installs) is fp8cache.__version__ (what /info and --version report)."""
    import configparser
    from pathlib import Path

    import fp8cache

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    assert cfg["metadata"]["version"] == fp8cache.__version__
