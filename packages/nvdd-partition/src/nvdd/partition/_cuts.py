"""Nested cut tables: the boxes of one system's ``P0 x P1 x P2`` rank grid.

Axis 0 is cut into ``P0`` slabs; each slab ``i`` is cut along axis 1 into ``P1``
columns at its own positions; each column ``(i, j)`` is cut along axis 2 into
``P2`` boxes at its own positions. Uniform grids are the special case where every
slab (column) uses the same cuts. Rank ``(i * P1 + j) * P2 + k`` owns box
``(i, j, k)``. Bounds are fractional coordinates of the domain cell: ``[0, 1]`` on
periodic axes, ``(-inf, +inf)`` on open axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nvdd.core import ConfigurationError

__all__ = [
    "CutTable",
    "balanced_table",
    "explicit_table",
    "uniform_table",
]

Grid = tuple[int, int, int]


def _outer(periodic: bool) -> tuple[float, float]:
    return (0.0, 1.0) if periodic else (float("-inf"), float("inf"))


@dataclass(frozen=True)
class CutTable:
    """The nested cuts of one system (float64, CPU).

    Attributes
    ----------
    grid:
        ``(P0, P1, P2)``.
    c0:
        Shape ``(P0 + 1,)``: slab bounds along axis 0.
    c1:
        Shape ``(P0, P1 + 1)``: column bounds along axis 1, per slab.
    c2:
        Shape ``(P0, P1, P2 + 1)``: box bounds along axis 2, per column.
    """

    grid: Grid
    c0: torch.Tensor
    c1: torch.Tensor
    c2: torch.Tensor

    @property
    def n_boxes(self) -> int:
        """``P0 * P1 * P2``."""
        return self.grid[0] * self.grid[1] * self.grid[2]

    def boxes(self) -> torch.Tensor:
        """Every rank's box, float64 shape ``(n_boxes, 2, 3)`` (row 0 lo, row 1 hi)."""
        p0, p1, p2 = self.grid
        shape = (p0, p1, p2)
        lo = torch.stack(
            [
                self.c0[:-1].view(p0, 1, 1).expand(shape),
                self.c1[:, :-1].view(p0, p1, 1).expand(shape),
                self.c2[:, :, :-1],
            ],
            dim=-1,
        )
        hi = torch.stack(
            [
                self.c0[1:].view(p0, 1, 1).expand(shape),
                self.c1[:, 1:].view(p0, p1, 1).expand(shape),
                self.c2[:, :, 1:],
            ],
            dim=-1,
        )
        return torch.stack([lo.reshape(-1, 3), hi.reshape(-1, 3)], dim=1)

    def inner_cuts(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The internal cuts ``(c0, c1, c2)`` without the outer bounds, on ``device``
        (what :meth:`locate` searches; pass them to it to copy them once)."""
        return (
            self.c0[1:-1].to(device).contiguous(),
            self.c1[:, 1:-1].to(device).contiguous(),
            self.c2[:, :, 1:-1].to(device).contiguous(),
        )

    def locate(
        self, frac: torch.Tensor, inner: tuple[torch.Tensor, ...] | None = None
    ) -> torch.Tensor:
        """The rank whose box holds each point.

        Parameters
        ----------
        frac:
            float64, shape ``(n, 3)``, wrapped into ``[0, 1)`` on periodic axes.
        inner:
            :meth:`inner_cuts` on the device of ``frac`` (default: copied here).

        Returns
        -------
        torch.Tensor
            int64, shape ``(n,)``. A point on a cut belongs to the upper box.
        """
        _, p1, p2 = self.grid
        c0, c1, c2 = self.inner_cuts(frac.device) if inner is None else inner
        i = torch.searchsorted(c0, frac[:, 0].contiguous(), right=True)
        j = torch.zeros_like(i)
        k = torch.zeros_like(i)
        if p1 > 1:
            seq = c1[i].contiguous()
            j = torch.searchsorted(seq, frac[:, 1:2].contiguous(), right=True).squeeze(1)
        if p2 > 1:
            seq = c2[i, j].contiguous()
            k = torch.searchsorted(seq, frac[:, 2:3].contiguous(), right=True).squeeze(1)
        return (i * p1 + j) * p2 + k

    def check(self, periodic: Sequence[bool], system: int) -> None:
        """Raise ConfigurationError unless the boxes tile the system exactly.

        Every row of cuts must start and end at the outer bounds (``0``/``1`` on a
        periodic axis, ``-inf``/``+inf`` on an open one), have finite internal cuts
        and increase strictly (no gap, no overlap, no empty-width box).
        """
        rows = (
            (0, self.c0.reshape(1, -1)),
            (1, self.c1.reshape(-1, self.grid[1] + 1)),
            (2, self.c2.reshape(-1, self.grid[2] + 1)),
        )
        for axis, cuts in rows:
            lo, hi = _outer(bool(periodic[axis]))
            kind = "periodic" if periodic[axis] else "open"
            for row in cuts:
                inner = row[1:-1]
                ok = (
                    float(row[0]) == lo
                    and float(row[-1]) == hi
                    and bool(torch.isfinite(inner).all())
                    and bool((row[1:] > row[:-1]).all())
                )
                if not ok:
                    raise ConfigurationError(
                        f"system {system}: cuts {row.tolist()} along {kind} axis {axis} do not "
                        f"tile it: they must run from {lo} to {hi}, strictly increasing, with "
                        "finite internal cuts"
                    )


#: Sorted values closer than this (times ``max(1, |value|)``) share one quantile
#: position: no cut between them (:func:`_quantile_cuts`).
GAP_TOLERANCE = 1e-12


def _uniform_cuts(parts: int, lo: float, hi: float) -> torch.Tensor:
    """``parts - 1`` evenly spaced internal cuts of ``[lo, hi]``."""
    return lo + (hi - lo) * torch.arange(1, parts, dtype=torch.float64) / parts


def _quantile_cuts(values: torch.Tensor, parts: int, lo: float, hi: float) -> torch.Tensor:
    """``parts - 1`` internal cuts splitting ``values`` into equal counts.

    Each cut lies midway between two consecutive distinct sorted values, at the gap
    nearest to the ideal split index; with too few distinct values the cuts fall
    back to even spacing of ``[lo, hi]``. Values closer than :data:`GAP_TOLERANCE`
    (relative) count as one: the midpoint of two values a few ulps apart rounds
    onto one of them, and two such gaps in a row gave two equal cuts (an empty
    box, refused by the cut table; found by the randomized N-vs-1 search on a
    lattice gas whose wrapped fractions differed in the last bits).
    """
    if parts == 1:
        return torch.zeros(0, dtype=torch.float64)
    v = torch.sort(values.to(torch.float64)).values
    m = int(v.shape[0])
    scale = max(1.0, float(v.abs().max())) if m else 1.0
    gaps = torch.nonzero(v[1:] - v[:-1] > GAP_TOLERANCE * scale).flatten() + 1  # cut before v[g]
    if int(gaps.shape[0]) < parts - 1:
        return _uniform_cuts(parts, lo, hi)
    targets = (torch.arange(1, parts, dtype=torch.int64) * m + parts // 2) // parts
    pick = torch.argmin((gaps.view(1, -1) - targets.view(-1, 1)).abs(), dim=1)
    chosen = gaps[pick]
    if bool((chosen[1:] <= chosen[:-1]).any()):
        # Two targets share a gap (tied values): take distinct gaps in order.
        chosen = _distinct_gaps(gaps, targets)
    return (v[chosen - 1] + v[chosen]) / 2


def _distinct_gaps(gaps: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Strictly increasing gaps, one per target, each as near its target as allowed."""
    out: list[int] = []
    g = gaps.tolist()
    n_left = len(targets)
    pos = 0
    for t_idx, t in enumerate(targets.tolist()):
        remaining = n_left - t_idx - 1
        best = pos
        # Scan forward while moving closer to the target and leaving room for the rest.
        while best + 1 < len(g) - remaining and abs(g[best + 1] - t) <= abs(g[best] - t):
            best += 1
        out.append(g[best])
        pos = best + 1
    return torch.tensor(out, dtype=torch.int64)


def _with_outer(inner: torch.Tensor, periodic: bool) -> torch.Tensor:
    lo, hi = _outer(periodic)
    return torch.cat(
        [torch.tensor([lo], dtype=torch.float64), inner, torch.tensor([hi], dtype=torch.float64)]
    )


def uniform_table(grid: Grid, periodic: Sequence[bool], extent: torch.Tensor) -> CutTable:
    """Even cuts: ``[0, 1)`` on periodic axes, the atoms' ``extent`` on open axes.

    Parameters
    ----------
    extent:
        float64, shape ``(2, 3)``: fractional lo/hi of the atoms per axis (only the
        open axes are used).
    """
    cuts = []
    for a in range(3):
        lo, hi = (0.0, 1.0) if periodic[a] else (float(extent[0, a]), float(extent[1, a]))
        cuts.append(_with_outer(_uniform_cuts(grid[a], lo, hi), bool(periodic[a])))
    p0, p1, p2 = grid
    return CutTable(
        grid=grid,
        c0=cuts[0],
        c1=cuts[1].expand(p0, p1 + 1).clone(),
        c2=cuts[2].expand(p0, p1, p2 + 1).clone(),
    )


def balanced_table(
    grid: Grid, periodic: Sequence[bool], frac: torch.Tensor, extent: torch.Tensor
) -> CutTable:
    """Nested quantile cuts: every box gets the same number of atoms (within ties).

    Parameters
    ----------
    frac:
        float64, shape ``(n, 3)``: the system's atoms, wrapped on periodic axes.
    extent:
        float64, shape ``(2, 3)``: the fallback range on open axes (used for
        groups with too few distinct values).
    """
    p0, p1, p2 = grid
    frac = frac.detach().to("cpu", torch.float64)

    def cuts(values: torch.Tensor, parts: int, axis: int) -> torch.Tensor:
        lo, hi = (0.0, 1.0) if periodic[axis] else (float(extent[0, axis]), float(extent[1, axis]))
        return _with_outer(_quantile_cuts(values, parts, lo, hi), bool(periodic[axis]))

    c0 = cuts(frac[:, 0], p0, 0)
    slab = torch.searchsorted(c0[1:-1].contiguous(), frac[:, 0].contiguous(), right=True)
    c1 = torch.empty(p0, p1 + 1, dtype=torch.float64)
    c2 = torch.empty(p0, p1, p2 + 1, dtype=torch.float64)
    for i in range(p0):
        in_slab = frac[slab == i]
        c1[i] = cuts(in_slab[:, 1], p1, 1)
        col = torch.searchsorted(c1[i, 1:-1].contiguous(), in_slab[:, 1].contiguous(), right=True)
        for j in range(p1):
            c2[i, j] = cuts(in_slab[col == j][:, 2], p2, 2)
    return CutTable(grid=grid, c0=c0, c1=c1, c2=c2)


def explicit_table(
    cuts: Sequence[Sequence[float]], periodic: Sequence[bool], system: int
) -> CutTable:
    """A product grid from user-given internal cuts per axis (validated to tile)."""
    if len(cuts) != 3:
        raise ConfigurationError(f"cuts must give one sequence per axis (3), got {len(cuts)}")
    rows = [
        _with_outer(torch.tensor([float(c) for c in cuts[a]], dtype=torch.float64), periodic[a])
        for a in range(3)
    ]
    grid = (len(cuts[0]) + 1, len(cuts[1]) + 1, len(cuts[2]) + 1)
    table = CutTable(
        grid=grid,
        c0=rows[0],
        c1=rows[1].expand(grid[0], grid[1] + 1).clone(),
        c2=rows[2].expand(grid[0], grid[1], grid[2] + 1).clone(),
    )
    table.check(periodic, system)
    return table
