"""NeighborList and VerletList against an all-images brute force, as sets of (i, j, S)."""

from __future__ import annotations

import os
import types
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import vesin
from models_testutils import DEVICES, brute_edges, brute_edges_batch, edge_set, jittered_lattice

from nvdd.core import Batch, CapacityOverflowError, ConfigurationError, ValidationError
from nvdd.models import EdgeList, NeighborList, VerletList
from nvdd.models import _neighbors as neighbors_module

_TRICLINIC_SMALL = np.array([[2.1, 0.0, 0.0], [0.6, 2.3, 0.0], [-0.4, 0.5, 1.9]])
_CASES = {
    # name: (cell, pbc, n_atoms, cutoff, offset added to the positions)
    "cubic": (np.eye(3) * 7.0, [True, True, True], 40, 2.6, 0.0),
    "triclinic_smaller_than_cutoff": (_TRICLINIC_SMALL, [True, True, True], 5, 4.5, 0.0),
    "one_atom_self_images": (np.eye(3) * 1.7, [True, True, True], 1, 3.6, 0.0),
    "mixed_zero_open_vector": (
        np.array([[3.0, 0.4, 0.7], [0.2, 3.3, -0.5], [0.0, 0.0, 0.0]]),
        [True, True, False],
        18,
        3.1,
        0.0,
    ),
    "mixed_full_cell": (
        np.array([[4.0, 0.0, 0.0], [1.0, 4.5, 0.0], [0.5, 0.3, 3.0]]),
        [True, False, True],
        16,
        3.2,
        0.0,
    ),
    "open_zero_cell": (np.zeros((3, 3)), [False, False, False], 25, 2.5, 0.0),
    "open_atoms_outside_cell": (np.eye(3) * 2.0, [False, False, False], 25, 2.5, -7.3),
    "unwrapped_periodic": (_TRICLINIC_SMALL * 2.0, [True, True, True], 12, 3.3, 11.7),
}


def _positions(cell: np.ndarray, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    box = cell if abs(np.linalg.det(cell)) > 0 else np.eye(3) * 5.0
    return rng.uniform(0.0, 1.0, size=(n, 3)) @ box


def _batch(cell: np.ndarray, pbc: list[bool], pos: np.ndarray, dtype: torch.dtype) -> Batch:
    return Batch(
        torch.tensor(pos, dtype=dtype),
        torch.full((len(pos),), 18),
        cell=torch.tensor(cell, dtype=dtype),
        pbc=torch.tensor(pbc),
    )


def _search(nl: NeighborList | VerletList, b: Batch, **kw: object) -> EdgeList:
    return nl(b.positions, b.cell, b.pbc, b.system_index, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(_CASES))
def test_neighbor_list_equals_brute_force(case: str, device: str) -> None:
    cell, pbc, n, cutoff, offset = _CASES[case]
    pos = _positions(cell, n, seed=len(case)) + offset
    edges = _search(NeighborList(cutoff), _batch(cell, pbc, pos, torch.float64).to(device))
    assert edges.receivers.dtype == edges.senders.dtype == edges.shifts.dtype == torch.int64
    assert edges.shifts.shape == (edges.n_edges, 3)
    expected = brute_edges(pos, cell, pbc, cutoff)
    assert len(expected) > 0
    assert edge_set(edges) == expected


@pytest.mark.parametrize("case", ["triclinic_smaller_than_cutoff", "mixed_zero_open_vector"])
def test_edge_vectors_follow_the_shift_convention(case: str) -> None:
    cell, pbc, n, cutoff, offset = _CASES[case]
    pos = _positions(cell, n, seed=3) + offset
    b = _batch(cell, pbc, pos, torch.float64)
    edges = _search(NeighborList(cutoff), b)
    r = edges.vectors(b.positions, b.cell, b.system_index)
    x = torch.tensor(pos)
    expected = x[edges.senders] - x[edges.receivers] + edges.shifts.double() @ torch.tensor(cell)
    torch.testing.assert_close(r, expected, rtol=0, atol=1e-12)
    assert bool((r.norm(dim=1) < cutoff).all())
    assert int(edges.shifts[:, ~torch.tensor(pbc)].abs().sum()) == 0  # no shift on open axes


def _three_systems(dtype: torch.dtype = torch.float64, interleave: bool = False) -> Batch:
    cells = [np.eye(3) * 5.0, _TRICLINIC_SMALL, np.zeros((3, 3)), np.eye(3) * 3.0]
    pbcs = [[True, True, True], [True, True, True], [False, False, False], [True, False, True]]
    counts = [14, 4, 0, 9]  # system 2 has no atoms
    pos = np.concatenate(
        [_positions(c, n, seed=s) for s, (c, n) in enumerate(zip(cells, counts, strict=True))]
    )
    sys_idx = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    perm = torch.randperm(len(pos), generator=torch.Generator().manual_seed(5))
    if not interleave:
        perm = torch.arange(len(pos))
    return Batch(
        torch.tensor(pos, dtype=dtype)[perm],
        torch.full((len(pos),), 18),
        cell=torch.tensor(np.stack(cells), dtype=dtype),
        pbc=torch.tensor(pbcs),
        system_index=sys_idx[perm],
    )


@pytest.mark.parametrize("interleave", [False, True], ids=["sorted", "interleaved"])
def test_several_systems_in_one_batch(interleave: bool) -> None:
    b = _three_systems(interleave=interleave)
    edges = _search(NeighborList(3.4), b)
    got = edge_set(edges)
    assert got == brute_edges_batch(b, 3.4)
    si = b.system_index
    assert bool((si[edges.receivers] == si[edges.senders]).all())  # never across systems


def test_float32_positions_give_the_float64_edges() -> None:
    cell = np.eye(3) * 6.0
    pos = jittered_lattice([3, 3, 3], cell, 0.2, seed=1)  # no pair near the cutoff
    b64, b32 = (
        _batch(cell, [True] * 3, pos, torch.float64),
        _batch(cell, [True] * 3, pos, torch.float32),
    )
    nl = NeighborList(2.5)
    assert (
        edge_set(_search(nl, b32))
        == edge_set(_search(nl, b64))
        == brute_edges(pos, cell, [True] * 3, 2.5)
    )


@pytest.mark.parametrize("n_receivers", [0, 7, 40])
def test_receiver_filter_keeps_exactly_the_owned_receivers(n_receivers: int) -> None:
    cell, pbc, n, cutoff, _ = _CASES["cubic"]
    pos = _positions(cell, n, seed=2)
    edges = _search(
        NeighborList(cutoff), _batch(cell, pbc, pos, torch.float64), n_receivers=n_receivers
    )
    expected = {e for e in brute_edges(pos, cell, pbc, cutoff) if e[0] < n_receivers}
    assert edge_set(edges) == expected


def test_receiver_filter_splits_the_edges_between_ranks() -> None:
    """Owned rows first: the edges of a permuted layout, filtered, partition the full list."""
    cell, pbc, n, cutoff, _ = _CASES["cubic"]
    pos = _positions(cell, n, seed=4)
    nl, full = NeighborList(cutoff), brute_edges(pos, cell, pbc, cutoff)
    owned_a = list(range(0, n, 2))
    union: list[tuple[int, ...]] = []
    for owned in (owned_a, [i for i in range(n) if i not in owned_a]):
        order = owned + [i for i in range(n) if i not in owned]
        edges = _search(nl, _batch(cell, pbc, pos[order], torch.float64), n_receivers=len(owned))
        union += [(order[i], order[j], *s) for i, j, *s in edge_set(edges)]
    assert len(union) == len(full) and set(union) == full


def test_edge_list_select_and_empty() -> None:
    edges = EdgeList(
        torch.tensor([0, 1, 2]), torch.tensor([1, 2, 0]), torch.eye(3, dtype=torch.int64)
    )
    assert edge_set(edges.select(torch.tensor([True, False, True]))) == {
        (0, 1, 1, 0, 0),
        (2, 0, 0, 0, 1),
    }
    assert edge_set(edges.select(torch.tensor([1]))) == {(1, 2, 0, 1, 0)}
    empty = EdgeList.empty()
    assert empty.n_edges == 0 and not empty.periodic
    pos = torch.zeros(2, 3, dtype=torch.float64)
    assert empty.vectors(
        pos, torch.zeros(1, 3, 3, dtype=torch.float64), torch.zeros(2, dtype=torch.int64)
    ).shape == (0, 3)


def test_no_atoms_and_isolated_atoms() -> None:
    nl = NeighborList(1.0)
    cell, pbc = torch.zeros(1, 3, 3, dtype=torch.float64), torch.zeros(1, 3, dtype=torch.bool)
    none = nl(torch.zeros(0, 3, dtype=torch.float64), cell, pbc, torch.zeros(0, dtype=torch.int64))
    assert none.n_edges == 0
    far = torch.tensor([[0.0, 0, 0], [5.0, 0, 0]], dtype=torch.float64)
    assert nl(far, cell, pbc, torch.zeros(2, dtype=torch.int64)).n_edges == 0


_BAD_INPUTS = [
    ("positions", lambda p, c, b, s: (p[:, :2], c, b, s), r"positions has shape \(4, 2\)"),
    ("cell dtype", lambda p, c, b, s: (p, c.float(), b, s), "cell is torch.float32"),
    ("cell shape", lambda p, c, b, s: (p, c[0], b, s), r"cell has shape \(3, 3\)"),
    ("pbc dtype", lambda p, c, b, s: (p, c, b.int(), s), "pbc must be bool"),
    ("system_index shape", lambda p, c, b, s: (p, c, b, s[:3]), r"system_index has shape \(3,\)"),
    (
        "system_index range",
        lambda p, c, b, s: (p, c, b, s + 1),
        "system_index has 1, expected 0..0",
    ),
]


@pytest.mark.parametrize(("what", "mutate", "match"), _BAD_INPUTS, ids=[b[0] for b in _BAD_INPUTS])
def test_bad_inputs_raise_validation_errors_naming_the_field(what: str, mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    p = torch.rand(4, 3, dtype=torch.float64)
    c, b, s = (
        torch.eye(3, dtype=torch.float64)[None] * 3,
        torch.ones(1, 3, dtype=torch.bool),
        torch.zeros(4, dtype=torch.int64),
    )
    for nl in (NeighborList(1.0), VerletList(1.0, 0.5)):
        with pytest.raises(ValidationError, match=match) as info:
            nl(*mutate(p, c, b, s))
        assert "rank 0" in str(info.value)
    with pytest.raises(ValidationError, match="n_receivers is 5"):
        NeighborList(1.0)(p, c, b, s, n_receivers=5)


@pytest.mark.parametrize(
    ("cutoff", "skin"), [(0.0, 0.0), (-1.0, 0.0), (float("nan"), 0.0), (1.0, -0.1)]
)
def test_bad_cutoff_or_skin_is_a_configuration_error(cutoff: float, skin: float) -> None:
    with pytest.raises(ConfigurationError):
        VerletList(cutoff, skin)


# ------------------------------------------------------------------ Verlet list
def _verlet_setup() -> tuple[Batch, float, float]:
    cell = _TRICLINIC_SMALL * 2.5
    pos = jittered_lattice([3, 3, 3], cell, 0.3, seed=7)
    return _batch(cell, [True, True, False], pos, torch.float64), 2.6, 0.6


def _moved(b: Batch, delta: torch.Tensor) -> Batch:
    return b.replace(positions=b.positions + delta)


def test_verlet_reuses_below_half_skin_and_stays_exact() -> None:
    b, cutoff, skin = _verlet_setup()
    vl, fresh = VerletList(cutoff, skin), NeighborList(cutoff)
    _search(vl, b)
    assert vl.n_builds == 1 and vl.rebuilt
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):  # every atom moves, each strictly less than skin / 2 from the build
        direction = torch.randn(b.n_atoms, 3, generator=gen, dtype=torch.float64)
        direction = direction / direction.norm(dim=1, keepdim=True)
        length = 0.98 * (skin / 2) * torch.rand(b.n_atoms, 1, generator=gen, dtype=torch.float64)
        moved = _moved(b, direction * length)
        got = _search(vl, moved)
        assert not vl.rebuilt
        assert edge_set(got) == edge_set(_search(fresh, moved)) == brute_edges_batch(moved, cutoff)
        # filtered=False: the build's candidate list itself (cutoff + skin), unfiltered
        assert _search(vl, moved, filtered=False) is vl.candidates and not vl.rebuilt
        assert edge_set(got) < brute_edges_batch(b, cutoff + skin) <= edge_set(vl.candidates)
    assert vl.n_builds == 1


def test_verlet_rebuilds_when_one_atom_moves_past_half_skin() -> None:
    b, cutoff, skin = _verlet_setup()
    vl = VerletList(cutoff, skin)
    _search(vl, b)
    delta = torch.zeros(b.n_atoms, 3, dtype=torch.float64)
    delta[5, 1] = 0.49 * skin
    _search(vl, _moved(b, delta))
    assert not vl.rebuilt and vl.n_builds == 1
    delta[5, 1] = 0.51 * skin  # still measured from the build positions
    moved = _moved(b, delta)
    got = _search(vl, moved)
    assert vl.rebuilt and vl.n_builds == 2
    assert edge_set(got) == brute_edges_batch(moved, cutoff)


def test_verlet_rebuilds_on_layout_changes() -> None:
    b, cutoff, skin = _verlet_setup()
    vl = VerletList(cutoff, skin)
    ids = b.atom_ids
    _search(vl, b, atom_ids=ids)
    changes = {
        "cell": {"cell": b.cell * 0.8},  # a strain that eats the whole skin
        "pbc": {"pbc": torch.ones(1, 3, dtype=torch.bool)},
        "rows": {"positions": b.positions[:-1], "system_index": b.system_index[:-1]},
    }
    for name, change in changes.items():
        vl.reset()
        _search(vl, b)
        _search(vl, b)
        assert not vl.rebuilt, name  # the control: nothing changed
        builds = vl.n_builds
        kw = {
            "positions": b.positions,
            "cell": b.cell,
            "pbc": b.pbc,
            "system_index": b.system_index,
            **change,
        }
        vl(kw["positions"], kw["cell"], kw["pbc"], kw["system_index"])
        assert vl.rebuilt and vl.n_builds == builds + 1, name
    _search(vl, b, atom_ids=ids)
    _search(vl, b, atom_ids=ids.flip(0))
    assert vl.rebuilt, "new atom ids"
    _search(vl, b, atom_ids=ids.flip(0), n_receivers=10)
    assert vl.rebuilt, "new receiver bound"
    _search(vl, b.to(dtype=torch.float32), atom_ids=ids.flip(0), n_receivers=10)
    assert vl.rebuilt, "new dtype"
    _search(vl, b.to(dtype=torch.float32), atom_ids=ids.flip(0), n_receivers=10)
    assert not vl.rebuilt


@pytest.mark.parametrize("name", ["cell", "pbc", "atom_ids", "same values"])
def test_verlet_sees_in_place_changes_of_the_builds_own_tensors(name: str) -> None:
    """The reuse test skips comparing a tensor that is the build's own, unmodified
    (a host read each on a GPU); a change in place bumps its version and counts."""
    b, cutoff, skin = _verlet_setup()
    b = b.replace(atom_ids=b.atom_ids.clone())
    vl = VerletList(cutoff, skin)
    _search(vl, b, atom_ids=b.atom_ids)
    _search(vl, b, atom_ids=b.atom_ids)
    assert not vl.rebuilt  # the same tensors: reused
    if name == "cell":
        b.cell.mul_(0.8)  # a strain that eats the whole skin
    elif name == "pbc":
        b.pbc.fill_(True)
    elif name == "atom_ids":
        b.atom_ids.copy_(b.atom_ids.flip(0))
    else:  # a new version with the same values: compared, and still reused
        b.system_index.add_(0)
        b.cell.mul_(1.0)
    got = _search(vl, b, atom_ids=b.atom_ids)
    assert vl.rebuilt == (name != "same values"), name
    assert edge_set(got) == brute_edges_batch(b, cutoff)


def test_verlet_with_zero_skin_rebuilds_on_any_move_only() -> None:
    b, cutoff, _ = _verlet_setup()
    vl = VerletList(cutoff, 0.0)
    _search(vl, b)
    _search(vl, b.clone())
    assert not vl.rebuilt
    delta = torch.zeros(b.n_atoms, 3, dtype=torch.float64)
    delta[0, 0] = 1e-9
    _search(vl, _moved(b, delta))
    assert vl.rebuilt and vl.n_builds == 2


def test_verlet_random_walk_matches_fresh_searches() -> None:
    """Many small steps: fewer builds than steps, and every call exact."""
    b, cutoff, skin = _verlet_setup()
    vl, fresh = VerletList(cutoff, skin), NeighborList(cutoff)
    gen = torch.Generator().manual_seed(11)
    pos = b.positions.clone()
    for _ in range(12):
        pos = pos + 0.07 * torch.randn(pos.shape, generator=gen, dtype=torch.float64)
        moved = b.replace(positions=pos)
        assert edge_set(_search(vl, moved, n_receivers=20)) == edge_set(
            _search(fresh, moved, n_receivers=20)
        )
    assert 1 < vl.n_builds < 12


def test_verlet_follows_a_barostat_without_rebuilding_and_stays_exact() -> None:
    """Positions scaled with a changing cell (what NPT does) are not displacements:
    the list is reused, and every call equals a fresh search at the new cell."""
    b, cutoff, skin = _verlet_setup()
    vl, fresh = VerletList(cutoff, skin), NeighborList(cutoff)
    _search(vl, b)
    gen = torch.Generator().manual_seed(5)
    pos, cell = b.positions.clone(), b.cell.clone()
    for _ in range(6):
        grad = torch.eye(3, dtype=torch.float64) + 0.004 * torch.randn(
            3, 3, generator=gen, dtype=torch.float64
        )
        pos = pos @ grad + 0.01 * torch.randn(pos.shape, generator=gen, dtype=torch.float64)
        cell = cell @ grad
        moved = b.replace(positions=pos, cell=cell)
        got = _search(vl, moved)
        assert not vl.rebuilt
        assert edge_set(got) == edge_set(_search(fresh, moved)) == brute_edges_batch(moved, cutoff)
    assert vl.n_builds == 1


def test_verlet_rebuilds_when_the_strain_eats_the_skin() -> None:
    """A shear that moves periodic images by more than the skin allows (atoms left
    in place: a plain displacement test would see nothing) forces a rebuild."""
    b, cutoff, skin = _verlet_setup()
    vl = VerletList(cutoff, skin)
    _search(vl, b)
    shear = torch.eye(3, dtype=torch.float64)
    shear[1, 0] = 0.05
    _search(vl, b.replace(cell=b.cell.clone()))
    assert not vl.rebuilt  # the control: an equal cell
    sheared = b.replace(cell=b.cell @ shear)
    got = _search(vl, sheared)
    assert vl.rebuilt and vl.n_builds == 2
    assert edge_set(got) == brute_edges_batch(sheared, cutoff)


# ------------------------------------------- vesin's CUDA buffer (emulated here)
class _CudaLikeVesin:
    """vesin's CPU search behind the CUDA contract: a buffer of
    ``VESIN_CUDA_MAX_PAIRS_PER_POINT`` pairs per atom, sized at first use, and an
    overflow error instead of truncation."""

    made: ClassVar[list[int]] = []

    def __init__(self, *, cutoff: float, full_list: bool) -> None:
        self._real = vesin.NeighborList(cutoff=cutoff, full_list=full_list)
        self._per_point: int | None = None

    def compute(
        self, points: torch.Tensor, box: torch.Tensor, periodic: torch.Tensor, quantities: str
    ) -> Any:
        if self._per_point is None:
            self._per_point = int(os.environ["VESIN_CUDA_MAX_PAIRS_PER_POINT"])
            self.made.append(self._per_point)
        pairs, shifts = self._real.compute(points, box, periodic, quantities)
        if len(pairs) > self._per_point * len(points):
            raise RuntimeError(
                f"The number of neighbor pairs exceeds the maximum capacity of "
                f"{self._per_point * len(points)}"
            )
        return pairs, shifts


def test_cuda_buffer_grows_on_overflow_and_never_truncates(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.SimpleNamespace(NeighborList=_CudaLikeVesin)
    monkeypatch.setattr(neighbors_module, "vesin", fake)
    monkeypatch.delenv("VESIN_CUDA_MAX_PAIRS_PER_POINT", raising=False)
    _CudaLikeVesin.made.clear()
    cell, pbc, n, cutoff, _ = _CASES["triclinic_smaller_than_cutoff"]
    pos = _positions(cell, n, seed=9)
    nl = NeighborList(cutoff)
    args = (torch.tensor(pos), torch.tensor(cell), torch.tensor(pbc))
    pairs, shifts = nl._search_cuda(*args, estimate=8)
    got = {(int(i), int(j), *map(int, s)) for (i, j), s in zip(pairs, shifts, strict=True)}
    assert got == brute_edges(pos, cell, pbc, cutoff)
    assert _CudaLikeVesin.made[0] == 128 and _CudaLikeVesin.made[-1] > len(got) / n
    assert "VESIN_CUDA_MAX_PAIRS_PER_POINT" not in os.environ  # restored
    made = len(_CudaLikeVesin.made)
    nl._search_cuda(*args, estimate=8)
    assert len(_CudaLikeVesin.made) == made  # the size that worked is reused

    class Hopeless(_CudaLikeVesin):
        def compute(self, *a: Any, **k: Any) -> Any:
            raise RuntimeError("The number of neighbor pairs exceeds the maximum capacity of 1")

    monkeypatch.setattr(fake, "NeighborList", Hopeless)
    with pytest.raises(CapacityOverflowError, match="pairs per atom on CUDA"):
        NeighborList(cutoff)._search_cuda(*args, estimate=8)


def test_cuda_buffer_estimate_follows_the_density() -> None:
    estimate = neighbors_module._pairs_per_point
    assert estimate(1000, 1000.0, [True] * 3, 5.0) == int(1.5 * 4 / 3 * np.pi * 125) + 16
    assert estimate(10, 1000.0, [True] * 3, 1.0) == 128  # never below vesin's default
    assert estimate(1000, 1.0, [True, False, True], 5.0) == 128  # open axis: grow on demand
