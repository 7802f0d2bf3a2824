"""Ghost selection at the edges, against an exact (rational) oracle.

Positions are placed exactly on faces and cuts, and at the ghost width from
them (to the last unit in the last place, on both sides). The oracle decides in
exact rational arithmetic which periodic images lie within the closed ghost
width of each box; the selection must contain every one of them (a dropped ghost
is a lost pair: issue 17, skin 0), and may add only images within the rounding
margin of the ghost width.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch

from nvdd.halo import ParticleHaloConfig
from nvdd.halo._select import SelectBackend, rounding_margin, select_ghosts

_CELLS = {
    "cubic": [[21.04, 0.0, 0.0], [0.0, 21.04, 0.0], [0.0, 0.0, 21.04]],
    "triclinic": [[19.7, 0.0, 0.0], [4.3, 18.9, 0.0], [-3.1, 2.7, 20.3]],
}
_GHOST_WIDTHS = (8.5, 3.3)  # skin 0: the ghost width is the cutoff


def _near(x: float, k: int) -> list[float]:
    """x and its k neighbours in float64 on each side."""
    out, lo, hi = [x], x, x
    for _ in range(k):
        lo, hi = math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)
        out += [lo, hi]
    return out


def _inverse(m: list[list[Fraction]]) -> list[list[Fraction]]:
    a, b, c = m
    det = (
        a[0] * (b[1] * c[2] - b[2] * c[1])
        - a[1] * (b[0] * c[2] - b[2] * c[0])
        + a[2] * (b[0] * c[1] - b[1] * c[0])
    )
    cof = [
        [
            (
                m[(j + 1) % 3][(i + 1) % 3] * m[(j + 2) % 3][(i + 2) % 3]
                - m[(j + 1) % 3][(i + 2) % 3] * m[(j + 2) % 3][(i + 1) % 3]
            )
            for j in range(3)
        ]
        for i in range(3)
    ]
    return [[cof[i][j] / det for j in range(3)] for i in range(3)]


def _system(kind: str, gw: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (as given, in ``dtype``) at faces, cuts and ghost-width edges."""
    cell = torch.tensor(_CELLS[kind], dtype=torch.float64)
    spacing = 1.0 / torch.linalg.vector_norm(torch.linalg.inv(cell), dim=0)
    w = float(gw / spacing[0])
    # fractional x: faces 0 and 1, the cut 1/2, and the ghost-width edges of both boxes
    fx = []
    for edge in (0.0, 0.5, 1.0, 0.5 - w, 0.5 + w, 1.0 - w, w, -w + 1.0, 1.0 + w - 1.0):
        fx += _near(edge, 2)
    frac = torch.tensor([[x, 0.31, 0.62] for x in fx], dtype=torch.float64)
    pos = (frac @ cell).to(dtype)
    return pos, cell.to(dtype)


def _oracle(
    pos: torch.Tensor, cell: torch.Tensor, boxes: torch.Tensor, gw: float, rank: int, slack: float
) -> set[tuple[int, int, int, int, int]]:
    """Every (destination, atom, image) within the closed ghost width (+ ``slack`` of
    it, fractional), computed exactly from the float values the kernels read."""
    c = [[Fraction(float(v)) for v in row] for row in cell.double().tolist()]
    inv = _inverse(c)
    widths = [
        Fraction(gw) * Fraction(math.sqrt(sum(float(inv[r][a]) ** 2 for r in range(3))))
        for a in range(3)
    ]
    out = set()
    for i, p in enumerate(pos.double().tolist()):
        f = [sum(Fraction(p[r]) * inv[r][a] for r in range(3)) for a in range(3)]
        for d in range(boxes.shape[0]):
            lo = [
                Fraction(float(v)) - widths[a] * (1 + Fraction(slack))
                for a, v in enumerate(boxes[d, 0].tolist())
            ]
            hi = [
                Fraction(float(v)) + widths[a] * (1 + Fraction(slack))
                for a, v in enumerate(boxes[d, 1].tolist())
            ]
            ranges = [
                range(math.ceil(lo[a] - f[a]), math.floor(hi[a] - f[a]) + 1) for a in range(3)
            ]
            for n in itertools.product(*ranges):
                if d == rank and n == (0, 0, 0):
                    continue
                out.add((d, i, *n))
    return out


@pytest.mark.parametrize("backend", [SelectBackend.WARP, SelectBackend.TORCH])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", sorted(_CELLS))
@pytest.mark.parametrize("gw", _GHOST_WIDTHS)
def test_every_image_within_the_ghost_width_is_selected(
    kind: str, gw: float, dtype: torch.dtype, backend: SelectBackend
) -> None:
    pos, cell = _system(kind, gw, dtype)
    boxes = torch.tensor(
        [[[0.0, 0.0, 0.0], [0.5, 1.0, 1.0]], [[0.5, 0.0, 0.0], [1.0, 1.0, 1.0]]],
        dtype=torch.float64,
    )
    config = ParticleHaloConfig(
        boxes=boxes[None], pbc=torch.ones(1, 3, dtype=torch.bool), ghost_width=gw
    )
    n = pos.shape[0]
    ids = torch.arange(n, dtype=torch.int64)
    system = torch.zeros(n, dtype=torch.int64)
    for rank in (0, 1):
        selection, _, message = select_ghosts(config, pos, ids, system, cell[None], rank, backend)
        assert selection is not None, message
        meta = selection.meta
        dest = torch.repeat_interleave(torch.arange(2), selection.send_counts)
        got = {
            (int(d), int(m[0]), int(m[1]), int(m[2]), int(m[3]))
            for d, m in zip(dest, meta, strict=True)
        }
        need = _oracle(pos, cell, boxes, gw, rank, 0.0)
        missing = need - got
        assert not missing, (
            f"rank {rank}: ghosts within the ghost width dropped: {sorted(missing)[:5]}"
        )
        margin = (
            rounding_margin(dtype, 1.5) * 4
        )  # generous: the kernel's margin is relative to |frac|
        allowed = _oracle(pos, cell, boxes, gw, rank, margin / 0.1)
        extra = got - allowed
        assert not extra, f"rank {rank}: ghosts beyond the margin: {sorted(extra)[:5]}"


@pytest.mark.parametrize("backend", [SelectBackend.WARP, SelectBackend.TORCH])
@pytest.mark.parametrize("kind", sorted(_CELLS))
def test_wrapped_axes_get_no_image_rows_and_lose_no_ghost(
    kind: str, backend: SelectBackend
) -> None:
    """``wrapped`` y and z (a 2x1x1 grid leaves them whole; the model applies
    their periodicity): exactly the oracle's ghosts with their y and z images
    folded onto image 0 (one row per atom and x image), none of them the owned
    row; fewer rows than with explicit images on every axis."""
    gw = _GHOST_WIDTHS[0]
    pos, cell = _system(kind, gw, torch.float64)
    boxes = torch.tensor(
        [[[0.0, 0.0, 0.0], [0.5, 1.0, 1.0]], [[0.5, 0.0, 0.0], [1.0, 1.0, 1.0]]],
        dtype=torch.float64,
    )
    pbc = torch.ones(1, 3, dtype=torch.bool)
    wrapped = torch.tensor([[False, True, True]])
    config = ParticleHaloConfig(boxes=boxes[None], pbc=pbc, ghost_width=gw, wrapped=wrapped)
    explicit = ParticleHaloConfig(boxes=boxes[None], pbc=pbc, ghost_width=gw)
    n = pos.shape[0]
    ids = torch.arange(n, dtype=torch.int64)
    system = torch.zeros(n, dtype=torch.int64)
    for rank in (0, 1):
        selection, _, message = select_ghosts(config, pos, ids, system, cell[None], rank, backend)
        assert selection is not None, message
        assert not bool(selection.meta[:, 2:4].any()), "an image along a wrapped axis"
        dest = torch.repeat_interleave(torch.arange(2), selection.send_counts)
        rows = [(int(d), int(m[0]), int(m[1])) for d, m in zip(dest, selection.meta, strict=True)]
        assert len(rows) == len(set(rows)), "one row per (destination, atom, x image)"
        need = {(d, i, n0) for d, i, n0, _, _ in _oracle(pos, cell, boxes, gw, rank, 0.0)}
        need = {k for k in need if not (k[0] == rank and k[2] == 0)}  # the owned rows
        allowed = {
            (d, i, n0)
            for d, i, n0, _, _ in _oracle(pos, cell, boxes, gw, rank, 4 * rounding_margin(
                torch.float64, 1.5) / 0.1)
        }  # fmt: skip
        assert need <= set(rows) <= allowed
        full, _, _ = select_ghosts(explicit, pos, ids, system, cell[None], rank, backend)
        assert full is not None and 0 < len(rows) < int(full.send_counts.sum())
