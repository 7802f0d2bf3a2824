"""Construction helpers of `SpatialPartitioner`: argument checks, extents, grids, cuts."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import torch

from nvdd.core import ConfigurationError, ValidationError
from nvdd.partition._cuts import CutTable, balanced_table, uniform_table
from nvdd.partition._grid import choose_grid, positions_cost, volume_cost

__all__ = [
    "BalanceMode",
    "Grid",
    "as_cell",
    "choose",
    "extent",
    "finite_float",
    "grids",
    "imbalance_of",
    "make_table",
    "positive_int",
    "split_positions",
]

Grid = tuple[int, int, int]

#: At most this many atoms per system score the candidate grids (a strided sample).
_GRID_SAMPLE = 100_000


class BalanceMode(enum.Enum):
    """Where the cuts between sub-domains go."""

    #: Even cuts: ``[0, 1)`` of periodic axes, the atoms' extent on open axes.
    UNIFORM = "uniform"
    #: Nested quantile cuts: every box owns the same number of atoms (needs positions).
    QUANTILE = "quantile"


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be a positive int, got {value!r}")
    return value


def finite_float(name: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0.0 or (positive and v == 0.0):
        need = "> 0" if positive else ">= 0"
        raise ConfigurationError(f"{name} must be finite and {need}, got {value!r}")
    return v


def grids(
    grid_dims: Sequence[int] | Sequence[Sequence[int]] | None, n_systems: int, world: int
) -> list[Grid | None]:
    if grid_dims is None:
        return [None] * n_systems
    items: list[Any] = list(grid_dims)
    per_system: list[Any] = [items] if items and not isinstance(items[0], Sequence) else items
    if len(per_system) == 1:
        per_system = per_system * n_systems
    if len(per_system) != n_systems:
        raise ConfigurationError(
            f"grid_dims gives {len(per_system)} grids for {n_systems} systems: {grid_dims!r}"
        )
    out: list[Grid | None] = []
    for s, g in enumerate(per_system):
        dims = tuple(g)
        if len(dims) != 3 or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims
        ):
            raise ConfigurationError(
                f"grid_dims of system {s} must be three positive ints, got {g!r}"
            )
        if dims[0] * dims[1] * dims[2] != world:
            raise ConfigurationError(
                f"grid_dims {dims} of system {s} has {dims[0] * dims[1] * dims[2]} boxes but "
                f"the world size is {world}"
            )
        out.append((int(dims[0]), int(dims[1]), int(dims[2])))
    return out


def as_cell(cell: Any, n_systems: int | None = None) -> torch.Tensor:
    c = torch.as_tensor(cell).detach().to(dtype=torch.float64)
    if c.ndim == 2:
        c = c.unsqueeze(0)
    if c.ndim != 3 or c.shape[1:] != (3, 3) or c.shape[0] < 1:
        raise ValidationError(f"cell has shape {tuple(c.shape)}, expected (n_systems, 3, 3)")
    if n_systems is not None and c.shape[0] != n_systems:
        raise ValidationError(f"cell has shape {tuple(c.shape)}, expected ({n_systems}, 3, 3)")
    if not bool(torch.isfinite(c).all()):
        raise ValidationError(f"cell has non-finite values: {c.tolist()}")
    return c


def imbalance_of(counts: Sequence[int]) -> float:
    """``max / mean`` of ``counts`` (1.0 when every count is zero)."""
    total = sum(int(c) for c in counts)
    if total == 0:
        return 1.0
    return max(int(c) for c in counts) * len(counts) / total


def split_positions(
    positions: torch.Tensor | None, system_index: torch.Tensor | None, n_systems: int
) -> list[torch.Tensor] | None:
    if positions is None:
        if system_index is not None:
            raise ConfigurationError("system_index was given without positions")
        return None
    if not isinstance(positions, torch.Tensor) or positions.ndim != 2 or positions.shape[1] != 3:
        shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else positions
        raise ValidationError(f"positions has shape {shape}, expected (n_atoms, 3)")
    pos = positions.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(pos).all()):
        row = int((~torch.isfinite(pos)).any(dim=1).nonzero()[0, 0])
        raise ValidationError(f"positions has non-finite values (first at row {row})")
    n = int(pos.shape[0])
    if system_index is None:
        if n_systems != 1:
            raise ValidationError(f"system_index is required with {n_systems} systems")
        si = torch.zeros(n, dtype=torch.int64)
    else:
        si = system_index.detach().to("cpu", torch.int64)
        if si.shape != (n,):
            raise ValidationError(f"system_index has shape {tuple(si.shape)}, expected ({n},)")
        if n and bool(((si < 0) | (si >= n_systems)).any()):
            bad = int(si[(si < 0) | (si >= n_systems)][0])
            raise ValidationError(f"system_index has {bad}, expected 0..{n_systems - 1}")
    counts = torch.bincount(si, minlength=n_systems)
    empty = torch.nonzero(counts == 0).flatten().tolist()
    if empty:
        raise ValidationError(
            f"system(s) {empty} have no atoms (atoms per system {counts.tolist()}); every "
            "system must have at least one atom to be partitioned"
        )
    return [pos[si == s] for s in range(n_systems)]


def extent(
    frac: torch.Tensor | None, periodic: Sequence[bool], synthetic: torch.Tensor
) -> torch.Tensor:
    """Fractional lo/hi of the atoms per axis, shape ``(2, 3)`` (NaN where unknown)."""
    ext = torch.full((2, 3), float("nan"), dtype=torch.float64)
    for a in range(3):
        if periodic[a]:
            ext[0, a], ext[1, a] = 0.0, 1.0
        elif frac is not None:
            lo, hi = float(frac[:, a].min()), float(frac[:, a].max())
            if hi - lo < 1e-9:
                lo, hi = lo - 0.5, hi + 0.5
            ext[0, a], ext[1, a] = lo, hi
        elif not bool(synthetic[a]):
            ext[0, a], ext[1, a] = 0.0, 1.0
    return ext


def make_table(
    grid: Grid,
    periodic: Sequence[bool],
    extent: torch.Tensor,
    frac: torch.Tensor | None,
    balance: BalanceMode,
) -> CutTable:
    """Quantile cuts when balancing with atoms, else even cuts."""
    if balance is BalanceMode.QUANTILE and frac is not None:
        return balanced_table(grid, periodic, frac, extent)
    return uniform_table(grid, periodic, extent)


def choose(
    world: int,
    periodic: Sequence[bool],
    extent: torch.Tensor,
    spacing: torch.Tensor,
    g: float,
    frac: torch.Tensor | None,
    balance: BalanceMode,
    system: int,
) -> Grid:
    """The grid of one system (see ``_grid``): scored on a strided sample of the atoms
    with the cuts they would get, or by padded volume without atoms."""
    cuttable = [bool(torch.isfinite(extent[:, a]).all()) for a in range(3)]
    if frac is None:
        lengths = [
            float((extent[1, a] - extent[0, a]) * spacing[a]) if cuttable[a] else 0.0
            for a in range(3)
        ]
        return choose_grid(
            world, periodic, cuttable, lambda grid: volume_cost(grid, lengths, periodic, g), system
        )
    step = max(1, math.ceil(frac.shape[0] / _GRID_SAMPLE))
    sample = frac[::step]
    return choose_grid(
        world,
        periodic,
        cuttable,
        lambda grid: positions_cost(
            make_table(grid, periodic, extent, sample, balance), sample, spacing, g
        ),
        system,
    )
