"""No import circle among any package's modules, nor among the parts of a package (its
subpackages and top-level modules), type-only (``if TYPE_CHECKING:``), local and relative
imports included; and the core's parts stack in the floors docs/design.md draws ('The
packages'): a part imports only parts on lower floors. Each part of the engine can be read,
tested and replaced from the bottom up, and a new device or process group comes in through
the Protocols the lower floors take, not through an import upwards."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "packages"
PACKAGES = sorted(p.parent for p in ROOT.glob("*/*/__init__.py"))


def _modules(pkg: Path) -> dict[str, Path]:
    out = {}
    for f in pkg.rglob("*.py"):
        name = ".".join(f.relative_to(pkg.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module an ``ImportFrom`` names, a relative one resolved against ``module``."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _graph(pkg: Path) -> dict[str, set[str]]:
    mods = _modules(pkg)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(node, m, f.name == "__init__.py")
                for a in node.names:
                    target = f"{source}.{a.name}"
                    graph[m].add(target if target in mods else source)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names)
        graph[m] = {t for t in graph[m] if t in mods and t != m}
    return graph


def _part(pkg: Path, module: str) -> str:
    """The part of ``pkg`` a module belongs to: its subpackage, or the top-level module
    itself (``__init__`` for the package's own ``__init__.py``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _part_graph(pkg: Path) -> dict[str, set[str]]:
    """Which parts of ``pkg`` import which (the module graph, modules merged by part)."""
    graph: dict[str, set[str]] = {}
    for m, targets in _graph(pkg).items():
        here = _part(pkg, m)
        graph.setdefault(here, set()).update(_part(pkg, t) for t in targets if _part(pkg, t) != here)
    return graph


CORE_FLOORS = [
    {"errors", "events", "interrupts"},
    {"device"},
    {"memory", "disk", "placement"},
    {"chunk"},
    {"config"},
    {"distributed"},
    {"optim"},
    {"activations", "checkpoint", "hooks", "construction"},
    {"runtime", "cli"},
    {"dryrun"},
    {"__init__"},
    {"integrations"},
]
"""The core's parts from the ground up (docs/design.md, 'The packages'): each imports only
parts on floors below its own."""


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_packages_are_found() -> None:
    assert {p.name for p in PACKAGES} >= {"chunkstar", "chunkstar_bench", "chunkstar_profiler", "chunkstar_dashboard"}


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_no_import_circle(pkg: Path) -> None:
    assert _cycles(_graph(pkg)) == []


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_no_circle_among_parts(pkg: Path) -> None:
    assert _cycles(_part_graph(pkg)) == []


def test_the_core_stacks_in_floors() -> None:
    core = ROOT / "core" / "chunkstar"
    graph = _part_graph(core)
    floor = {part: i for i, parts in enumerate(CORE_FLOORS) for part in parts}
    assert set(graph) == set(floor), "a part of the core is missing from CORE_FLOORS (or gone): place it on a floor"
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if floor[b] >= floor[a])
    assert upward == []


def test_relative_imports_are_followed(tmp_path: Path) -> None:
    pkg = tmp_path / "p"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from .x import f\n")
    (pkg / "a" / "x.py").write_text("from ..b import y\n")
    (pkg / "b" / "__init__.py").write_text("")
    (pkg / "b" / "y.py").write_text("from ..a.x import f\n")
    assert _graph(pkg)["p.a.x"] == {"p.b.y"}
    assert _cycles(_part_graph(pkg)) == [["a", "b"]]


def test_a_circle_is_found() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
