"""Batch: construction defaults, every validation error, reordering, ASE round trip."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from nvdd.core import ATOMIC_MASSES, Batch, NvddError, ValidationError


def make_batch(
    n: int = 6, n_systems: int = 2, dtype: torch.dtype = torch.float64, seed: int = 0
) -> Batch:
    g = torch.Generator().manual_seed(seed)
    cell = torch.stack([torch.eye(3, dtype=dtype) * (4.0 + s) for s in range(n_systems)])
    return Batch(
        positions=torch.rand(n, 3, generator=g, dtype=dtype) * 4.0,
        atomic_numbers=torch.randint(1, 30, (n,), generator=g),
        cell=cell,
        pbc=torch.tensor([[True, True, False]] * n_systems),
        velocities=torch.randn(n, 3, generator=g, dtype=dtype),
        forces=torch.randn(n, 3, generator=g, dtype=dtype),
        system_index=torch.arange(n) % n_systems,
        atom_ids=torch.randperm(n, generator=g) * 3 + 5,
        energy=torch.randn(n_systems, generator=g, dtype=dtype),
        stress=torch.randn(n_systems, 3, 3, generator=g, dtype=dtype),
        atom_extras={
            "charge": torch.randn(n, generator=g, dtype=dtype),
            "tag": torch.arange(n)[:, None].repeat(1, 2),
        },
        system_extras={"temperature": torch.arange(n_systems, dtype=dtype)},
    )


def test_defaults_fill_every_field() -> None:
    b = Batch(torch.zeros(3, 3), torch.tensor([1, 8, 18], dtype=torch.int32))
    assert b.n_atoms == 3 and b.n_systems == 1
    assert b.atomic_numbers.dtype == torch.int64
    assert b.masses.tolist() == pytest.approx(
        [ATOMIC_MASSES[1], ATOMIC_MASSES[8], ATOMIC_MASSES[18]]
    )
    assert b.atom_ids.tolist() == [0, 1, 2]
    assert b.pbc.tolist() == [[False, False, False]]
    assert b.cell.shape == (1, 3, 3) and b.energy.shape == (1,) and b.stress.shape == (1, 3, 3)
    assert torch.equal(b.velocities, torch.zeros(3, 3))


def test_pbc_and_cell_broadcast_for_one_system() -> None:
    b = Batch(
        torch.zeros(2, 3), torch.tensor([1, 1]), cell=torch.eye(3) * 2, pbc=[True, False, True]
    )
    assert b.cell.shape == (1, 3, 3)
    assert b.pbc.tolist() == [[True, False, True]]


# Every validation error, with the field it must name.
_BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "positions shape",
        lambda k: k.update(positions=torch.zeros(6, 2, dtype=torch.float64)),
        r"positions has shape \(6, 2\)",
    ),
    (
        "positions int",
        lambda k: k.update(positions=torch.zeros(6, 3, dtype=torch.int64)),
        "positions must be floating point",
    ),
    (
        "positions nan",
        lambda k: k["positions"].__setitem__((2, 1), float("nan")),
        r"positions has non-finite values \(first at row 2\)",
    ),
    (
        "velocities inf",
        lambda k: k["velocities"].__setitem__((4, 0), float("inf")),
        r"velocities has non-finite values \(first at row 4\)",
    ),
    (
        "forces shape",
        lambda k: k.update(forces=torch.zeros(5, 3, dtype=torch.float64)),
        r"forces has shape \(5, 3\), expected \(6, 3\)",
    ),
    (
        "masses dtype",
        lambda k: k.update(masses=torch.ones(6, dtype=torch.float32)),
        "masses has dtype torch.float32, expected torch.float64",
    ),
    (
        "masses zero",
        lambda k: k.update(masses=torch.tensor([1.0, 1, 0, 1, 1, 1], dtype=torch.float64)),
        "masses must be positive; row 2",
    ),
    (
        "atomic number range",
        lambda k: k.update(atomic_numbers=torch.tensor([1, 2, 3, 200, 1, 1])),
        "atomic_numbers has 200",
    ),
    (
        "atomic numbers float",
        lambda k: k.update(atomic_numbers=torch.ones(6)),
        "atomic_numbers has dtype torch.float32",
    ),
    (
        "system index range",
        lambda k: k.update(system_index=torch.tensor([0, 1, 2, 0, 1, 0])),
        "system_index has 2, expected 0..1",
    ),
    (
        "ids duplicate",
        lambda k: k.update(atom_ids=torch.tensor([0, 1, 2, 3, 3, 5])),
        "id 3 appears more than once",
    ),
    (
        "ids negative",
        lambda k: k.update(atom_ids=torch.tensor([0, 1, 2, 3, -4, 5])),
        "atom_ids must be non-negative, found -4",
    ),
    (
        "ids dtype",
        lambda k: k.update(atom_ids=torch.arange(6, dtype=torch.int32)),
        "atom_ids has dtype torch.int32, expected torch.int64",
    ),
    (
        "cell shape",
        lambda k: k.update(cell=torch.zeros(2, 3, 2, dtype=torch.float64)),
        r"cell has shape \(2, 3, 2\)",
    ),
    (
        "cell singular on periodic axes",
        lambda k: k["cell"][1].__setitem__(1, k["cell"][1][0] * 2.0),
        r"cell of system 1 is singular on its periodic axes \[0, 1\]",
    ),
    (
        "cell nan",
        lambda k: k["cell"].__setitem__((0, 0, 0), float("nan")),
        "cell has non-finite values",
    ),
    ("pbc dtype", lambda k: k.update(pbc=torch.ones(2, 3, dtype=torch.int64)), "pbc must be bool"),
    (
        "pbc shape",
        lambda k: k.update(pbc=torch.ones(3, 3, dtype=torch.bool)),
        r"pbc has shape \(3, 3\), expected \(2, 3\)",
    ),
    (
        "energy shape",
        lambda k: k.update(energy=torch.zeros(3, dtype=torch.float64)),
        r"energy has shape \(3,\), expected \(2,\)",
    ),
    (
        "stress shape",
        lambda k: k.update(stress=torch.zeros(2, 3, dtype=torch.float64)),
        r"stress has shape \(2, 3\)",
    ),
    (
        "atom extra rows",
        lambda k: k.update(atom_extras={"q": torch.zeros(5)}),
        r"atom extra 'q' has shape \(5,\), expected first dimension 6",
    ),
    (
        "system extra rows",
        lambda k: k.update(system_extras={"t": torch.zeros(3)}),
        r"system extra 't' has shape \(3,\), expected first dimension 2",
    ),
    (
        "extra shadows core",
        lambda k: k.update(atom_extras={"masses": torch.zeros(6)}),
        "atom extra 'masses' shadows a core field",
    ),
]


def _kwargs() -> dict[str, Any]:
    b = make_batch()
    return {
        "positions": b.positions,
        "atomic_numbers": b.atomic_numbers,
        "cell": b.cell,
        "pbc": b.pbc,
        "masses": b.masses,
        "velocities": b.velocities,
        "forces": b.forces,
        "system_index": b.system_index,
        "atom_ids": b.atom_ids,
        "energy": b.energy,
        "stress": b.stress,
    }


@pytest.mark.parametrize(("case", "mutate", "message"), _BAD, ids=[c[0] for c in _BAD])
def test_validation_error_names_the_problem(
    case: str, mutate: Callable[[dict[str, Any]], None], message: str
) -> None:
    kwargs = _kwargs()
    mutate(kwargs)
    with pytest.raises(ValidationError, match=message) as info:
        Batch(**kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, NvddError)


def test_open_axes_may_have_a_zero_cell() -> None:
    kw = _kwargs()
    kw["cell"][:, 2] = 0.0  # axis 2 is open in make_batch
    b = Batch(**kw)  # validated (the default): no error
    assert not bool(b.pbc[:, 2].any()) and bool((b.cell[:, 2] == 0).all())


def test_validation_can_be_deferred() -> None:
    kw = _kwargs()
    kw["atom_ids"] = torch.zeros(6, dtype=torch.int64)
    b = Batch(**kw, validate=False)
    with pytest.raises(ValidationError, match="appears more than once"):
        b.validate()


def _rows_by_id(b: Batch) -> dict[int, tuple[Any, ...]]:
    f = b.atom_fields()
    out = {}
    for i, aid in enumerate(b.atom_ids.tolist()):
        out[aid] = tuple(v[i].tolist() for k, v in f.items() if k != "atom_ids")
    return out


def test_reorder_select_and_sort_keep_every_field_aligned_with_ids() -> None:
    b = make_batch(n=9, n_systems=3)
    before = _rows_by_id(b)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(3))
    r = b.reorder(perm)
    assert r.atom_ids.tolist() == b.atom_ids[perm].tolist()
    assert _rows_by_id(r) == before
    s = r.sort_by_id()
    assert s.atom_ids.tolist() == sorted(b.atom_ids.tolist())
    assert _rows_by_id(s) == before
    mask = b.atom_ids % 2 == 0
    sel = b.select(mask)
    assert set(_rows_by_id(sel)) == {i for i in before if i % 2 == 0}
    assert all(_rows_by_id(sel)[i] == before[i] for i in _rows_by_id(sel))
    assert torch.equal(sel.cell, b.cell) and sel.system_extras.keys() == b.system_extras.keys()


def test_reorder_rejects_a_non_permutation() -> None:
    b = make_batch()
    with pytest.raises(ValidationError, match="permutation of range"):
        b.reorder(torch.tensor([0, 0, 1, 2, 3, 4]))
    with pytest.raises(ValidationError, match="bool mask has shape"):
        b.select(torch.ones(5, dtype=torch.bool))


def test_concatenate_offsets_systems_and_checks_ids() -> None:
    a, b = make_batch(n=4, n_systems=2, seed=1), make_batch(n=6, n_systems=2, seed=2)
    b = b.replace(atom_ids=b.atom_ids + 1000)
    c = Batch.concatenate([a, b])
    assert c.n_atoms == 10 and c.n_systems == 4
    assert c.system_index[4:].tolist() == (b.system_index + 2).tolist()
    assert torch.equal(
        c.system_extras["temperature"], torch.tensor([0.0, 1, 0, 1], dtype=torch.float64)
    )
    assert torch.equal(c.atom_extras["charge"][4:], b.atom_extras["charge"])
    with pytest.raises(ValidationError, match="appears more than once"):
        Batch.concatenate([a, a])
    with pytest.raises(ValidationError, match=r"input 1 is torch\.float32"):
        Batch.concatenate([a, a.to(dtype=torch.float32)])


def test_merge_joins_atom_subsets_of_the_same_systems() -> None:
    b = make_batch(n=8)
    parts = [b.select(b.atom_ids % 2 == k) for k in (0, 1)]
    m = Batch.merge(parts).sort_by_id()
    assert _rows_by_id(m) == _rows_by_id(b)
    with pytest.raises(ValidationError, match="input 1 has 3 systems"):
        Batch.merge([b, make_batch(n=6, n_systems=3).replace(atom_ids=torch.arange(100, 106))])


def test_to_clone_detach_replace() -> None:
    b = make_batch()
    f = b.to(dtype=torch.float32)
    assert f.positions.dtype == torch.float32 and f.atom_ids.dtype == torch.int64
    assert (
        f.atom_extras["charge"].dtype == torch.float32 and f.atom_extras["tag"].dtype == torch.int64
    )
    c = b.clone()
    c.positions += 1.0
    assert not torch.equal(c.positions, b.positions)
    r = b.replace(
        charge=torch.zeros(6, dtype=torch.float64), energy=torch.ones(2, dtype=torch.float64)
    )
    assert (
        float(r.atom_extras["charge"].abs().sum()) == 0.0
        and float(b.atom_extras["charge"].abs().sum()) > 0
    )
    with pytest.raises(ValidationError, match="no field 'nope'"):
        b.replace(nope=1)
    with pytest.raises(ValidationError, match="must be floating point"):
        b.to(dtype=torch.int32)
    assert "n_atoms=6" in repr(b)
    # a dtype first, as torch.Tensor.to takes it: ids and species stay integers
    g = b.to(torch.float32)
    assert g.positions.dtype == torch.float32 and g.atom_ids.dtype == torch.int64
    assert g.atomic_numbers.dtype == torch.int64 and torch.equal(g.atom_ids, b.atom_ids)
    with pytest.raises(ValidationError, match="two dtypes"):
        b.to(torch.float32, torch.float64)
    with pytest.raises(ValidationError, match="must be floating point"):
        b.to(torch.int64)


def test_ase_round_trip_keeps_ids_and_fields() -> None:
    pytest.importorskip("ase")
    b = make_batch(n=7, n_systems=2)
    b = Batch(**{k: getattr(b, k) for k in _kwargs()})  # drop extras: ASE keeps core fields
    atoms = b.to_ase()
    assert len(atoms) == 2
    back = Batch.from_ase(atoms)
    bs, bb = b.sort_by_id(), back.sort_by_id()
    for name in (
        "positions",
        "velocities",
        "forces",
        "masses",
        "atomic_numbers",
        "atom_ids",
        "system_index",
    ):
        torch.testing.assert_close(getattr(bb, name), getattr(bs, name), rtol=0, atol=1e-12)
    for name in ("cell", "pbc", "energy"):
        torch.testing.assert_close(getattr(back, name), getattr(b, name), rtol=0, atol=1e-12)
    sym = 0.5 * (b.stress + b.stress.transpose(1, 2))  # ASE stores the symmetric (Voigt) part
    torch.testing.assert_close(back.stress, sym, rtol=0, atol=1e-12)


def test_to_ase_writes_per_atom_energies_to_extxyz(tmp_path: Any) -> None:
    pytest.importorskip("ase")
    from ase.io import read, write

    b = make_batch(n=7, n_systems=2)
    e_atom = torch.arange(7, dtype=torch.float64) * 0.25
    b = b.replace(atom_extras={**b.atom_extras, "atom_energies": e_atom})
    atoms = b.to_ase()
    write(tmp_path / "t.extxyz", atoms, format="extxyz")
    back = read(tmp_path / "t.extxyz", index=":")
    for s, a in enumerate(back):
        rows = (b.system_index == s).nonzero().flatten()
        assert a.get_potential_energies().tolist() == e_atom[rows].tolist()
    assert "energies" not in make_batch().to_ase()[0].calc.results  # only when kept


def test_from_ase_numbers_ids_consecutively_without_stored_ids() -> None:
    ase = pytest.importorskip("ase")
    a = ase.Atoms("Ar3", positions=[[0, 0, 0], [1, 0, 0], [2, 0, 0]], cell=[5, 5, 5], pbc=True)
    b = Batch.from_ase([a, a.copy()], dtype=torch.float32)
    assert b.atom_ids.tolist() == [0, 1, 2, 3, 4, 5]
    assert b.system_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert b.dtype == torch.float32
    with pytest.raises(ValidationError, match="empty sequence"):
        Batch.from_ase([])
