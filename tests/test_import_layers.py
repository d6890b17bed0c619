"""Imports run one way: down the floors below, never up, and no file reaches itself through others. Every import
counts, those made inside functions too (they run as surely, only later); only `if TYPE_CHECKING:` blocks do
not, since they never run. Read from the source with ast, nothing imported."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fp8cache", "launcher")

# The floors, ground first. A room may import its own files and any room on a lower floor; rooms on one floor
# do not import each other. A room is a folder of fp8cache (fp8cache/model, with model/cpu and model/cuda in
# it), a top-level module of fp8cache, fp8cache's own face (__init__.py), or the launcher.
FLOORS = [
    {"fp8cache.platform", "fp8cache.config", "fp8cache.jsonkind", "fp8cache.version"},  # the machine, paths,
    # logs; the API's config; JSON words for errors; the version
    {"fp8cache.kvcache"},  # what the cache bytes mean: formats, scales, layout, sizing
    {"fp8cache.ops"},  # the compiled ops: build, load, fake and reference twins
    {"fp8cache.distributed"},  # process groups, collectives, the step channel
    {"fp8cache.model"},  # the runner, attention, the decode paths (model/cpu, model/cuda), loading
    {"fp8cache.engine"},  # scheduling, blocks, sampling, LLM()
    {"fp8cache.quality", "fp8cache.systemd"},  # calibrate and eval; sd_notify and the listening socket
    {"fp8cache.server", "fp8cache.bench"},  # HTTP; benchmarks
    {"fp8cache"},  # the package's face: LLM, SamplingParams
    {"launcher"},  # the command line
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    return _source_files(ROOT)


@functools.cache
def _source_files(root: Path) -> dict[str, Path]:
    """Read once per tree: room_of asks for every import of every file."""
    return {module_name(p, root): p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))}


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "launcher":
        return "launcher"
    if len(parts) == 1:
        return "fp8cache"
    known = source_files()
    return ".".join(parts[:2]) if f"{parts[0]}.{parts[1]}" in known else module


def floor_of(room: str) -> int:
    for i, rooms in enumerate(FLOORS):
        if room in rooms:
            return i
    raise AssertionError(f"{room} is on no floor of test_import_layers.FLOORS: give it one")


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `module` imports (a name imported from a package that is a module of its own counts
    as that module)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                if child in known:
                    found.add(child)
                elif base in known:
                    found.add(base)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    known = source_files()
    return {module: imports_of(module, path, known) for module, path in known.items()}


def test_every_room_is_on_a_floor():
    for module in source_files():
        floor_of(room_of(module))


def test_no_import_runs_up_or_sideways():
    upward = []
    for module, targets in import_graph().items():
        room = room_of(module)
        for target in targets:
            other = room_of(target)
            if other != room and floor_of(other) >= floor_of(room):
                upward.append(f"{module} (floor {floor_of(room)}) imports {target} (floor {floor_of(other)})")
    assert not upward, "imports that run up or sideways:\n" + "\n".join(sorted(upward))


def test_no_circle_between_files():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    circles: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "circles of imports:\n" + "\n".join(circles)


def test_the_checker_sees_an_upward_import_and_a_circle(tmp_path, monkeypatch):
    """The checks above can fail: a kvcache file importing the engine is caught, and so is a two-file circle."""
    (tmp_path / "fp8cache" / "kvcache").mkdir(parents=True)
    (tmp_path / "fp8cache" / "engine").mkdir(parents=True)
    (tmp_path / "launcher").mkdir()
    for folder in ("fp8cache", "fp8cache/kvcache", "fp8cache/engine", "launcher"):
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "fp8cache" / "kvcache" / "a.py").write_text("def f():\n    from fp8cache.engine import b\n")
    (tmp_path / "fp8cache" / "engine" / "b.py").write_text("from fp8cache.kvcache import a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    graph = import_graph()
    assert graph["fp8cache.kvcache.a"] == {"fp8cache.engine.b"}
    assert graph["fp8cache.engine.b"] == {"fp8cache.kvcache.a"}
    try:
        test_no_import_runs_up_or_sideways()
    except AssertionError as e:
        assert "fp8cache.kvcache.a (floor 1) imports fp8cache.engine.b (floor 5)" in str(e)
    else:
        raise AssertionError("the upward import was not seen")
    try:
        test_no_circle_between_files()
    except AssertionError as e:
        assert "fp8cache.engine.b -> fp8cache.kvcache.a -> fp8cache.engine.b" in str(e)
    else:
        raise AssertionError("the circle was not seen")
