"""binary_lattice: the small two-element test system the model tests share."""

from __future__ import annotations

import torch

from nvdd.testing import binary_lattice


def test_binary_lattice_is_a_jittered_periodic_two_element_crystal() -> None:
    """Sites of a simple-cubic lattice moved by at most a few jitters, both elements
    present (mostly the first), shuffled unique ids of the given step, periodic
    orthorhombic cell; the same batch for the same seed, another for another."""
    batch = binary_lattice((4, 3, 2), spacing=2.0, seed=3)
    assert batch.n_atoms == 24 and batch.dtype == torch.float64
    assert bool(batch.pbc.all()) and torch.equal(
        batch.cell[0], torch.diag(torch.tensor([8.0, 6.0, 4.0], dtype=torch.float64))
    )
    z = batch.atomic_numbers
    assert set(z.tolist()) == {8, 14} and int((z == 8).sum()) > int((z == 14).sum())
    ids = batch.atom_ids
    assert len(set(ids.tolist())) == 24 and bool((ids % 3 == 2).all())
    assert not torch.equal(ids, ids.sort().values)  # (shuffled)
    site = (batch.positions / 2.0 - 0.5).round()
    offset = (batch.positions - (site + 0.5) * 2.0).abs()
    assert 0.0 < float(offset.max()) < 0.5  # jittered by ~0.1 A
    again = binary_lattice((4, 3, 2), spacing=2.0, seed=3)
    assert torch.equal(again.positions, batch.positions) and torch.equal(again.atom_ids, ids)
    other = binary_lattice((4, 3, 2), spacing=2.0, seed=4, species=(11, 17), id_step=1)
    assert not torch.equal(other.positions, batch.positions)
    assert set(other.atomic_numbers.tolist()) <= {11, 17}
    assert sorted(other.atom_ids.tolist()) == list(range(24))
