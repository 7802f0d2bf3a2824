"""``DomainConfig(wrap_whole_axes=True)`` (record 0079) with the shipped models
that need more than the unit tests' Lennard-Jones and MPNN: a whole periodic
axis left to the model's neighbour list equals one process by atom id (forces,
energy, stress) on 2 gloo ranks of a ``2x1x1`` grid, with fewer ghost rows than
the default halo on every rank.

CI runs LJ + Ewald (a pipeline, the reciprocal all-reduce); MACE, PME, DFT-D3
and MPNN + D3 + PME are the same test marked slow (``--run-slow``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from it_systems import hydrocarbon, lr_model, mace_model, oxide, rock_salt

from nvalchemi.distributed._runfile import build_model
from nvdd.dynamics import DistributedModel, DomainConfig, DomainParallel, VelocityVerlet
from nvdd.testing import assert_close_by_id, run_ranks

pytestmark = pytest.mark.gloo

# (the same preload list as test_it_longrange.py: the first module imported sets it)
os.environ.setdefault(
    "NVDD_SPAWN_PRELOAD",
    "nvalchemiops.torch.interactions.electrostatics.pme,nvalchemiops.torch.spline,tad_dftd3",
)

D3 = pytest.mark.requires_extra("tad_dftd3", "nvdd-models[longrange]")
LJ_EWALD = {
    "model": [
        {
            "kind": "lj",
            "cutoff": 5.0,
            "species": {"11": [0.05, 2.35], "17": [0.05, 4.0]},
            "pairs": {"11-17": [0.6, 2.45]},
        },
        {"kind": "ewald", "cutoff": 5.0, "accuracy": 1e-6},
    ]
}
MPNN_D3_PME = {
    "model": [
        {"kind": "mpnn", "cutoff": 4.0, "species": [11, 17], "hidden": 8, "n_layers": 2},
        {"kind": "d3", "functional": "pbe", "cutoff": 5.0, "cn_cutoff": 5.5},
        {"kind": "pme", "cutoff": 5.0, "mesh": [18, 18, 18]},
    ]
}


def _case(name: str) -> tuple[Any, Any, float, float]:
    """(model, system, time step in fs, cutoff) of a case."""
    salt = rock_salt(2, jitter=0.05, seed=1, temperature_k=100.0)
    if name == "lj+ewald":
        return build_model(LJ_EWALD), salt, 1.0, 5.5
    if name == "mpnn+d3+pme":
        return build_model(MPNN_D3_PME), salt, 0.5, 5.5
    if name == "mace":
        return mace_model(), oxide(), 0.5, 3.5
    if name == "d3":
        return lr_model("d3"), hydrocarbon(), 1.0, 5.5
    return lr_model(name), salt, 1.0, 5.5  # ewald, pme


def run_case(name: str, steps: int) -> dict[str, Any]:
    """Rank function: the case with and without the option (ghost rows of both),
    the wrapped run's state gathered on rank 0."""
    got: dict[str, Any] = {}
    for wrap in (False, True):
        model, batch, dt, cutoff = _case(name)
        dyn = VelocityVerlet(model, batch, dt_fs=dt)
        config = DomainConfig(cutoff=cutoff, skin=0.5, grid_dims=(2, 1, 1), wrap_whole_axes=wrap)
        with DomainParallel(dyn, config) as dp:
            dp.partition()
            assert isinstance(dp.model, DistributedModel) and dp.model.wraps_whole_axes == wrap
            got[f"ghosts-{wrap}"] = dp.model.plan.n_ghost
            if wrap:
                dp.run(steps)
                out = dp.gather(0)
                if out is not None:
                    got.update(ids=out.atom_ids, forces=out.forces, energy=out.energy)
                    got["stress"] = out.stress
    return got


CASES = [
    "lj+ewald",
    pytest.param("ewald", marks=pytest.mark.slow),
    pytest.param("pme", marks=pytest.mark.slow),
    pytest.param("d3", marks=[pytest.mark.slow, D3]),
    pytest.param("mace", marks=pytest.mark.slow),
    pytest.param("mpnn+d3+pme", marks=[pytest.mark.slow, D3]),
]


@pytest.mark.parametrize("name", CASES)
def test_a_whole_axis_left_to_the_model_equals_one_process(name: str) -> None:
    steps = 2
    ranks = run_ranks(run_case, 2, name, steps, timeout_s=600)
    assert all(0 < r["ghosts-True"] < r["ghosts-False"] for r in ranks), ranks
    model, batch, dt, _ = _case(name)
    dyn = VelocityVerlet(model, batch, dt_fs=dt)
    dyn.run(steps)
    ref, got = dyn.batch, ranks[0]
    assert float(ref.forces.abs().max()) > 1e-3
    assert_close_by_id(
        got["ids"], got["forces"], ref.atom_ids, ref.forces, atol=1e-10, what="forces"
    )
    torch.testing.assert_close(got["energy"], ref.energy, rtol=0, atol=1e-10)
    torch.testing.assert_close(got["stress"], ref.stress, rtol=0, atol=1e-10)
