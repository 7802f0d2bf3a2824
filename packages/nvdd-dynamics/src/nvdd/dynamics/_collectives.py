"""Counting collectives, and the mesh-wide reducer integrators use."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nvdd.core import comm_device, get_world_size
from nvdd.dynamics._base import Reducer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nvdd.dynamics._consolidate import PendingTotals

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
    (one all-reduce; every rank of the group must call it).

    Parameters
    ----------
    group:
        The mesh's process group (None: the default group).
    totals:
        The distributed model's pending per-system partials:
        :meth:`sum_with_totals` reduces them in the same all-reduce as the
        integrator's own sums.
    """

    def __init__(self, group: ProcessGroup | None, totals: PendingTotals | None = None) -> None:
        self.group = group
        self.totals = totals

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

    def sum_with_totals(
        self, t: torch.Tensor, names: Iterable[str], known: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``t`` summed over ranks and the totals ``names``: the pending partials of
        the last forward join ``t`` in ONE all-reduce (names already reduced,
        e.g. for a hook, are not sent again); names not pending come from
        ``known``. **Collective** over :attr:`group`.
        """
        wanted = list(names)
        if self.totals is None:
            return self.sum(t), {n: known[n] for n in wanted if n in known}
        pending = set(self.totals.partials())
        summed, totals = self.totals.materialize_with(t, [n for n in wanted if n in pending])
        for n in wanted:
            if n not in totals and n in known:
                totals[n] = known[n]
        return summed, totals
