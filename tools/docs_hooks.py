"""MkDocs hooks of the docs site, and the public-API docstring check.

Loaded by ``mkdocs.yml`` (``hooks:``). Everything here reads the sources with
griffe (static analysis): nothing imports torch, so the docs build needs no
torch and no package installed.

- ``on_pre_build``: every name in each package's ``__all__`` resolves and has a
  docstring (classes, functions and constants alike); the build fails otherwise,
  listing every undocumented name. ``python tools/docs_hooks.py`` runs the same
  check alone.
- ``on_page_markdown``: ``<!-- api-reexports: PACKAGE -->`` becomes a table of
  the re-exported names of ``PACKAGE``, each linked to its documentation in the
  package that defines it (used for the ``nvalchemi.distributed`` page).
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Documented packages, in layer order (the API reference has one page each).
PACKAGES = (
    "nvdd.core",
    "nvdd.shardtensor",
    "nvdd.halo",
    "nvdd.padding",
    "nvdd.partition",
    "nvdd.spec",
    "nvdd.models",
    "nvdd.dynamics",
    "nvdd.testing",
    "nvalchemi.distributed",
)
# Names that need no docstring of their own.
EXEMPT = frozenset({"__version__"})
MARKER = "<!-- api-reexports: "


def _search_paths() -> list[str]:
    return sorted(str(p) for p in (ROOT / "packages").glob("*/src"))


@cache
def _loader() -> Any:
    import griffe

    sys.path.insert(0, str(Path(__file__).parent))
    from griffe_comments import CommentDocstrings

    loader = griffe.GriffeLoader(
        search_paths=_search_paths(),
        docstring_parser=griffe.Parser.numpy,
        extensions=griffe.load_extensions(CommentDocstrings),
    )
    for name in PACKAGES:
        loader.load(name)
    loader.resolve_aliases(implicit=False, external=False)
    return loader


def public_names(package: str) -> list[str]:
    """The names of ``package.__all__``, in their order (static read)."""
    module = _loader().modules_collection[package]
    return [str(n) for n in (module.exports or [])]


def _target(package: str, name: str) -> Any:
    obj = _loader().modules_collection[package][name]
    return obj.final_target if obj.is_alias else obj


def undocumented() -> dict[str, list[str]]:
    """Per package, the public names without a docstring (or that do not resolve)."""
    missing: dict[str, list[str]] = {}
    for package in PACKAGES:
        names = public_names(package)
        if not names:
            missing.setdefault(package, []).append("(no __all__)")
        for name in names:
            if name in EXEMPT:
                continue
            try:
                doc = _target(package, name).docstring
            except Exception as exc:  # an unresolvable alias is a broken export
                missing.setdefault(package, []).append(f"{name} ({type(exc).__name__})")
                continue
            if doc is None or not doc.value.strip():
                missing.setdefault(package, []).append(name)
    return missing


def _defining_package(name: str, exclude: str) -> str | None:
    for package in PACKAGES:
        if package != exclude and name in public_names(package):
            return package
    return None


def reexport_table(package: str) -> str:
    """A markdown table of ``package``'s names, linked to where they are documented."""
    rows = ["| name | documented in | summary |", "|---|---|---|"]
    for name in sorted(public_names(package), key=str.lower):
        if name in EXEMPT:
            continue
        home = _defining_package(name, package)
        if home is None:
            rows.append(f"| `{name}` | `{package}` | |")
            continue
        doc = _target(home, name).docstring
        summary = doc.value.strip().splitlines()[0] if doc else ""
        rows.append(f"| [`{name}`][{home}.{name}] | `{home}` | {summary.replace('|', '/')} |")
    return "\n".join(rows)


def on_pre_build(config: Any) -> None:
    """Fail the build when a public name has no docstring."""
    from mkdocs.exceptions import PluginError

    missing = undocumented()
    if missing:
        lines = [f"  {pkg}: {', '.join(names)}" for pkg, names in missing.items()]
        raise PluginError("public names without a docstring:\n" + "\n".join(lines))


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Expand ``<!-- api-reexports: PACKAGE -->`` markers."""
    while MARKER in markdown:
        start = markdown.index(MARKER)
        end = markdown.index("-->", start)
        package = markdown[start + len(MARKER) : end].strip()
        markdown = markdown[:start] + reexport_table(package) + markdown[end + 3 :]
    return markdown


def main() -> int:
    missing = undocumented()
    for pkg, names in missing.items():
        print(f"{pkg}: {len(names)} undocumented: {', '.join(names)}")
    total = sum(len(public_names(p)) for p in PACKAGES)
    print(
        f"{total} public names in {len(PACKAGES)} packages; {sum(map(len, missing.values()))} undocumented"
    )
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
