"""Domain cells, interplanar spacings, wrapping and fractional coordinates."""

from __future__ import annotations

import pytest
import torch
from partition_testlib import cell_for, positions_for

from nvdd.core import ValidationError
from nvdd.partition import SpatialPartitioner


def test_interplanar_spacings_of_a_triclinic_cell() -> None:
    cell, pbc = cell_for("triclinic")
    part = SpatialPartitioner(cell, pbc, 1, 2.0)
    a, b, c = cell.unbind(0)
    vol = float(torch.abs(torch.linalg.det(cell)))
    expected = [
        vol / float(torch.linalg.vector_norm(torch.linalg.cross(b, c))),
        vol / float(torch.linalg.vector_norm(torch.linalg.cross(c, a))),
        vol / float(torch.linalg.vector_norm(torch.linalg.cross(a, b))),
    ]
    got = (2.0 / part.ghost_frac()[0]).tolist()
    assert got == pytest.approx(expected, rel=1e-12)
    assert torch.equal(part.domain_cell(), cell.unsqueeze(0))  # all periodic: unchanged


def test_synthetic_vector_for_an_open_axis_without_one() -> None:
    cell, pbc = cell_for("mixed")
    pos = positions_for("mixed", 50, torch.Generator().manual_seed(1))
    part = SpatialPartitioner(cell, pbc, 2, 2.0, positions=pos)
    dc = part.domain_cell()[0]
    assert torch.equal(dc[:2], cell[:2])  # periodic rows kept
    normal = torch.linalg.cross(cell[0], cell[1])
    normal = normal / torch.linalg.vector_norm(normal)
    c = dc[2]
    length = float(torch.linalg.vector_norm(c))
    assert float(torch.abs(c @ normal)) == pytest.approx(length, rel=1e-12)  # along the normal
    extent = float((pos @ normal).max() - (pos @ normal).min())
    assert length == pytest.approx(extent, rel=1e-12)


def test_open_cell_vectors_are_kept_when_usable_and_replaced_when_parallel() -> None:
    slab = torch.tensor([[10.0, 0, 0], [0, 10.0, 0], [1.0, 0.5, 30.0]])  # vacuum along c
    part = SpatialPartitioner(slab, [True, True, False], 2, 2.0)
    assert torch.equal(part.domain_cell()[0], slab.double())
    parallel = torch.tensor([[10.0, 0, 0], [0, 10.0, 0], [5.0, 5.0, 1e-9]])
    part = SpatialPartitioner(parallel, [True, True, False], 1, 2.0)
    c = part.domain_cell()[0, 2]
    assert torch.allclose(c, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))  # synthetic
    part = SpatialPartitioner(torch.zeros(3, 3), [False] * 3, 1, 2.0)
    assert torch.equal(part.domain_cell()[0], torch.eye(3, dtype=torch.float64))


def test_domain_cell_follows_a_new_periodic_cell_and_keeps_open_rows() -> None:
    cell, pbc = cell_for("mixed")
    pos = positions_for("mixed", 30, torch.Generator().manual_seed(2))
    part = SpatialPartitioner(cell, pbc, 2, 2.0, positions=pos)
    bigger = cell.clone()
    bigger[:2] *= 1.1
    dc = part.domain_cell(bigger.float())
    assert dc.dtype == torch.float32 and dc.shape == (1, 3, 3)
    assert torch.equal(dc[0, :2], bigger[:2].float())
    assert torch.equal(dc[0, 2], part.domain_cell()[0, 2].float())
    with pytest.raises(ValidationError, match="expected \\(1, 3, 3\\)"):
        part.domain_cell(torch.zeros(2, 3, 3))


def test_singular_periodic_cell_is_rejected() -> None:
    cell = torch.tensor([[5.0, 0, 0], [10.0, 0, 0], [0, 0, 5.0]])
    with pytest.raises(ValidationError, match="singular"):
        SpatialPartitioner(cell, [True, True, True], 2, 1.0)


@pytest.mark.parametrize("kind", ["periodic", "triclinic", "mixed"])
def test_wrap_positions(kind: str) -> None:
    cell, pbc = cell_for(kind)
    gen = torch.Generator().manual_seed(3)
    inside = positions_for(kind, 40, gen)
    part = SpatialPartitioner(cell, pbc, 1, 2.0, positions=inside)
    shifts = torch.randint(-3, 4, (40, 3), generator=gen).double()
    shifts[:, ~torch.tensor(pbc)] = 0.0
    outside = inside + shifts @ part.domain_cell()[0]
    wrapped = part.wrap_positions(outside)
    assert torch.allclose(wrapped, inside, atol=1e-12)
    frac = part.fractional(wrapped, wrap=False)
    periodic = torch.tensor(pbc)
    assert bool((frac[:, periodic] > -1e-12).all()) and bool((frac[:, periodic] < 1 + 1e-12).all())
    assert torch.equal(part.wrap_positions(inside), inside)  # bit for bit when inside
    assert torch.equal(wrapped[:, ~periodic], outside[:, ~periodic]) or not bool((~periodic).any())
    # float32 positions keep their dtype and agree to float32 precision.
    w32 = part.wrap_positions(outside.float())
    assert w32.dtype == torch.float32
    assert torch.allclose(w32.double(), inside, atol=1e-4)


def test_fractional_wraps_into_unit_interval_on_periodic_axes() -> None:
    cell, pbc = cell_for("periodic")
    part = SpatialPartitioner(cell, pbc, 1, 2.0)
    pos = torch.tensor([[-1e-17, 11.0, 9.0 * 5 + 1.0]], dtype=torch.float64)
    frac = part.fractional(pos)
    assert bool((frac >= 0).all()) and bool((frac < 1).all())
    assert frac[0, 1] == 0.0


@pytest.mark.parametrize("kind", ["periodic", "triclinic", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_points_at_faces_wrap_once_and_their_owner_box_holds_them(
    kind: str, dtype: torch.dtype
) -> None:
    """Points on and within rounding of periodic faces (``-1e-17`` used to wrap to
    ``L`` and be owned by the box at 0: a wrong force two ranks apart): wrapping
    is idempotent, and each wrapped point lies in its owner's box up to the halo's
    rounding margin."""
    cell, pbc = cell_for(kind)
    gen = torch.Generator().manual_seed(3)
    part = SpatialPartitioner(
        cell,
        pbc,
        8,
        2.0,
        grid_dims=(2, 2, 2) if kind != "mixed" else (4, 2, 1),
        positions=positions_for(kind, 64, gen),
    )
    periodic = torch.tensor(pbc)
    frac = torch.rand(300, 3, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    eps = torch.finfo(dtype).eps
    faces = torch.tensor([0.0, 1.0, -1.0, 2.0, 0.5], dtype=torch.float64)
    offsets = torch.tensor([0.0, -1e-17, 1e-17, -eps, eps, -4 * eps, 3 * eps], dtype=torch.float64)
    for axis in range(3):
        if not pbc[axis]:
            continue
        rows = torch.arange(axis * 100, axis * 100 + 100)
        pick = torch.randint(0, len(faces), (100,), generator=gen)
        off = torch.randint(0, len(offsets), (100,), generator=gen)
        frac[rows, axis] = faces[pick] + offsets[off]
    dom = part.domain_cell()[0]
    pos = (frac @ dom).to(dtype)
    wrapped = part.wrap_positions(pos)
    assert torch.equal(part.wrap_positions(wrapped), wrapped)  # wrapping twice is once
    owner = part.owner_of(wrapped)
    assert torch.equal(owner, part.owner_of(pos))
    stored = part.fractional(wrapped, wrap=False)
    boxes = part.boxes[0].to(torch.float64)  # (world, 2, 3)
    lo, hi = boxes[owner, 0], boxes[owner, 1]
    tol = 64 * eps * 2  # the halo's rounding margin at |frac| <= 1
    inside = (stored >= lo - tol) & (stored <= hi + tol)
    assert bool(inside[:, periodic].all()), stored[~inside.all(1)][:3]
