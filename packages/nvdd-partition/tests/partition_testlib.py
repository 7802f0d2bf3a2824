"""Deterministic test systems for nvdd-partition (imported by tests and by ranks)."""

from __future__ import annotations

import torch

from nvdd.core import Batch

KINDS = ("periodic", "open", "mixed", "triclinic")


def cell_for(kind: str, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, list[bool]]:
    """A cell and pbc for each kind of boundary."""
    if kind == "periodic":
        return torch.diag(torch.tensor([14.0, 11.0, 9.0], dtype=dtype)), [True, True, True]
    if kind == "triclinic":
        cell = torch.tensor([[12.0, 0.0, 0.0], [3.5, 10.0, 0.0], [-2.0, 2.5, 9.0]], dtype=dtype)
        return cell, [True, True, True]
    if kind == "mixed":
        # Periodic a and b (tilted), open c with no cell vector: a synthetic one is needed.
        cell = torch.tensor([[13.0, 0.0, 0.0], [2.0, 11.0, 0.0], [0.0, 0.0, 0.0]], dtype=dtype)
        return cell, [True, True, False]
    if kind == "open":
        return torch.zeros(3, 3, dtype=dtype), [False, False, False]
    raise ValueError(kind)


def positions_for(
    kind: str, n: int, gen: torch.Generator, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Random positions inside the cell (periodic axes) or in a blob (open axes)."""
    cell, _ = cell_for(kind, dtype)
    frac = torch.rand(n, 3, generator=gen, dtype=dtype)
    if kind == "open":
        return torch.randn(n, 3, generator=gen, dtype=dtype) * 4.0 + 1.5
    pos = frac @ cell
    if kind == "mixed":
        pos[:, 2] = torch.randn(n, generator=gen, dtype=dtype) * 3.0 - 2.0
    return pos


def make_batch(
    n: int,
    kind: str = "periodic",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    n_systems: int = 1,
) -> Batch:
    """``n_systems`` systems of ``n`` atoms each (kinds cycle through ``KINDS`` from
    ``kind``), non-contiguous ids and extras of several dtypes."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    first = KINDS.index(kind)
    for s in range(n_systems):
        k = KINDS[(first + s) % len(KINDS)]
        cell, pbc = cell_for(k, dtype)
        parts.append(
            Batch(
                positions_for(k, n, gen, dtype),
                torch.randint(1, 30, (n,), generator=gen),
                cell=cell,
                pbc=pbc,
                velocities=torch.randn(n, 3, generator=gen, dtype=dtype),
                forces=torch.randn(n, 3, generator=gen, dtype=dtype),
                atom_ids=torch.randperm(n, generator=gen) * 3 + 7 + 100_000 * s,
                energy=torch.randn(1, generator=gen, dtype=dtype),
                stress=torch.randn(1, 3, 3, generator=gen, dtype=dtype),
                atom_extras={
                    "charge": torch.randn(n, generator=gen, dtype=dtype),
                    "tag": torch.randint(0, 1000, (n, 2), generator=gen),
                    "frozen": torch.rand(n, generator=gen) < 0.3,
                },
                system_extras={"temperature": torch.tensor([300.0 + s], dtype=dtype)},
            )
        )
    return parts[0] if n_systems == 1 else Batch.concatenate(parts)


def assert_batches_equal(a: Batch, b: Batch) -> None:
    """Every field (core and extra) bitwise equal, row for row."""
    for name, t in a.atom_fields().items():
        other = b.atom_fields()[name]
        assert t.dtype == other.dtype, name
        assert torch.equal(t, other), f"per-atom field {name} differs"
    assert set(a.atom_fields()) == set(b.atom_fields())
    for name, t in a.system_fields().items():
        assert torch.equal(t, b.system_fields()[name]), f"system field {name} differs"
    assert set(a.system_fields()) == set(b.system_fields())
