"""pytest plugin of nvdd (registered through the ``pytest11`` entry point).

Markers: ``gloo`` (spawns CPU ranks), ``gpu`` (needs one CUDA device),
``multigpu`` (needs two or more), ``slow`` (runs only with ``--run-slow`` or
``NVDD_RUN_SLOW=1``), ``requires_extra(module, extra)`` (skips without an
optional module, fails instead where ``NVDD_REQUIRE_EXTRAS=1``: CI). Option
``--require-gpu`` turns a missing device into a failure instead of a skip.

Every test runs under an autouse check: a test that starts without a
``torch.distributed`` process group in this process and ends with one (an
in-process ``init_distributed``, a ``DomainParallel`` that made a world of one)
fails, and the group is destroyed, so the next test starts as this one did
whatever the order. A test that means to leave a group (or cannot help it) says
so with ``@pytest.mark.leaves_process_group``: the group is still destroyed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from nvdd.core import shutdown_distributed
from nvdd.testing._extras import importorskip_extra
from nvdd.testing._oracle import Tolerance, tolerance_for
from nvdd.testing._pool import close_pools

_MARKERS = {
    "gloo": "spawns CPU ranks over gloo (nvdd.testing.run_ranks)",
    "gpu": "needs a CUDA device",
    "multigpu": "needs two or more CUDA devices",
    "slow": "long test; runs only with --run-slow or NVDD_RUN_SLOW=1",
    "requires_extra": "requires_extra(module, extra): skip without the optional module, "
    "fail under NVDD_REQUIRE_EXTRAS=1 (importorskip_extra)",
    "leaves_process_group": "may end with a torch.distributed group it started (destroyed after)",
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


def pytest_unconfigure(config: pytest.Config) -> None:
    close_pools()  # the ranks of run_ranks' pooled worlds exit with the session


def pytest_runtest_setup(item: pytest.Item) -> None:
    config = item.config
    if item.get_closest_marker("slow") and not (
        config.getoption("--run-slow") or os.environ.get("NVDD_RUN_SLOW") == "1"
    ):
        pytest.skip("slow test: pass --run-slow (or NVDD_RUN_SLOW=1)")
    for mark in item.iter_markers("requires_extra"):
        module, extra = mark.args
        importorskip_extra(module, reason=f"needs {module}: pip install '{extra}'")
    need = 2 if item.get_closest_marker("multigpu") else 1 if item.get_closest_marker("gpu") else 0
    if need:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < need:
            msg = f"needs {need} CUDA device(s), {have} visible"
            if config.getoption("--require-gpu"):
                pytest.fail(msg + " (--require-gpu)", pytrace=False)
            pytest.skip(msg)


def _group_alive() -> bool:
    return bool(dist.is_available() and dist.is_initialized())


@pytest.fixture(autouse=True)
def _no_leaked_process_group(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a process group it did not start with (and destroy it)."""
    before = _group_alive()
    yield
    if before or not _group_alive():
        return
    shutdown_distributed()  # nvdd's closers (watchdogs), the group, its meshes
    detail = " (and could not be destroyed)" if _group_alive() else ""
    if request.node.get_closest_marker("leaves_process_group") is None:
        pytest.fail(
            f"{request.node.nodeid} left a torch.distributed process group initialised in the "
            f"test process{detail}: destroy it (nvdd.core.shutdown_distributed) or mark the test "
            "@pytest.mark.leaves_process_group; it was destroyed so later tests do not depend on "
            "this one",
            pytrace=False,
        )


@pytest.fixture(params=[torch.float32, torch.float64], ids=["f32", "f64"])
def float_dtype(request: pytest.FixtureRequest) -> torch.dtype:
    """Both floating dtypes the project supports."""
    dtype: torch.dtype = request.param
    return dtype


@pytest.fixture
def tolerance() -> Callable[[torch.dtype], Tolerance]:
    """``tolerance(dtype) -> Tolerance(atol, rtol)``: the per-dtype tolerance."""
    return tolerance_for
