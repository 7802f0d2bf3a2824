"""trace_and_validate: verdicts, per-layer diagnostics, and an auto-fix."""

from __future__ import annotations

import pytest
from dyn_models import SoftPair, ToyMP
from test_dynamics_domain_parallel import make_gas

from nvdd.core import ConfigurationError
from nvdd.dynamics import trace_and_validate

pytestmark = pytest.mark.gloo


def test_a_correct_spec_passes() -> None:
    report = trace_and_validate(SoftPair(), make_gas(n=36, triclinic=True), world_size=2)
    assert report.passed, report.summary()
    assert set(report.errors) == {"energy", "forces", "stress"}
    assert max(report.errors.values()) < 1e-10
    assert report.applied_fixes == [] and "PASSED" in report.summary()


def test_uncovered_ghost_refresh_is_pinpointed_and_fixed() -> None:
    batch = make_gas(n=30, pbc=(False, False, False))
    report = trace_and_validate(ToyMP(), batch, world_size=2)
    assert not report.passed
    assert report.first_uncovered == "layers.1"  # layer 0's owned rows are still right
    assert [d.module for d in report.layers] == ["layers.0", "layers.1"]
    assert report.layers[0].ok and report.errors["forces"] > 1e-6
    fixed = trace_and_validate(ToyMP(), batch, world_size=2, fix=True)
    assert fixed.passed, fixed.summary()
    assert fixed.applied_fixes[-1].startswith("refresh ghost rows after MPLayer.forward")
    assert len(fixed.spec.adapters()) == 1


def test_validation_arguments() -> None:
    with pytest.raises(ConfigurationError, match="world_size >= 2"):
        trace_and_validate(SoftPair(), make_gas(), world_size=1)
