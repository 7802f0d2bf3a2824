"""What a :class:`~nvdd.partition.SpatialPartitioner` is, as one frozen value.

The bottom of the partitioner's modules: ``_state_io`` (JSON) and
``_migrate_kernel`` (the migration) read it, ``_spatial`` builds it; none of them
is imported from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from nvdd.partition._build import BalanceMode
    from nvdd.partition._cuts import CutTable

__all__ = ["_State"]


@dataclass(frozen=True)
class _State:
    """Everything a partitioner is (CPU tensors; broadcast as one object)."""

    cell: torch.Tensor  # (S, 3, 3) float64, as given
    pbc: torch.Tensor  # (S, 3) bool
    domain: torch.Tensor  # (S, 3, 3) float64
    synthetic: torch.Tensor  # (S, 3) bool
    extent: torch.Tensor  # (S, 2, 3) float64, NaN where unknown
    tables: tuple[CutTable, ...]
    world_size: int
    ghost_width: float
    skin: float | None
    balance: BalanceMode
    require_nondegenerate: bool
    build_counts: torch.Tensor | None  # (world_size,) int64
