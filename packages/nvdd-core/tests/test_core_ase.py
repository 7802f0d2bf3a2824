"""``Batch.to_ase`` writes kept per-atom virials as ASE's per-atom ``stresses``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from nvdd.core import Batch


def _batch() -> Batch:
    """Two periodic systems (volumes 64 and 150) and one with a zero cell vector."""
    g = torch.Generator().manual_seed(3)
    n = 9
    cell = torch.stack(
        [
            torch.eye(3, dtype=torch.float64) * 4.0,
            torch.diag(torch.tensor([5.0, 6.0, 5.0], dtype=torch.float64)),
            torch.diag(torch.tensor([5.0, 0.0, 5.0], dtype=torch.float64)),
        ]
    )
    cell[1, 1, 0] = 1.5  # triclinic: the volume is still 150
    w = torch.randn(n, 3, 3, generator=g, dtype=torch.float64)
    w = w + w.transpose(1, 2)  # per-atom virials of a pair potential are symmetric
    return Batch(
        positions=torch.rand(n, 3, generator=g, dtype=torch.float64) * 4.0,
        atomic_numbers=torch.full((n,), 18),
        cell=cell,
        pbc=torch.tensor([[True] * 3, [True] * 3, [True, False, True]]),
        system_index=torch.arange(n) % 3,
        atom_ids=torch.arange(n) * 2 + 1,
        atom_extras={"atom_virials": w},
    )


def test_per_atom_stresses_are_minus_the_virials_over_the_volume_in_voigt_order() -> None:
    pytest.importorskip("ase")
    b = _batch()
    w = b.atom_extras["atom_virials"]
    atoms = b.to_ase()
    for s, volume in ((0, 64.0), (1, 150.0)):
        rows = (b.system_index == s).nonzero().flatten()
        expected = -w[rows].numpy() / volume
        got = atoms[s].get_stresses()  # Voigt: xx yy zz yz xz xy
        assert got.shape == (len(rows), 6)
        cols = [(0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)]
        voigt = np.stack([expected[:, a, c] for a, c in cols], 1)
        np.testing.assert_allclose(got, voigt, rtol=0, atol=1e-15)
        np.testing.assert_allclose(atoms[s].get_stresses(voigt=False), expected, rtol=0, atol=1e-15)
    # no volume, no stress (as ASE's own calculators do); energies are unaffected
    assert "stresses" not in atoms[2].calc.results
    assert "stresses" not in b.replace(atom_extras={}).to_ase()[0].calc.results


def test_per_atom_stresses_go_through_an_extxyz_file(tmp_path: Path) -> None:
    pytest.importorskip("ase")
    from ase.io import read, write

    b = _batch()
    atoms = b.to_ase()[:2]
    write(tmp_path / "t.extxyz", atoms, format="extxyz")
    text = (tmp_path / "t.extxyz").read_text()
    assert "stresses:R:6" in text
    back = read(tmp_path / "t.extxyz", index=":")
    for a, ref in zip(back, atoms, strict=True):
        assert a.arrays["atom_ids"].tolist() == ref.arrays["atom_ids"].tolist()
        # extxyz keeps 8 decimals
        np.testing.assert_allclose(a.get_stresses(), ref.get_stresses(), rtol=0, atol=6e-9)
