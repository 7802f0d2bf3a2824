"""The public-API docstring check of the docs build (tools/docs_hooks.py), on a
small package written here: an undocumented public method or property of an
exported class fails it, whatever else is documented."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The docs group's griffe: the deps session installs it (NVDD_REQUIRE_EXTRAS=1
# there, so a missing griffe fails instead of skipping).
if os.environ.get("NVDD_REQUIRE_EXTRAS") == "1":
    importlib.import_module("griffe")
else:
    pytest.importorskip("griffe")

PACKAGE = '''
"""A package."""

__all__ = ["Base", "Thing", "helper"]


class Base:
    """A base."""

    def run(self) -> None:
        """Run it."""


class Thing(Base):
    """A thing."""

    limit: int = 3

    def __init__(self) -> None:
        self.value = 1

    def __len__(self) -> int:
        return 1

    def run(self) -> None:
        self.value += 1

    def documented(self) -> None:
        """Documented."""

    def _private(self) -> None:
        pass

    @property
    def size(self) -> int:
        return self.value

    @property
    def name(self) -> str:
        """The name."""
        return "thing"


def helper() -> None:
    """Help."""
'''


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "tools" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _write(root: Path, name: str, source: str) -> tuple[str, ...]:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(textwrap.dedent(source))
    return (str(root),)


def test_an_undocumented_public_method_or_property_fails(tmp_path: Path) -> None:
    hooks = _hooks()
    paths = _write(tmp_path, "demo_undocumented", PACKAGE)
    # the override without a docstring (Base.run's is not inherited) and the
    # property; not __init__/__len__, _private, the class attribute, documented ones
    assert hooks.undocumented(("demo_undocumented",), paths) == {
        "demo_undocumented": ["Thing.run", "Thing.size"]
    }


def test_documenting_them_passes(tmp_path: Path) -> None:
    hooks = _hooks()
    fixed = PACKAGE.replace(
        "    def run(self) -> None:\n        self.value",
        '    def run(self) -> None:\n        """Count a run."""\n        self.value',
    ).replace(
        "    def size(self) -> int:\n        return",
        '    def size(self) -> int:\n        """The size."""\n        return',
    )
    paths = _write(tmp_path, "demo_documented", fixed)
    assert hooks.undocumented(("demo_documented",), paths) == {}
