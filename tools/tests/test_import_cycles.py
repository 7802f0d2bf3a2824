"""No new import circles between the modules of the project (issue 35, item 4).

An AST scan of every ``packages/*/src`` module collects the project modules it
imports, at the top level, under ``TYPE_CHECKING`` and inside functions alike (a
deferred import still ties the two modules together). The strongly connected
components of that graph with more than one module are the circles. Those that
existed when this check was written are listed in :data:`KNOWN`, to be broken
one by one; a circle that is not one of them, or that grew, fails the test.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Circles present when the check was written (each to be broken, then removed here).
KNOWN: list[set[str]] = []


def modules(roots: list[Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``*.py`` below each source root."""
    out: dict[str, Path] = {}
    for src in roots:
        for path in sorted(src.rglob("*.py")):
            parts = path.relative_to(src).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    found.add(sub)  # `from pkg import module`
                elif base in known:
                    found.add(base)
    found.discard(name)
    return found


def circles(roots: list[Path]) -> list[set[str]]:
    """The import circles (strongly connected components of two or more modules)."""
    known = modules(roots)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def new_circles(roots: list[Path], allowed: list[set[str]]) -> list[set[str]]:
    """Circles that are not (subsets of) an allowed one."""
    return [c for c in circles(roots) if not any(c <= a for a in allowed)]


def test_no_import_circle_beyond_the_known_ones() -> None:
    roots = sorted(ROOT.glob("packages/*/src"))
    assert len(roots) >= 9
    new = new_circles(roots, KNOWN)
    assert not new, f"new import circles (break them, e.g. move the shared code down): {new}"


def test_the_known_list_is_tight() -> None:
    """Each known circle still exists: a broken one is removed from the list."""
    found = circles(sorted(ROOT.glob("packages/*/src")))
    for known in KNOWN:
        assert any(known <= c for c in found), f"{sorted(known)} is broken: remove it from KNOWN"


def test_a_deferred_import_closes_a_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "src" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from demo import b\n")
    (pkg / "b.py").write_text(
        textwrap.dedent(
            """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from demo.c import C
            def later():
                from demo import a
            """
        )
    )
    (pkg / "c.py").write_text("from .b import later\n")
    roots = [tmp_path / "src"]
    # a -> b -> a (a deferred import) and b -> c -> b (typing, relative): one circle
    assert [sorted(c) for c in circles(roots)] == [["demo.a", "demo.b", "demo.c"]]
    assert new_circles(roots, [{"demo.a", "demo.b", "demo.c"}]) == []
    assert new_circles(roots, [{"demo.a", "demo.b"}]) != []
