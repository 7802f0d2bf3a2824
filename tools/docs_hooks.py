"""MkDocs hooks of the docs site, and the public-API docstring check.

Loaded by ``mkdocs.yml`` (``hooks:``). Everything here reads the sources with
griffe (static analysis): nothing imports torch, so the docs build needs no
torch and no package installed.

- ``on_pre_build``: every name in each package's ``__all__`` resolves and has a
  docstring (classes, functions and constants alike), and so does every public
  method and property those classes define (:func:`undocumented_members`); the
  build fails otherwise, listing every undocumented name. ``python
  tools/docs_hooks.py`` runs the same check alone.
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


def _loader(
    packages: tuple[str, ...] = PACKAGES, search_paths: tuple[str, ...] | None = None
) -> Any:
    return _load(packages, search_paths)  # (one cache entry however it is called)


@cache
def _load(packages: tuple[str, ...], search_paths: tuple[str, ...] | None) -> Any:
    import griffe

    sys.path.insert(0, str(Path(__file__).parent))
    from griffe_comments import CommentDocstrings

    loader = griffe.GriffeLoader(
        search_paths=list(search_paths) if search_paths is not None else _search_paths(),
        docstring_parser=griffe.Parser.numpy,
        extensions=griffe.load_extensions(CommentDocstrings),
    )
    for name in packages:
        loader.load(name)
    loader.resolve_aliases(implicit=False, external=False)
    return loader


def public_names(package: str, loader: Any = None) -> list[str]:
    """The names of ``package.__all__``, in their order (static read)."""
    module = (loader or _loader()).modules_collection[package]
    return [str(n) for n in (module.exports or [])]


def _target(package: str, name: str, loader: Any = None) -> Any:
    obj = (loader or _loader()).modules_collection[package][name]
    return obj.final_target if obj.is_alias else obj


def _has_docstring(obj: Any) -> bool:
    return obj.docstring is not None and bool(obj.docstring.value.strip())


def undocumented_members(cls: Any) -> list[str]:
    """The public methods and properties ``cls`` (a griffe class) defines without a
    docstring of their own, sorted.

    Public: the name does not start with ``_``. Dunder methods are exempt (Python
    defines what they do; ``__init__``'s parameters belong in the class
    docstring). An override needs its own docstring: mkdocstrings renders a
    member from its own docstring only (griffe inherits none without an
    extension) and hides one without (``show_if_no_docstring: false``). Plain
    attributes (dataclass fields, class constants) are documented in the class
    docstring and are not checked here; inherited members are checked on the
    class that defines them, when that class is public.
    """
    missing = []
    for name, member in cls.members.items():
        if name.startswith("_"):
            continue
        try:
            obj = member.final_target if member.is_alias else member
        except Exception:  # an alias to something griffe cannot load: not ours
            continue
        if not (obj.is_function or (obj.is_attribute and "property" in obj.labels)):
            continue
        if not _has_docstring(obj):
            missing.append(name)
    return sorted(missing)


def undocumented(
    packages: tuple[str, ...] = PACKAGES, search_paths: tuple[str, ...] | None = None
) -> dict[str, list[str]]:
    """Per package, the public names without a docstring (or that do not resolve),
    and ``Class.member`` for the undocumented public methods and properties of its
    public classes (each class once: under the first package that exports it)."""
    loader = _loader(packages, search_paths)
    missing: dict[str, list[str]] = {}
    seen: set[str] = set()
    for package in packages:
        names = public_names(package, loader)
        if not names:
            missing.setdefault(package, []).append("(no __all__)")
        for name in names:
            if name in EXEMPT:
                continue
            try:
                target = _target(package, name, loader)
            except Exception as exc:  # an unresolvable alias is a broken export
                missing.setdefault(package, []).append(f"{name} ({type(exc).__name__})")
                continue
            if not _has_docstring(target):
                missing.setdefault(package, []).append(name)
            if target.is_class and target.path not in seen:
                seen.add(target.path)
                for member in undocumented_members(target):
                    missing.setdefault(package, []).append(f"{name}.{member}")
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
        raise PluginError(
            "public names (or methods and properties of public classes) without a "
            "docstring:\n" + "\n".join(lines)
        )


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
