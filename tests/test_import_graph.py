"""No import circle among any package's modules, type-only imports (``if TYPE_CHECKING:``)
included: each part of the engine can be read, tested and replaced from the bottom up
(docs/design.md, 'The packages')."""

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


def _graph(pkg: Path) -> dict[str, set[str]]:
    mods = _modules(pkg)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    target = f"{node.module}.{a.name}"
                    graph[m].add(target if target in mods else node.module)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names)
        graph[m] = {t for t in graph[m] if t in mods and t != m}
    return graph


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


def test_a_circle_is_found() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
