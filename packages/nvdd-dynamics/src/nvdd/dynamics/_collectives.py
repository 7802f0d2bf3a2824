"""The mesh-wide reducer integrators use (collectives go through ``nvdd.core``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from nvdd.core import COLLECTIVE_NAMES, all_reduce, comm_device, count_collectives, get_world_size
from nvdd.dynamics._step import Reducer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["COUNTED_COLLECTIVES", "MeshReducer", "count_collectives"]

#: The collective names :func:`count_collectives` reports (``nvdd.core.COLLECTIVE_NAMES``).
COUNTED_COLLECTIVES = COLLECTIVE_NAMES


class Pending(Protocol):
    """What :class:`MeshReducer` needs of the pending per-system totals
    (``nvdd.dynamics._provider.PendingTotals``)."""

    def partials(self) -> dict[str, torch.Tensor]:
        """The unreduced partials (no communication)."""
        ...

    def materialize_with(
        self, extra: torch.Tensor, names: Iterable[str]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``extra`` summed over ranks and the totals of ``names``, in one all-reduce."""
        ...


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

    def __init__(self, group: ProcessGroup | None, totals: Pending | None = None) -> None:
        self.group = group
        self.totals = totals

    def _reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        if get_world_size(self.group) == 1:
            return t
        buf = t.detach().to(comm_device(self.group)).contiguous().clone()
        all_reduce(buf, op, self.group)
        return buf.to(t.device)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """**Collective** over ``group``: ``t`` summed elementwise over its ranks
        (detached, on ``t``'s device; ``t`` itself with one rank)."""
        return self._reduce(t, "sum")

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """**Collective** over ``group``: the elementwise maximum of ``t`` over its ranks
        (detached, on ``t``'s device; ``t`` itself with one rank)."""
        return self._reduce(t, "max")

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
