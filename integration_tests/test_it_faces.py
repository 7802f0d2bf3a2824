"""Atoms at periodic faces and one-row messages (found by randomized N-vs-1 runs).

- An atom within rounding below a periodic face that a cut splits (``y = -1e-17``:
  ``-1e-17 + L`` rounds to ``L``) used to be stored at ``y = L`` but owned by the
  box at 0: its neighbours were ghosts around the wrong box, and forces were off
  by up to 8e-3 eV/A with no error.
- A float32 batch whose rank receives exactly one ghost row (12-byte rows) used to
  crash in the unpacking of the message.
- Issue 17's skin-0 case: with skin 0 the ghost width is the cutoff, and a ghost
  exactly at its edge was dropped by rounding while the model kept the pair, so
  atoms on the periodic face x = 0 got half a pair force too little.
"""

from __future__ import annotations

import math

import pytest
import torch
from it_faces import (
    JUMP_L,
    JUMP_RC,
    faces_and_a_jumper,
    fcc_with_atom_at,
    lj,
    pair_at_the_ghost_width,
    pair_forces,
    single_point,
    skin_zero_steps,
    two_atoms_across_a_cut,
)
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


def test_skin_zero_faces_and_an_atom_jumping_three_sub_domains() -> None:
    """Issue 17 item 2, end to end: 2 ranks, grid (2, 1, 1), LJ rc 8.5, skin 0; one
    atom crosses three sub-domain boundaries in one step while pinned atoms sit on
    the periodic face x = 0 with partners a few ulps inside the cutoff (ghosts at
    the edge of the ghost width). Every step (each one rebuilds: skin 0), forces
    and energy equal the single-process model on the same positions.

    Checked against the selection without its rounding margin
    (``nvdd.halo._select.rounding_margin`` returning 0): the face atoms and their
    partners are then off by 6.0e-5 eV/A (half of one pair's force) at every step.
    """
    batch = faces_and_a_jumper()
    steps = run_ranks(skin_zero_steps, 2, batch, 3, timeout_s=180)[0]
    assert steps is not None and len(steps) == 4
    model = lj(JUMP_RC)
    ids = batch.atom_ids
    for step, (got_ids, pos, forces, energy) in enumerate(steps):
        order = torch.argsort(got_ids)
        assert torch.equal(got_ids[order], ids)
        here = batch.replace(positions=pos[order])
        ref = model(here)
        # the face pairs are really inside the cutoff (a force worth checking), and
        # the pinned atoms never moved: the edge geometry holds at every step
        assert float(ref["forces"][:6].norm(dim=1).min()) > 1e-4, step
        assert float((here.positions[:6] - batch.positions[:6]).abs().max()) < 1e-30, step
        assert_close_by_id(
            got_ids, forces, ids, ref["forces"], atol=1e-10, what=f"forces at step {step}"
        )
        assert abs(float(energy.sum()) - float(ref["energy"].sum())) < 1e-10, step
    # the jumper went 36 A in one step: 14 -> 50, i.e. 20.9 after the wrap (box 1)
    x1 = float(steps[1][1][torch.argsort(steps[1][0])][6, 0])
    assert abs(x1 - (14.0 + 36.0 - JUMP_L)) < 1e-6, x1


@pytest.mark.parametrize("skin", [0.0, 0.5])
def test_a_ghost_exactly_at_the_ghost_width_across_the_face_keeps_its_pair(skin: float) -> None:
    """Issue 17 item 2 with nothing but the pair: at skin 0 the image of A is a
    ghost of B's box exactly at the ghost width. At 451ab6f the skin-0 case lost
    half the pair force (5.96e-5 of 1.19e-4 eV/A) and skin 0.5 (the control) was
    exact; both are exact now."""
    ids, pos, forces = run_ranks(pair_forces, 2, skin, timeout_s=120)[0]
    batch = pair_at_the_ghost_width()
    order = torch.argsort(ids)
    assert torch.equal(pos[order], batch.positions)  # the geometry is the one intended
    ref = lj(JUMP_RC)(batch)["forces"].detach()
    assert float(ref[:2].norm(dim=1).min()) > 1e-4  # the pair is inside the cutoff
    assert_close_by_id(ids, forces, batch.atom_ids, ref, atol=1e-10, what=f"forces (skin {skin})")
