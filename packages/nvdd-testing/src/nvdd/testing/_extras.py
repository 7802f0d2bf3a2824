"""`importorskip_extra`: skip without an optional dependency, fail where CI installed it.

``pytest.importorskip`` turns a missing module into a skip. Where the nox
sessions install every extra (the package test groups, the integration suite)
a skip can only mean a broken install, which must not pass silently: those
sessions set ``NVDD_REQUIRE_EXTRAS=1``, and under it the same call fails.

`assert_needs_extra`: the other side, what a user without the extra sees.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable, Iterable
from types import ModuleType

import pytest

from nvdd.core import OptionalDependencyError

__all__ = ["REQUIRE_EXTRAS_ENV", "assert_needs_extra", "importorskip_extra"]

#: Environment variable that turns a missing optional dependency into a failure.
REQUIRE_EXTRAS_ENV = "NVDD_REQUIRE_EXTRAS"


def importorskip_extra(modname: str, *, reason: str | None = None) -> ModuleType:
    """Import ``modname``; without it, skip the test, or fail under ``NVDD_REQUIRE_EXTRAS=1``.

    Use it instead of ``pytest.importorskip`` for optional dependencies that the
    CI sessions install (at a module's top it skips, or fails, the whole module).

    Parameters
    ----------
    modname:
        Dotted module name, e.g. ``"mace"``.
    reason:
        The skip message (default: pytest's).

    Returns
    -------
    ModuleType
        The imported module.
    """
    if os.environ.get(REQUIRE_EXTRAS_ENV, "") != "1":
        module: ModuleType = pytest.importorskip(modname, reason=reason)
        return module
    try:
        return importlib.import_module(modname)
    except ImportError as exc:
        pytest.fail(
            f"cannot import {modname!r} ({type(exc).__name__}: {exc}), but "
            f"{REQUIRE_EXTRAS_ENV}=1 says this environment installs it: the install is "
            "broken (or the package's test dependencies do not declare it)",
            pytrace=False,
        )


def assert_needs_extra(
    monkeypatch: pytest.MonkeyPatch,
    module: str,
    extra: str,
    calls: Iterable[Callable[[], object]],
) -> None:
    """Each of ``calls`` raises an ``OptionalDependencyError`` naming
    ``pip install '<extra>'`` while the package ``module`` cannot be imported.

    Every module of the package (``module`` and ``module.*``) is dropped from
    ``sys.modules`` and ``import module`` fails while the calls run; ``monkeypatch``
    puts them back at the end of the test.

    Parameters
    ----------
    monkeypatch:
        The test's ``monkeypatch`` fixture.
    module:
        The top-level module of the optional package, e.g. ``"sevenn"``.
    extra:
        The extra the error must name, e.g. ``"nvdd-models[sevenn]"``.
    calls:
        What a user calls (constructors, loaders), each with no arguments.
    """
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # import module -> ImportError
    hint = re.escape(f"pip install '{extra}'")
    for call in calls:
        with pytest.raises(OptionalDependencyError, match=hint):
            call()
