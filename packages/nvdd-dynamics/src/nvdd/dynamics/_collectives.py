"""Counting collectives, and the mesh-wide reducer integrators use."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nvdd.core import comm_device, get_world_size
from nvdd.dynamics._base import Reducer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["COUNTED_COLLECTIVES", "MeshReducer", "count_collectives"]

#: The torch.distributed functions :func:`count_collectives` counts.
COUNTED_COLLECTIVES = (
    "all_to_all_single",
    "all_to_all",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "barrier",
)


def _counting(name: str, fn: Callable[..., Any], counts: Counter[str]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        return fn(*args, **kwargs)

    return wrapper


@contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Count calls of ``torch.distributed`` collectives inside the block.

    Yields a :class:`collections.Counter` filled as calls happen (names from
    :data:`COUNTED_COLLECTIVES`). Calls made through the ``torch.distributed``
    module attribute are seen (every nvdd package calls them that way); the
    originals are restored when the block exits, also on exceptions.
    """
    counts: Counter[str] = Counter()
    saved = {name: getattr(dist, name) for name in COUNTED_COLLECTIVES if hasattr(dist, name)}
    try:
        for name, fn in saved.items():
            setattr(dist, name, _counting(name, fn, counts))
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


class MeshReducer(Reducer):
    """Sums and maxima over every rank of ``group``: each call is **Collective**
    (one all-reduce; every rank of the group must call it)."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group

    def _reduce(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        if get_world_size(self.group) == 1:
            return t
        buf = t.detach().to(comm_device(self.group)).contiguous().clone()
        dist.all_reduce(buf, op=op, group=self.group)
        return buf.to(t.device)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.SUM)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.MAX)
