"""pytest plugin of nvdd (registered through the ``pytest11`` entry point).

Markers: ``gloo`` (spawns CPU ranks), ``gpu`` (needs one CUDA device),
``multigpu`` (needs two or more), ``slow`` (runs only with ``--run-slow`` or
``NVDD_RUN_SLOW=1``). Option ``--require-gpu`` turns a missing device into a
failure instead of a skip.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from nvdd.testing._oracle import Tolerance, tolerance_for

_MARKERS = {
    "gloo": "spawns CPU ranks over gloo (nvdd.testing.run_ranks)",
    "gpu": "needs a CUDA device",
    "multigpu": "needs two or more CUDA devices",
    "slow": "long test; runs only with --run-slow or NVDD_RUN_SLOW=1",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nvdd")
    group.addoption(
        "--require-gpu",
        action="store_true",
        default=False,
        help="fail (instead of skip) gpu / multigpu tests when the devices are missing",
    )
    group.addoption("--run-slow", action="store_true", default=False, help="run slow tests")


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in _MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    config = item.config
    if item.get_closest_marker("slow") and not (
        config.getoption("--run-slow") or os.environ.get("NVDD_RUN_SLOW") == "1"
    ):
        pytest.skip("slow test: pass --run-slow (or NVDD_RUN_SLOW=1)")
    need = 2 if item.get_closest_marker("multigpu") else 1 if item.get_closest_marker("gpu") else 0
    if need:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < need:
            msg = f"needs {need} CUDA device(s), {have} visible"
            if config.getoption("--require-gpu"):
                pytest.fail(msg + " (--require-gpu)", pytrace=False)
            pytest.skip(msg)


@pytest.fixture(params=[torch.float32, torch.float64], ids=["f32", "f64"])
def float_dtype(request: pytest.FixtureRequest) -> torch.dtype:
    """Both floating dtypes the project supports."""
    dtype: torch.dtype = request.param
    return dtype


@pytest.fixture
def tolerance() -> Callable[[torch.dtype], Tolerance]:
    """``tolerance(dtype) -> Tolerance(atol, rtol)``: the per-dtype tolerance."""
    return tolerance_for
