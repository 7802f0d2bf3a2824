"""The migration's Warp kernel against the torch operations it replaces (one system)."""

from __future__ import annotations

import pytest
import torch
from partition_testlib import KINDS, cell_for, make_batch

from nvdd.partition import SpatialPartitioner
from nvdd.partition._geometry import fractional
from nvdd.partition._migrate_kernel import torch_destinations


def _moved(kind: str, n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, object]:
    """Positions of ``kind`` pushed around: far outside the cell (several periods),
    just below and on a lower face, on the upper face, plus a NaN row."""
    batch = make_batch(n, kind, seed=seed, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    cell, _ = cell_for(kind, dtype)
    pos = batch.positions.clone()
    pos[: n // 3] += (torch.randint(-3, 4, (n // 3, 3), generator=gen).to(dtype)) @ cell
    pos[n // 3 : n // 2] += 2.0 * torch.randn(n // 2 - n // 3, 3, generator=gen, dtype=dtype)
    if kind != "open":
        pos[-4] = 0.0  # on the lower faces
        pos[-3] = cell.sum(dim=0)  # on the upper faces
        pos[-2] = -1e-17 * cell[0] - 1e-17 * cell[1]  # below them by rounding only
    pos[-1, 1] = float("nan")
    return pos, batch


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("hysteresis", [0.0, 0.4])
def test_kernel_destinations_equal_the_torch_ones(
    kind: str, dtype: torch.dtype, hysteresis: float, device: str
) -> None:
    """Same owner for every atom and the same wrapped position (to the last bits
    of a matrix product) on every boundary kind, with and without hysteresis,
    for atoms several periods away, on faces and below them by rounding; a
    non-finite row keeps its position and this rank."""
    for seed, world in ((0, 4), (5, 6), (9, 8)):
        pos, batch = _moved(kind, 300, dtype, seed)
        part = SpatialPartitioner.from_batch(batch, world, 2.5, skin=1.0)
        pos, batch = pos.to(device), batch.to(device)
        si = torch.zeros(pos.shape[0], dtype=torch.int64, device=device)
        for rank in (0, world - 1):
            wrapped, dest = part._destinations(pos, si, rank, hysteresis, batch.cell)
            ref_wrapped, ref_dest = torch_destinations(part, pos, si, rank, hysteresis, batch.cell)
            finite = torch.isfinite(pos).all(dim=1)
            assert torch.equal(dest[finite], ref_dest[finite]), (kind, seed, rank)
            tol = 1e-11 if dtype == torch.float64 else 2e-5
            torch.testing.assert_close(wrapped[finite], ref_wrapped[finite], atol=tol, rtol=0)
            for w, d in ((wrapped, dest), (ref_wrapped, ref_dest)):  # non-finite rows stay
                assert int(d[~finite][0]) == rank
                torch.testing.assert_close(w[~finite], pos[~finite], equal_nan=True, atol=0, rtol=0)
            # wrapped atoms lie in the cell on periodic axes (a point below a face
            # by rounding only stays where it is; hysteresis keeps some next to
            # their box, one period away)
            if kind != "open" and hysteresis == 0.0:
                inv = torch.linalg.inv(part.domain_cell(batch.cell).double()).to(device)
                frac = fractional(wrapped[finite], si[finite], inv)
                periodic = part.pbc[0].to(device)
                assert bool((frac[:, periodic] >= -1e-12).all()), kind
                assert bool((frac[:, periodic] < 1.0).all()), kind


def test_the_kernel_follows_a_changed_cell_and_grid() -> None:
    """A cell scaled by 3 % (NPT) and a finer grid give the torch owners."""
    pos, batch = _moved("triclinic", 400, torch.float64, 3)
    si = torch.zeros(pos.shape[0], dtype=torch.int64)
    for world, grid in ((12, (3, 2, 2)), (5, (5, 1, 1)), (4, (1, 1, 4))):
        part = SpatialPartitioner.from_batch(batch, world, 2.0, grid_dims=grid, skin=1.0)
        for cell in (batch.cell, batch.cell * 1.03):
            for rank in range(world):
                _, dest = part._destinations(pos, si, rank, 0.2, cell)
                _, ref = torch_destinations(part, pos, si, rank, 0.2, cell)
                finite = torch.isfinite(pos).all(dim=1)
                assert torch.equal(dest[finite], ref[finite]), (world, rank)


@pytest.mark.parametrize("world", [1, 2, 5, 16, 17, 40])
def test_destination_counts_equal_bincount(world: int) -> None:
    from nvdd.partition._sharded import _destination_counts

    gen = torch.Generator().manual_seed(world)
    for n in (0, 1, 1000):
        dest = torch.randint(0, world, (n,), generator=gen)
        counts = _destination_counts(dest, world)
        assert counts.dtype == torch.int64
        assert torch.equal(counts, torch.bincount(dest, minlength=world))
