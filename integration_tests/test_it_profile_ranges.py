"""The profiling scripts' named ranges still point at real functions.

``benchmarks/profile_dd.py`` and ``benchmarks/timeline_dd.py`` wrap functions of
the runtime, by dotted name, in profiler ranges. They run only on the GPU host,
so a renamed or removed function broke them there (session of 2026-12-02: a
whole timeline call of device time lost to ``_nearest_image``, moved by a
refactor). This resolves every name on the CPU.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")


@pytest.fixture(scope="module")
def profile_dd():  # type: ignore[no-untyped-def]
    sys.path.insert(0, BENCH)
    try:
        yield importlib.import_module("profile_dd")
    finally:
        sys.path.remove(BENCH)


def test_every_profiled_range_resolves(profile_dd) -> None:  # type: ignore[no-untyped-def]
    calls = []

    def wrap(f, label):  # type: ignore[no-untyped-def]
        calls.append(label)
        return f

    undo = profile_dd._patched(profile_dd._RANGES, wrap)
    for owner, name, original in undo:
        setattr(owner, name, original)
    assert len(calls) == len(profile_dd._RANGES) > 10
    assert all(callable(original) for _, _, original in undo)
