"""The dependency checker against temporary trees."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nvdd_deps import check, main

ROOT_TOML = """
[tool.nvdd]
layers = {{ {layers} }}
test-only = ["nvdd-testing"]
"""


def make_pkg(
    root: Path,
    dist: str,
    deps: list[str],
    code: str = "",
    test_code: str = "",
    test_group: list[str] | None = None,
    *,
    typed: bool = True,
) -> None:
    name = dist.removeprefix("nvdd-")
    base = root / "packages" / dist
    leaf = base / "src" / "nvdd" / name
    leaf.mkdir(parents=True)
    (base / "tests").mkdir()
    group = "" if test_group is None else f"[dependency-groups]\ntest = {test_group!r}\n"
    (base / "pyproject.toml").write_text(
        f'[project]\nname = "{dist}"\ndependencies = {deps!r}\n{group}'.replace("'", '"')
    )
    (base / "CHANGELOG.md").write_text("# changes\n")
    (leaf / "__init__.py").write_text(textwrap.dedent(code))
    (leaf / "__about__.py").write_text('__version__ = "0"\n')
    if typed:
        (leaf / "py.typed").write_text("")
    (base / "tests" / f"test_{name}.py").write_text(textwrap.dedent(test_code))


def make_root(root: Path, layers: dict[str, int]) -> None:
    body = ", ".join(f'"{k}" = {v}' for k, v in layers.items())
    (root / "pyproject.toml").write_text(ROOT_TOML.format(layers=body))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    make_root(tmp_path, {"nvdd-core": 0, "nvdd-halo": 1, "nvdd-spec": 2})
    make_pkg(tmp_path, "nvdd-core", ["torch"])
    make_pkg(tmp_path, "nvdd-halo", ["nvdd-core"], "from nvdd.core import Batch\n")
    make_pkg(
        tmp_path,
        "nvdd-spec",
        ["nvdd-core", "nvdd-halo"],
        "import nvdd.halo\nfrom nvdd import core\n",
    )
    make_pkg(tmp_path, "nvdd-testing", ["nvdd-core"], "import nvdd.core\n")
    return tmp_path


def test_clean_tree_passes(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check(tree) == []
    assert main([str(tree)]) == 0
    assert "4 packages" in capsys.readouterr().out


def test_undeclared_sibling_import_fails_with_file_and_line(tree: Path) -> None:
    (tree / "packages/nvdd-halo/src/nvdd/halo/_x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nvdd.spec import X\n"
    )
    errors = check(tree)
    assert errors == [
        "packages/nvdd-halo/src/nvdd/halo/_x.py:3: imports nvdd.spec from nvdd-spec, which "
        "nvdd-halo does not declare in its dependencies"
    ]


def test_dynamic_and_namespace_imports_are_seen(tree: Path) -> None:
    (tree / "packages/nvdd-core/src/nvdd/core/_y.py").write_text(
        "import importlib\n\ndef f():\n    from nvdd import halo\n"
        "    return importlib.import_module('nvdd.spec')\n"
    )
    errors = check(tree)
    assert len(errors) == 2
    assert "_y.py:4: imports nvdd.halo from nvdd-halo" in errors[0]
    assert "_y.py:5: imports nvdd.spec from nvdd-spec" in errors[1]


def test_tests_may_use_their_test_group_only(tree: Path) -> None:
    (tree / "packages/nvdd-core/tests/test_z.py").write_text("from nvdd.testing import run_ranks\n")
    assert "imports nvdd.testing from nvdd-testing" in check(tree)[0]
    (tree / "packages/nvdd-core/pyproject.toml").write_text(
        '[project]\nname = "nvdd-core"\ndependencies = ["torch"]\n'
        '[dependency-groups]\ntest = ["pytest", "nvdd-testing"]\n'
    )
    assert check(tree) == []


def test_cycle_and_layer_violation_fail(tree: Path) -> None:
    (tree / "packages/nvdd-core/pyproject.toml").write_text(
        '[project]\nname = "nvdd-core"\ndependencies = ["nvdd-spec"]\n'
    )
    errors = check(tree)
    assert any("depends on nvdd-spec (layer 2) but is in layer 0" in e for e in errors)
    assert "dependency cycle: nvdd-core -> nvdd-spec -> nvdd-core" in errors


def test_cycle_among_unlayered_packages_is_found(tmp_path: Path) -> None:
    make_root(tmp_path, {})
    make_pkg(tmp_path, "nvdd-a", ["nvdd-b"])
    make_pkg(tmp_path, "nvdd-b", ["nvdd-a"])
    errors = check(tmp_path)
    assert "dependency cycle: nvdd-a -> nvdd-b -> nvdd-a" in errors
    assert sum("not in [tool.nvdd] layers" in e for e in errors) == 2


def test_test_only_package_cannot_be_a_runtime_dependency(tree: Path) -> None:
    (tree / "packages/nvdd-halo/pyproject.toml").write_text(
        '[project]\nname = "nvdd-halo"\ndependencies = ["nvdd-core", "nvdd-testing"]\n'
    )
    assert "test-only package nvdd-testing is a runtime dependency" in " ".join(check(tree))


def test_layout_files_are_required(tree: Path) -> None:
    (tree / "packages/nvdd-halo/src/nvdd/halo/py.typed").unlink()
    (tree / "packages/nvdd-halo/CHANGELOG.md").unlink()
    (tree / "packages/nvdd-halo/src/nvdd/__init__.py").write_text("")
    errors = " | ".join(check(tree))
    assert "missing packages/nvdd-halo/src/nvdd/halo/py.typed" in errors
    assert "nvdd-halo (packages/nvdd-halo): missing CHANGELOG.md" in errors
    assert "breaks the PEP 420 namespace" in errors
    assert main([str(tree)]) == 1
