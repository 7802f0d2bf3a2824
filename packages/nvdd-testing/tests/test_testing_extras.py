"""importorskip_extra: a skip outside CI, a failure where NVDD_REQUIRE_EXTRAS=1."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from nvdd.testing import REQUIRE_EXTRAS_ENV, importorskip_extra

pytest_plugins = ["pytester"]

_AUTO = any(ep.name == "nvdd" for ep in entry_points(group="pytest11"))
_P = [] if _AUTO else ["-p", "nvdd.testing.plugin"]

_MISSING = "nvdd_no_such_module_for_tests"
_TESTS = f"""
from nvdd.testing import importorskip_extra

def test_missing():
    importorskip_extra({_MISSING!r})

def test_present():
    assert importorskip_extra("json").dumps(1) == "1"
"""
_MODULE_LEVEL = f"""
from nvdd.testing import importorskip_extra

importorskip_extra({_MISSING!r})

def test_never_collected():
    pass
"""


def test_a_missing_extra_skips_by_default(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(REQUIRE_EXTRAS_ENV, raising=False)
    pytester.makepyfile(_TESTS)
    pytester.runpytest(*_P).assert_outcomes(passed=1, skipped=1)
    monkeypatch.setenv(REQUIRE_EXTRAS_ENV, "0")
    pytester.runpytest(*_P).assert_outcomes(passed=1, skipped=1)


def test_a_missing_extra_fails_when_required(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(REQUIRE_EXTRAS_ENV, "1")
    pytester.makepyfile(_TESTS)
    res = pytester.runpytest(*_P)
    res.assert_outcomes(passed=1, failed=1)
    res.stdout.fnmatch_lines([f"*cannot import '{_MISSING}'*NVDD_REQUIRE_EXTRAS=1*"])


def test_a_module_level_call_fails_the_collection_when_required(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(_MODULE_LEVEL)
    monkeypatch.delenv(REQUIRE_EXTRAS_ENV, raising=False)
    pytester.runpytest(*_P).assert_outcomes(skipped=1)
    monkeypatch.setenv(REQUIRE_EXTRAS_ENV, "1")
    res = pytester.runpytest(*_P)
    res.assert_outcomes(errors=1)
    assert res.ret != 0


def test_a_present_module_is_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_EXTRAS_ENV, "1")
    import json

    assert importorskip_extra("json") is json


def test_assert_needs_extra_hides_the_package_and_checks_the_hint() -> None:
    """While the calls run the package's modules are gone and its import fails; a
    call that names the extra passes, one that names another extra or raises
    nothing fails the check; the modules are back afterwards."""
    import sys
    import types

    from nvdd.core import import_optional
    from nvdd.testing import assert_needs_extra

    def load() -> object:
        return import_optional("nvdd_fake_pkg.sub", package="fake", feature="F", extra="x[fake]")

    with pytest.MonkeyPatch.context() as mp:
        for name in ("nvdd_fake_pkg", "nvdd_fake_pkg.sub"):
            mp.setitem(sys.modules, name, types.ModuleType(name))
        assert load() is sys.modules["nvdd_fake_pkg.sub"]  # (present: no error)
        with pytest.MonkeyPatch.context() as inner:
            assert_needs_extra(inner, "nvdd_fake_pkg", "x[fake]", [load])
            assert sys.modules["nvdd_fake_pkg"] is None and "nvdd_fake_pkg.sub" not in sys.modules
        assert isinstance(sys.modules["nvdd_fake_pkg.sub"], types.ModuleType)  # put back
        with pytest.MonkeyPatch.context() as inner, pytest.raises(AssertionError, match="x"):
            assert_needs_extra(inner, "nvdd_fake_pkg", "x[other]", [load])  # another hint
        with pytest.MonkeyPatch.context() as inner, pytest.raises(pytest.fail.Exception):
            assert_needs_extra(inner, "nvdd_fake_pkg", "x[fake]", [lambda: None])  # no error
