"""The mesh-wide reducer integrators use (collectives go through ``nvdd.core``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nvdd.core import COLLECTIVE_NAMES, all_reduce, comm_device, count_collectives, get_world_size
from nvdd.dynamics._base import Reducer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["COUNTED_COLLECTIVES", "MeshReducer", "count_collectives"]

#: The collective names :func:`count_collectives` reports (``nvdd.core.COLLECTIVE_NAMES``).
COUNTED_COLLECTIVES = COLLECTIVE_NAMES


class MeshReducer(Reducer):
    """Sums and maxima over every rank of ``group``: each call is **Collective**
    (one all-reduce; every rank of the group must call it)."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group

    def _reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        if get_world_size(self.group) == 1:
            return t
        buf = t.detach().to(comm_device(self.group)).contiguous().clone()
        all_reduce(buf, op, self.group)
        return buf.to(t.device)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, "sum")

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, "max")
