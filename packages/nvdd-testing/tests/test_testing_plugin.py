"""The pytest plugin: markers, --require-gpu, --run-slow, tolerance fixtures."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

from nvdd.testing import TOLERANCES, Tolerance

pytest_plugins = ["pytester"]

# Installed, the plugin loads through its pytest11 entry point; from a source tree
# (tools/devtest) it must be named with -p.
_AUTO = any(ep.name == "nvdd" for ep in entry_points(group="pytest11"))
_P = [] if _AUTO else ["-p", "nvdd.testing.plugin"]

_TESTS = """
import pytest

@pytest.mark.gpu
def test_gpu():
    pass

@pytest.mark.multigpu
def test_multi():
    pass

@pytest.mark.slow
def test_slow():
    pass

def test_plain():
    pass
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_gpu_tests_skip_without_gpu_and_fail_with_require_gpu(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_TESTS)
    res = pytester.runpytest(*_P, "--strict-markers")
    res.assert_outcomes(passed=1, skipped=3)
    res = pytester.runpytest(*_P, "--strict-markers", "--require-gpu")
    res.assert_outcomes(passed=1, skipped=1, errors=2)
    res.stdout.fnmatch_lines(["*needs 1 CUDA device(s), 0 visible (--require-gpu)*"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts skips of gpu tests")
def test_run_slow_option_runs_slow_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_TESTS)
    res = pytester.runpytest(*_P, "--run-slow")
    res.assert_outcomes(passed=2, skipped=2)


def test_tolerance_fixture(tolerance: object, float_dtype: torch.dtype) -> None:
    tol = tolerance(float_dtype)  # type: ignore[operator]
    assert isinstance(tol, Tolerance)
    assert tol == TOLERANCES[float_dtype]
    assert (tol.atol == 1e-10) == (float_dtype == torch.float64)


_LEAKS = """
import pytest
import torch.distributed as dist
from nvdd.core import init_distributed

def test_leaks():
    init_distributed(backend="gloo")

@pytest.mark.leaves_process_group
def test_leaks_and_says_so():
    init_distributed(backend="gloo")

def test_next_starts_clean():
    assert not dist.is_initialized()
"""


def test_a_test_that_leaves_a_process_group_fails_and_the_next_starts_clean(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(_LEAKS)
    res = pytester.runpytest_subprocess(*_P, "--strict-markers", "-p", "no:cacheprovider")
    res.assert_outcomes(passed=3, errors=1)
    res.stdout.fnmatch_lines(
        ["*test_leaks left a torch.distributed process group initialised in the test process*"]
    )
