"""Atoms at periodic faces and one-row messages (found by randomized N-vs-1 runs).

- An atom within rounding below a periodic face that a cut splits (``y = -1e-17``:
  ``-1e-17 + L`` rounds to ``L``) used to be stored at ``y = L`` but owned by the
  box at 0: its neighbours were ghosts around the wrong box, and forces were off
  by up to 8e-3 eV/A with no error.
- A float32 batch whose rank receives exactly one ghost row (12-byte rows) used to
  crash in the unpacking of the message.
"""

from __future__ import annotations

import math

import pytest
import torch
from it_faces import fcc_with_atom_at, lj, single_point, two_atoms_across_a_cut
from it_systems import AR_A

from nvdd.testing import assert_close_by_id, run_ranks

pytestmark = pytest.mark.gloo

L = 3 * AR_A


@pytest.mark.parametrize("y0", [-1e-17, -1e-16, math.nextafter(-L, -math.inf), L])
@pytest.mark.parametrize(("world", "grid"), [(2, (1, 2, 1)), (4, (2, 2, 1))])
def test_an_atom_at_a_split_periodic_face_gets_the_single_process_forces(
    y0: float, world: int, grid: tuple[int, int, int]
) -> None:
    batch = fcc_with_atom_at(y0)
    ref = lj(6.0)(batch)
    got = run_ranks(single_point, world, batch, 6.0, grid)[0]
    ids = torch.arange(batch.n_atoms)
    assert_close_by_id(got.atom_ids, got.forces, ids, ref["forces"], atol=1e-10, what="forces")
    assert abs(float(got.energy.sum()) - float(ref["energy"].sum())) < 1e-10


@pytest.mark.parametrize("strategy", ["halo", "graph_partition"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_single_ghost_row_of_any_dtype_arrives(strategy: str, dtype: torch.dtype) -> None:
    batch = two_atoms_across_a_cut(dtype)
    ref = lj(4.0, dtype)(batch)
    grid = (2, 1, 1) if strategy == "halo" else None
    got = run_ranks(single_point, 2, batch, 4.0, grid, strategy)[0]
    ids = torch.arange(batch.n_atoms)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert_close_by_id(got.atom_ids, got.forces, ids, ref["forces"], atol=tol, what="forces")
    assert float(ref["energy"].sum()) > 0.05  # the pair is inside the cutoff
    assert abs(float(got.energy.sum()) - float(ref["energy"].sum())) < tol
