"""StrategyKind.GRAPH_PARTITION: N ranks equal 1 rank by atom id (reference MPNN).

The model builds its own neighbour list on each rank's index block plus the atoms
its edges read, with the real cell and pbc; float64 forces within 1e-10 eV/A.
"""

from __future__ import annotations

import pytest
from it_ranks import run_dd, single
from it_systems import wrapped_max_diff

from nvdd.testing import assert_close_by_id, assert_same_ids, run_ranks

pytestmark = pytest.mark.gloo

SPECIES = (18, 36)

# (id, world, system, model, steps)
CASES = [
    ("mpnn2-periodic-2", 2, "periodic", "mpnn2", 40),
    ("mpnn2-cluster-2", 2, "cluster", "mpnn2", 40),
    ("mpnn3-triclinic-3", 3, "triclinic", "mpnn3", 40),
    ("mpnn2-cluster-3", 3, "cluster", "mpnn2", 40),
    ("mpnn2-slab-4", 4, "slab", "mpnn2", 40),
    ("mpnn2-cluster-4", 4, "cluster", "mpnn2", 40),
    ("lj-periodic-4", 4, "periodic", "lj", 40),
]


def _check(got: dict, ref: dict, dx_max: float) -> None:
    assert_same_ids(got["ids"], ref["ids"], "atom set after the run")
    order = ref["ids"].argsort()
    dx = wrapped_max_diff(got["positions"], ref["positions"][order], ref["cell"], ref["pbc"])
    assert dx < dx_max, f"positions differ by {dx:.3e} A"
    assert_close_by_id(
        got["ids"], got["forces"], ref["ids"], ref["forces"], atol=1e-10, what="forces"
    )
    assert float((got["energy"] - ref["energy"]).abs().max()) < 1e-10


@pytest.mark.parametrize(
    ("name", "world", "kind", "model", "steps"), CASES, ids=[c[0] for c in CASES]
)
def test_graph_partition_equals_one_rank_by_id(
    name: str, world: int, kind: str, model: str, steps: int
) -> None:
    species = SPECIES if model.startswith("mpnn") else (18,)
    dt = 1.0 if model.startswith("mpnn") else 4.0
    got = run_ranks(
        run_dd,
        world,
        kind,
        model,
        steps,
        dt,
        None,
        species=species,
        temperature_k=300.0,
        strategy="graph_partition",
        timeout_s=600,
    )[0]
    ref = single(kind, model, steps, dt, species=species, temperature_k=300.0)
    _check(got, ref, 1e-8)
    assert got["rebuilds"] >= 1 and got["n_ghost"] > 0


def test_graph_partition_500_step_nve_conserves_atoms_and_energy() -> None:
    steps, every = 500, 50
    got = run_ranks(
        run_dd,
        2,
        "periodic",
        "mpnn2",
        steps,
        1.0,
        None,
        species=SPECIES,
        every=every,
        temperature_k=300.0,
        strategy="graph_partition",
        timeout_s=900,
    )[0]
    ref = single("periodic", "mpnn2", steps, 1.0, species=SPECIES, every=every, temperature_k=300.0)
    assert got["ids_checks"] == steps // every  # a GLOBAL hook saw every id once, 10 times
    assert got["rebuilds"] > 1
    _check(got, ref, 1e-6)
    drift_dd = max(abs(e - got["energies"][0]) for e in got["energies"])
    drift_1 = max(abs(e - ref["energies"][0]) for e in ref["energies"])
    assert abs(drift_dd - drift_1) < 1e-8, (drift_dd, drift_1)
