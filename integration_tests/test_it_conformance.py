"""The conformance kit on the shipped models (LJ, the reference MPNN, MACE), and
trace_and_validate on MACE: it passes, and names the faulty module when the
ghost refresh adapter is removed from the spec."""

from __future__ import annotations

import pytest
from it_systems import crystal, lj_model, mace_model, mpnn_model, oxide

from nvdd.dynamics import trace_and_validate
from nvdd.spec import DistributionSpec
from nvdd.testing import assert_dd_equivalent

pytestmark = pytest.mark.gloo


def test_lennard_jones_passes_the_kit() -> None:
    report = assert_dd_equivalent(
        lj_model(), crystal("periodic"), ranks=(2, 3, 4), steps=20, dt_fs=2.0
    )
    assert report.passed and len(report.cases) == 12


@pytest.mark.parametrize("neighbors", ["verlet", "device"])
def test_reference_mpnn_passes_the_kit(neighbors: str) -> None:
    """Both neighbour paths: the Verlet list (the CPU default) and the device
    edges at fixed capacities (the CUDA default), on every geometry of the kit."""
    batch = crystal("periodic", species=(18, 36))
    model = mpnn_model(2, neighbors=neighbors)
    report = assert_dd_equivalent(model, batch, ranks=(2, 4), steps=10, dt_fs=1.0)
    assert report.passed and len(report.cases) == 8


def test_mace_passes_the_kit() -> None:
    report = assert_dd_equivalent(mace_model(), oxide((5, 4, 4)), ranks=(2, 3), steps=8, dt_fs=0.5)
    assert report.passed and len(report.cases) == 8
    assert all(c.errors["cross_rank_pairs"] > 0 for c in report.cases)


def test_trace_and_validate_passes_on_mace_and_names_the_faulty_module() -> None:
    model, batch = mace_model(), oxide((5, 4, 4))
    report = trace_and_validate(model, batch)
    assert report.passed, report.summary()
    assert all(d.ok for d in report.layers) and len(report.layers) > 10
    assert report.not_probed  # e3nn's scripted kernels: skipped, their parents probed
    broken = model.distribution_spec().replace(distribution=DistributionSpec(), name="no refresh")
    report = trace_and_validate(model, batch, spec=broken)
    assert not report.passed
    assert report.first_uncovered == "mace.interactions.1"
    assert report.culprit is not None
    assert (report.culprit.stale_input, report.culprit.producer) == (
        "node_feats",
        "mace.products.0",
    )
    assert "mace.interactions.1" in report.summary()
