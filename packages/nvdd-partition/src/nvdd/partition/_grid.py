"""Choosing the rank grid ``P0 x P1 x P2`` of one system.

Two cost models, both in the units of "rows a rank computes on" (owned + ghost):

- **with positions**: every atom owned by a box counts ``prod_a (1 + b_a)`` rows,
  where ``b_a`` (0, 1 or 2) is the number of its box's finite faces along axis
  ``a`` that lie within the ghost width (the atom is sent across each of them, and
  across their edges and corners). The score is the mean per-rank sum plus the
  excess of the largest one over ``mean + 3 sqrt(mean)``: a rank the step waits
  for counts, but random fluctuations of a few atoms (which the next steps
  reshuffle) do not decide between grids.
- **without positions** (uniform density): the padded volume of the grid,
  ``prod_a (L_a + E_a)`` with ``L_a`` the extent along axis ``a`` (interplanar
  spacing of a periodic axis, the atoms' extent on an open one) and ``E_a = 2 g P_a``
  on a periodic axis (explicit images make even an uncut periodic axis grow a
  halo) or ``2 g (P_a - 1)`` on an open one.

Grids whose boxes are thinner than the ghost width along a cut axis lose against
any grid that avoids it (they need multi-hop halos). Exact ties go to the grid
that cuts fewer open axes, then to the one that cuts earlier axes more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nvdd.core import ConfigurationError
from nvdd.partition._cuts import CutTable

__all__ = [
    "GridCost",
    "choose_grid",
    "factor_triples",
    "positions_cost",
    "volume_cost",
]

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class GridCost:
    """The cost of one candidate grid (lower is better, compared in field order)."""

    thin: bool
    score: float
    total_rows: float


def factor_triples(n: int) -> list[Grid]:
    """Every ordered ``(P0, P1, P2)`` of positive integers with product ``n``."""
    out: list[Grid] = []
    for p0 in range(1, n + 1):
        if n % p0:
            continue
        rest = n // p0
        for p1 in range(1, rest + 1):
            if rest % p1 == 0:
                out.append((p0, p1, rest // p1))
    return out


def _round(x: float) -> float:
    return float(f"{x:.9g}")


def choose_grid(
    world_size: int,
    periodic: Sequence[bool],
    cuttable: Sequence[bool],
    cost: Callable[[Grid], GridCost],
    system: int,
) -> Grid:
    """The cheapest grid among those that only cut ``cuttable`` axes.

    Raises
    ------
    ConfigurationError
        If no grid with product ``world_size`` avoids the uncuttable axes.
    """
    best: tuple[tuple[object, ...], Grid] | None = None
    for grid in factor_triples(world_size):
        if any(grid[a] > 1 and not cuttable[a] for a in range(3)):
            continue
        c = cost(grid)
        n_open_cut = sum(1 for a in range(3) if grid[a] > 1 and not periodic[a])
        key = (
            c.thin,
            _round(c.score),
            _round(c.total_rows),
            n_open_cut,
            tuple(-g for g in grid),
        )
        if best is None or key < best[0]:
            best = (key, grid)
    if best is None:
        blocked = [a for a in range(3) if not cuttable[a]]
        raise ConfigurationError(
            f"system {system}: cannot split {world_size} ranks without cutting open axes "
            f"{blocked}, whose extent is unknown (no cell vector): pass positions"
        )
    return best[1]


def volume_cost(
    grid: Grid, lengths: Sequence[float], periodic: Sequence[bool], g: float
) -> GridCost:
    """Uniform-density cost: padded volume (total and per rank)."""
    total = 1.0
    thin = False
    for a in range(3):
        p = grid[a]
        halo = 2.0 * g * (p if periodic[a] else p - 1)
        total *= lengths[a] + halo
        thin = thin or (p > 1 and lengths[a] / p < g)
    n = grid[0] * grid[1] * grid[2]
    return GridCost(thin=thin, score=total / n, total_rows=total)


def positions_cost(
    table: CutTable, frac: torch.Tensor, spacings: torch.Tensor, g: float
) -> GridCost:
    """Cost of ``table`` for these atoms (see the module docstring).

    Parameters
    ----------
    frac:
        float64, shape ``(n, 3)``, wrapped on periodic axes.
    spacings:
        float64, shape ``(3,)``: interplanar spacings of the domain cell.
    """
    w = g / spacings.to(torch.float64)
    boxes = table.boxes()
    lo, hi = boxes[:, 0], boxes[:, 1]
    rank = table.locate(frac)
    own_lo, own_hi = lo[rank], hi[rank]
    b = ((frac - own_lo < w) & torch.isfinite(own_lo)).to(torch.int64) + (
        (own_hi - frac <= w) & torch.isfinite(own_hi)
    ).to(torch.int64)
    rows = torch.prod(1 + b, dim=1).to(torch.float64)
    per_rank = torch.bincount(rank, weights=rows, minlength=table.n_boxes)
    width = (hi - lo) * spacings.view(1, 3)
    thin = False
    for a in range(3):
        if table.grid[a] > 1:
            finite = torch.isfinite(width[:, a])
            thin = thin or bool((width[:, a][finite] < g).any())
    mean = float(rows.sum()) / table.n_boxes
    excess = max(0.0, float(per_rank.max()) - mean - 3.0 * math.sqrt(mean))
    return GridCost(thin=thin, score=mean + excess, total_rows=float(rows.sum()))
