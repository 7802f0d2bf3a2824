"""Test systems, decompositions and the brute-force oracles of the halo tests.

Everything here is deterministic in its arguments, so the ranks (which rebuild
a case from its name) and the test process (which computes the oracle) agree.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

INF = math.inf


@dataclass(frozen=True)
class Case:
    """A global system (possibly several systems) and its decomposition."""

    name: str
    world: int
    positions: torch.Tensor  # (n, 3) float64
    atom_ids: torch.Tensor  # (n,)
    system_index: torch.Tensor  # (n,)
    cell: torch.Tensor  # (n_sys, 3, 3)
    pbc: torch.Tensor  # (n_sys, 3)
    boxes: torch.Tensor  # (n_sys, world, 2, 3)
    ghost_width: float


def grid_boxes(cuts: list[list[float]], pbc: list[bool]) -> torch.Tensor:
    """Boxes of a rank grid from per-axis cut lists (inner cuts only), rank order
    x-major. Open axes get -inf / +inf at their ends, periodic ones 0 / 1."""
    edges = []
    for a in range(3):
        lo, hi = (0.0, 1.0) if pbc[a] else (-INF, INF)
        edges.append([lo, *cuts[a], hi])
    out = []
    for i, j, k in itertools.product(*(range(len(e) - 1) for e in edges)):
        out.append(
            [
                [edges[0][i], edges[1][j], edges[2][k]],
                [edges[0][i + 1], edges[1][j + 1], edges[2][k + 1]],
            ]
        )
    return torch.tensor(out, dtype=torch.float64)


def _cell(lengths: tuple[float, float, float], tilt: float) -> torch.Tensor:
    a, b, c = lengths
    return torch.tensor(
        [[a, 0.0, 0.0], [tilt * b, b, 0.0], [0.3 * tilt * c, -0.2 * tilt * c, c]],
        dtype=torch.float64,
    )


def _atoms(n: int, cell: torch.Tensor, pbc: list[bool], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    frac = torch.rand(n, 3, generator=g, dtype=torch.float64)
    for a in range(3):
        if not pbc[a]:
            frac[:, a] = frac[:, a] * 1.3 - 0.15  # open axes: atoms spill past the cell
    return frac @ cell


_SPECS: dict[str, dict[str, object]] = {
    # name: world, atoms, lengths, tilt, pbc, cuts, ghost_width
    "single_periodic": {
        "world": 1,
        "n": 40,
        "L": (7.0, 7.5, 8.0),
        "tilt": 0.0,
        "pbc": [1, 1, 1],
        "cuts": [[], [], []],
        "gw": 2.0,
    },
    "slab2_cubic": {
        "world": 2,
        "n": 60,
        "L": (9.0, 9.0, 9.0),
        "tilt": 0.0,
        "pbc": [1, 1, 1],
        "cuts": [[0.5], [], []],
        "gw": 2.2,
    },
    "slab3_uneven_triclinic": {
        "world": 3,
        "n": 70,
        "L": (10.0, 8.0, 7.0),
        "tilt": 0.25,
        "pbc": [1, 1, 1],
        "cuts": [[0.2, 0.65], [], []],
        "gw": 1.9,
    },
    "grid2x2_mixed": {
        "world": 4,
        "n": 80,
        "L": (9.0, 9.0, 8.0),
        "tilt": 0.15,
        "pbc": [1, 1, 0],
        "cuts": [[0.5], [0.4], []],
        "gw": 2.0,
    },
    "grid2x2x2_triclinic": {
        "world": 8,
        "n": 90,
        "L": (9.0, 9.5, 10.0),
        "tilt": 0.2,
        "pbc": [1, 1, 1],
        "cuts": [[0.5], [0.5], [0.45]],
        "gw": 2.1,
    },
    "multihop_slab4": {
        "world": 4,
        "n": 50,
        "L": (10.0, 6.0, 6.0),
        "tilt": 0.1,
        "pbc": [1, 1, 1],
        "cuts": [[0.25, 0.5, 0.75], [], []],
        "gw": 4.0,
    },
    "wider_than_cell": {
        "world": 2,
        "n": 12,
        "L": (4.0, 4.5, 5.0),
        "tilt": 0.2,
        "pbc": [1, 1, 1],
        "cuts": [[0.4], [], []],
        "gw": 5.5,
    },
    "open_all": {
        "world": 2,
        "n": 40,
        "L": (8.0, 8.0, 8.0),
        "tilt": 0.0,
        "pbc": [0, 0, 0],
        "cuts": [[0.3], [], []],
        "gw": 2.0,
    },
    "empty_rank": {  # rank 1's box starts past every atom: it owns nothing
        "world": 2,
        "n": 30,
        "L": (8.0, 8.0, 8.0),
        "tilt": 0.0,
        "pbc": [0, 1, 1],
        "cuts": [[1.2], [], []],
        "gw": 2.0,
    },
    "open_cut_outside_cell": {
        "world": 3,
        "n": 40,
        "L": (8.0, 8.0, 8.0),
        "tilt": 0.1,
        "pbc": [0, 1, 1],
        "cuts": [[-0.05, 1.02], [], []],
        "gw": 1.5,
    },
}


def make_case(name: str) -> Case:
    """Build a named case (see ``CASES``)."""
    if name == "two_systems":
        return _two_systems()
    if name == "bisection3":
        return _bisection()
    spec = _SPECS[name]
    pbc = [bool(p) for p in spec["pbc"]]  # type: ignore[attr-defined]
    cell = _cell(spec["L"], float(spec["tilt"]))  # type: ignore[arg-type]
    pos = _atoms(int(spec["n"]), cell, pbc, seed=len(name))  # type: ignore[call-overload]
    n = pos.shape[0]
    boxes = grid_boxes(spec["cuts"], pbc)[None]  # type: ignore[arg-type]
    return Case(
        name=name,
        world=int(spec["world"]),  # type: ignore[call-overload]
        positions=pos,
        atom_ids=torch.arange(n, dtype=torch.int64) * 3 + 7,
        system_index=torch.zeros(n, dtype=torch.int64),
        cell=cell[None],
        pbc=torch.tensor([pbc]),
        boxes=boxes,
        ghost_width=float(spec["gw"]),  # type: ignore[arg-type]
    )


def _bisection() -> Case:
    pbc = [True, True, True]
    cell = _cell((9.0, 8.0, 8.5), 0.1)
    pos = _atoms(60, cell, pbc, seed=11)
    boxes = torch.tensor(
        [
            [[0.0, 0.0, 0.0], [0.5, 1.0, 1.0]],
            [[0.5, 0.0, 0.0], [1.0, 0.4, 1.0]],
            [[0.5, 0.4, 0.0], [1.0, 1.0, 1.0]],
        ],
        dtype=torch.float64,
    )[None]
    n = pos.shape[0]
    return Case(
        "bisection3",
        3,
        pos,
        torch.arange(n, dtype=torch.int64),
        torch.zeros(n).long(),
        cell[None],
        torch.tensor([pbc]),
        boxes,
        1.8,
    )


def _two_systems() -> Case:
    pbc_a, pbc_b = [True, True, True], [True, False, True]
    cell_a, cell_b = _cell((8.0, 8.0, 8.0), 0.0), _cell((7.0, 9.0, 6.5), 0.2)
    pos_a, pos_b = _atoms(40, cell_a, pbc_a, seed=3), _atoms(35, cell_b, pbc_b, seed=4)
    boxes_a = grid_boxes([[0.5], [], []], pbc_a)
    boxes_b = grid_boxes([[], [0.55], []], pbc_b)
    n_a, n_b = pos_a.shape[0], pos_b.shape[0]
    return Case(
        name="two_systems",
        world=2,
        positions=torch.cat([pos_a, pos_b]),
        atom_ids=torch.randperm(n_a + n_b, generator=torch.Generator().manual_seed(5)) + 100,
        system_index=torch.cat([torch.zeros(n_a), torch.ones(n_b)]).long(),
        cell=torch.stack([cell_a, cell_b]),
        pbc=torch.tensor([pbc_a, pbc_b]),
        boxes=torch.stack([boxes_a, boxes_b]),
        ghost_width=1.7,
    )


CASES = [*_SPECS, "two_systems", "bisection3"]


def fractional(case: Case) -> torch.Tensor:
    """Fractional coordinates of every atom, shape (n, 3)."""
    inv = torch.linalg.inv(case.cell)
    return torch.bmm(case.positions.unsqueeze(1), inv[case.system_index]).squeeze(1)


def owners(case: Case) -> torch.Tensor:
    """Owner rank of every atom (the box holding its fractional position)."""
    f = fractional(case)
    lo = case.boxes[case.system_index, :, 0, :]  # (n, world, 3)
    hi = case.boxes[case.system_index, :, 1, :]
    inside = ((lo <= f[:, None, :]) & (f[:, None, :] < hi)).all(dim=2)
    if not bool((inside.sum(dim=1) == 1).all()):
        raise AssertionError(f"{case.name}: some atom has no unique owner box")
    return inside.long().argmax(dim=1)


def widths(case: Case) -> torch.Tensor:
    """Fractional ghost width per system and axis, (n_sys, 3)."""
    inv = torch.linalg.inv(case.cell)
    return case.ghost_width * torch.linalg.vector_norm(inv, dim=1)


def _image_grid(case: Case, s: int, reach: torch.Tensor) -> torch.Tensor:
    """Every image offset of system s within ``reach`` cells per periodic axis, (m, 3)."""
    ranges = [
        torch.arange(-int(reach[a]), int(reach[a]) + 1)
        if bool(case.pbc[s, a])
        else torch.zeros(1, dtype=torch.int64)
        for a in range(3)
    ]
    return torch.cartesian_prod(*ranges).reshape(-1, 3).long()


def expected_ghosts(case: Case, rank: int) -> list[tuple[int, int, int, int]]:
    """Brute force: every (atom id, n0, n1, n2) whose image lies in rank's
    expanded box, excluding rank's own atoms at n = 0. Sorted."""
    f, own, w = fractional(case), owners(case), widths(case)
    out: list[tuple[int, int, int, int]] = []
    for s in range(case.cell.shape[0]):
        rows = (case.system_index == s).nonzero().flatten()
        images = _image_grid(case, s, torch.ceil(w[s]) + 3)  # generous range
        lo = case.boxes[s, rank, 0] - w[s]
        hi = case.boxes[s, rank, 1] + w[s]
        g = f[rows][:, None, :] + images[None, :, :].double()
        inside = ((lo <= g) & (g < hi)).all(dim=2)
        self_row = (own[rows] == rank)[:, None] & (images == 0).all(dim=1)[None, :]
        i, m = (inside & ~self_row).nonzero(as_tuple=True)
        ids, img = case.atom_ids[rows][i], images[m]
        out += [
            (int(a), int(b), int(c), int(d))
            for a, (b, c, d) in zip(ids, img.tolist(), strict=False)
        ]
    return sorted(out)


def neighbour_keys(case: Case, rank: int) -> set[tuple[int, int, int, int]]:
    """Every (atom id, image) whose image lies within ghost_width (Cartesian) of
    an atom owned by ``rank``, except the rank's own atoms at n = 0."""
    own = owners(case)
    inv = torch.linalg.inv(case.cell)
    keys: set[tuple[int, int, int, int]] = set()
    for s in range(case.cell.shape[0]):
        rows = (case.system_index == s).nonzero().flatten()
        mine = rows[own[rows] == rank]
        reach = case.ghost_width * torch.linalg.vector_norm(inv[s], dim=0) + 2
        images = _image_grid(case, s, reach)
        img_pos = case.positions[rows][:, None, :] + (images.double() @ case.cell[s])[None]
        d = torch.cdist(case.positions[mine], img_pos.reshape(-1, 3)).reshape(
            len(mine), len(rows), len(images)
        )
        near = (d < case.ghost_width).any(dim=0)  # (rows, images)
        j, m = near.nonzero(as_tuple=True)
        for jj, mm in zip(j.tolist(), m.tolist(), strict=False):
            key = (int(case.atom_ids[rows[jj]]), *(int(v) for v in images[mm]))
            if key[1:] == (0, 0, 0) and int(own[rows[jj]]) == rank:
                continue
            keys.add(key)  # type: ignore[arg-type]
    return keys


def owned_slice(case: Case, rank: int) -> torch.Tensor:
    """Global row indices of rank's owned atoms, in their global order."""
    return (owners(case) == rank).nonzero().flatten()


def pair_energy_reference(
    positions: torch.Tensor, cell: torch.Tensor, case: Case, cutoff: float
) -> torch.Tensor:
    """0.5 * sum over (i, j, n) != (i, i, 0) of phi(|x_i - x_j - n cell|), every
    periodic image within the cutoff (the unsharded oracle of the autograd test)."""
    total = positions.new_zeros(())
    inv = torch.linalg.inv(case.cell)
    for s in range(case.cell.shape[0]):
        rows = (case.system_index == s).nonzero().flatten()
        x = positions[rows]
        kmax = [
            math.ceil(cutoff * float(torch.linalg.vector_norm(inv[s, :, a]))) + 1
            if bool(case.pbc[s, a])
            else 0
            for a in range(3)
        ]
        for n in itertools.product(*(range(-k, k + 1) for k in kmax)):
            shift = torch.tensor(n, dtype=positions.dtype) @ cell[s]
            d = x[:, None, :] - x[None, :, :] - shift
            if n == (0, 0, 0):
                d = d + torch.eye(len(rows), dtype=positions.dtype)[:, :, None] * 10 * cutoff
            total = total + 0.5 * phi(d, cutoff).sum()
    return total


def phi(d: torch.Tensor, cutoff: float) -> torch.Tensor:
    """A smooth pair term of displacement vectors ``d`` (..., 3), zero past cutoff."""
    r2 = (d * d).sum(dim=-1)
    x = (1.0 - r2 / cutoff**2).clamp(min=0.0)
    return x**3 * (1.0 + 0.3 * d[..., 0] / cutoff)


def as_single_rank(case: Case) -> Case:
    """The same systems decomposed over one rank (one box per system: the domain)."""
    lo = torch.where(case.pbc, 0.0, -INF).double()
    hi = torch.where(case.pbc, 1.0, INF).double()
    boxes = torch.stack([lo, hi], dim=1)[:, None]  # (n_sys, 1, 2, 3)
    return Case(**{**case.__dict__, "name": case.name + "_single", "world": 1, "boxes": boxes})
