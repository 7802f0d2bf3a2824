"""Check the monorepo's dependency rules (run by ``nox -s deps``).

Reads every ``packages/*/pyproject.toml`` and the layer table of the root
``pyproject.toml`` (``[tool.nvdd] layers`` and ``test-only``), then checks:

1. every package has a layer (or is test-only), ``py.typed``, ``__about__.py``,
   ``CHANGELOG.md``, and no ``__init__.py`` in its namespace directory;
2. runtime sibling dependencies point to strictly lower layers and form a DAG;
   a test-only package is never a runtime dependency of another package;
3. each package's ``src/`` imports only itself and its declared siblings, and
   its ``tests/`` only those plus its test dependency group (an AST scan that
   sees ``TYPE_CHECKING`` blocks, function-local imports and literal
   ``importlib.import_module("...")`` calls).

Usage: ``python tools/nvdd_deps.py [ROOT]``; exit status 1 with one line per
violation.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Package", "check", "load_packages", "main"]

_NAMESPACES = ("nvdd", "nvalchemi")


@dataclass
class Package:
    """What the checker knows of one distribution."""

    name: str
    path: Path
    import_name: str | None
    runtime: set[str] = field(default_factory=set)
    optional: set[str] = field(default_factory=set)
    test: set[str] = field(default_factory=set)


def _req_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    return m.group(1).lower().replace("_", "-") if m else req


def _import_name(src: Path) -> str | None:
    found = sorted(src.glob("*/*/__about__.py")) + sorted(src.glob("*/__about__.py"))
    if not found:
        return None
    rel = found[0].parent.relative_to(src)
    return ".".join(rel.parts)


def load_packages(root: Path) -> dict[str, Package]:
    """Every package under ``root/packages``, keyed by distribution name."""
    out: dict[str, Package] = {}
    for pp in sorted((root / "packages").glob("*/pyproject.toml")):
        data = tomllib.loads(pp.read_text())
        name = _req_name(data["project"]["name"])
        pkg = Package(name=name, path=pp.parent, import_name=_import_name(pp.parent / "src"))
        pkg.runtime = {_req_name(r) for r in data["project"].get("dependencies", [])}
        for reqs in data["project"].get("optional-dependencies", {}).values():
            pkg.optional |= {_req_name(r) for r in reqs}
        for reqs in data.get("dependency-groups", {}).values():
            pkg.test |= {_req_name(r) for r in reqs if isinstance(r, str)}
        out[name] = pkg
    return out


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in _NAMESPACES:
                for alias in node.names:
                    yield node.lineno, f"{node.module}.{alias.name}"
            else:
                yield node.lineno, node.module
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def _owner(module: str, by_import: dict[str, str]) -> str | None:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        hit = by_import.get(".".join(parts[:i]))
        if hit is not None:
            return hit
    if parts[0] in _NAMESPACES and len(parts) >= 2:
        return f"<unknown {parts[0]}.{parts[1]}>"
    return None


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                found.append([*stack[stack.index(m) :], m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n)
    return found


def check(root: Path) -> list[str]:
    """All violations in the tree at ``root`` (empty when it is clean)."""
    errors: list[str] = []
    cfg = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {}).get("nvdd", {})
    layers: dict[str, int] = {_req_name(k): int(v) for k, v in cfg.get("layers", {}).items()}
    test_only = {_req_name(n) for n in cfg.get("test-only", [])}
    pkgs = load_packages(root)
    names = set(pkgs)
    by_import = {p.import_name: n for n, p in pkgs.items() if p.import_name}

    for name, p in pkgs.items():
        where = f"{name} ({p.path.relative_to(root)})"
        if name not in layers and name not in test_only:
            errors.append(f"{where}: not in [tool.nvdd] layers or test-only of the root pyproject")
        if p.import_name is None:
            errors.append(f"{where}: no src/<namespace>/<name>/__about__.py")
            continue
        leaf = p.path / "src" / Path(*p.import_name.split("."))
        for required in ("py.typed", "__about__.py", "__init__.py"):
            if not (leaf / required).is_file():
                errors.append(f"{where}: missing {leaf.relative_to(root) / required}")
        if not (p.path / "CHANGELOG.md").is_file():
            errors.append(f"{where}: missing CHANGELOG.md")
        ns_init = p.path / "src" / p.import_name.split(".")[0] / "__init__.py"
        if ns_init.exists():
            errors.append(
                f"{where}: {ns_init.relative_to(root)} breaks the PEP 420 namespace; delete it"
            )

        # Declared sibling edges and the layer order.
        for dep in sorted((p.runtime | p.optional) & names):
            if dep in test_only and name not in test_only:
                errors.append(f"{where}: test-only package {dep} is a runtime dependency")
            elif name in layers and dep in layers and layers[dep] >= layers[name]:
                errors.append(
                    f"{where}: depends on {dep} (layer {layers[dep]}) but is in layer "
                    f"{layers[name]}; siblings must come from a strictly lower layer"
                )
        for dep in sorted(p.test & names):
            if (
                dep not in test_only
                and dep in layers
                and name in layers
                and layers[dep] >= layers[name]
            ):
                errors.append(
                    f"{where}: test group uses {dep} (layer {layers[dep]}), not below layer "
                    f"{layers[name]}"
                )

        # What the code actually imports.
        allowed_src = {name} | ((p.runtime | p.optional) & names)
        allowed_tests = allowed_src | (p.test & names)
        for sub, allowed, label in (
            ("src", allowed_src, "dependencies"),
            ("tests", allowed_tests, "dependencies or test group"),
        ):
            for py in sorted((p.path / sub).rglob("*.py")):
                for line, module in _imports(py):
                    owner = _owner(module, by_import)
                    if owner is not None and owner not in allowed:
                        errors.append(
                            f"{py.relative_to(root)}:{line}: imports {module} from {owner}, "
                            f"which {name} does not declare in its {label}"
                        )

    edges = {n: (p.runtime | p.optional) & names for n, p in pkgs.items()}
    for cyc in _cycles(edges):
        errors.append("dependency cycle: " + " -> ".join(cyc))
    return errors


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path(__file__).resolve().parents[1]
    errors = check(root)
    if errors:
        print(f"nvdd deps: {len(errors)} violation(s) in {root}:")
        for e in errors:
            print(f"  {e}")
        return 1
    n = len(load_packages(root))
    print(f"nvdd deps: {n} packages, layer order and imports OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
