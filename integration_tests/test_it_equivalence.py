"""N ranks equal 1 rank by atom id: NVE trajectories of LJ and the reference MPNN.

float64: positions within 1e-8 A (modulo lattice vectors on periodic axes),
forces within 1e-10 eV/A, energies within 1e-10 eV, after the whole run.
"""

from __future__ import annotations

import pytest
from it_ranks import run_dd, single
from it_systems import wrapped_max_diff

from nvdd.testing import assert_close_by_id, assert_same_ids, run_ranks

pytestmark = pytest.mark.gloo

# (id, world, system, model, steps, dt fs, grid)
CASES = [
    ("lj-periodic-1rank", 1, "periodic", "lj", 100, 4.0, None),
    ("lj-periodic-slab2", 2, "periodic", "lj", 100, 4.0, (2, 1, 1)),
    ("lj-triclinic-3", 3, "triclinic", "lj", 100, 4.0, None),
    ("lj-periodic-2x2x1", 4, "periodic", "lj", 100, 4.0, (2, 2, 1)),
    ("lj-slab-pbc-4", 4, "slab", "lj", 100, 4.0, None),
    ("lj-cluster-open-2", 2, "cluster", "lj", 100, 4.0, None),
    # boxes 5.26 A wide, ghost width 6.625 A: ghosts come from two ranks away
    ("lj-multihop-4x1x1", 4, "long", "lj", 100, 4.0, (4, 1, 1)),
    ("lj-3d-2x2x2", 8, "periodic", "lj", 100, 4.0, (2, 2, 2)),
    ("mpnn2-periodic-2", 2, "periodic", "mpnn2", 100, 1.0, None),
    ("mpnn3-triclinic-3", 3, "triclinic", "mpnn3", 100, 1.0, None),
    ("mpnn2-slab-4", 4, "slab", "mpnn2", 100, 1.0, (2, 2, 1)),
    ("mpnn2-cluster-8", 8, "cluster", "mpnn2", 100, 1.0, None),
]


@pytest.mark.parametrize(
    ("name", "world", "kind", "model", "steps", "dt", "grid"), CASES, ids=[c[0] for c in CASES]
)
def test_nve_trajectory_equals_one_rank_by_id(
    name: str,
    world: int,
    kind: str,
    model: str,
    steps: int,
    dt: float,
    grid: tuple[int, int, int] | None,
) -> None:
    species = (18, 36) if model.startswith("mpnn") else (18,)
    got = run_ranks(run_dd, world, kind, model, steps, dt, grid, species=species, timeout_s=900)[0]
    ref = single(kind, model, steps, dt, species=species)
    assert_same_ids(got["ids"], ref["ids"], "atom set after the run")
    order = ref["ids"].argsort()
    dx = wrapped_max_diff(got["positions"], ref["positions"][order], ref["cell"], ref["pbc"])
    assert dx < 1e-8, f"positions differ by {dx:.3e} A"
    assert_close_by_id(
        got["ids"], got["forces"], ref["ids"], ref["forces"], atol=1e-10, what="forces"
    )
    assert float((got["energy"] - ref["energy"]).abs().max()) < 1e-10
    assert got["rebuilds"] >= 1
