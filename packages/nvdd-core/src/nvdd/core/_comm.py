"""Every collective nvdd makes goes through this module.

One place for the transport: a change of backend, a watchdog beat or a count of
collectives touches this file only. Counting is opt-in (:func:`count_collectives`);
listeners (:func:`add_listener`) see the name of every collective before it runs,
which is how a watchdog learns that this rank is about to wait.

Every function here is **Collective** over its ``group`` (``None``: the default
group): every rank of the group calls it at the same point with matching
arguments. In a world of one rank they return at once without communicating.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "COLLECTIVE_NAMES",
    "add_listener",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast_object",
    "count_collectives",
    "remove_listener",
]

#: The names :func:`count_collectives` reports.
COLLECTIVE_NAMES = (
    "all_reduce",
    "all_to_all_single",
    "all_gather_object",
    "broadcast_object",
    "barrier",
)

_COUNTERS: list[Counter[str]] = []
_LISTENERS: list[Callable[[str], None]] = []
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _world(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _note(name: str) -> None:
    for counter in _COUNTERS:
        counter[name] += 1
    for listener in _LISTENERS:
        listener(name)


@contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Count the collectives nvdd makes inside the block (any thread, any package).

    Yields a :class:`collections.Counter` keyed by the names of
    :data:`COLLECTIVE_NAMES`, filled as calls happen; scopes nest. Calls in a
    world of one rank communicate nothing and are not counted.
    """
    counter: Counter[str] = Counter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def add_listener(fn: Callable[[str], None]) -> None:
    """Call ``fn(name)`` before every collective of this process (e.g. a watchdog)."""
    _LISTENERS.append(fn)


def remove_listener(fn: Callable[[str], None]) -> None:
    """Stop calling ``fn`` (no error if it was not registered)."""
    if fn in _LISTENERS:
        _LISTENERS.remove(fn)


def all_reduce(t: torch.Tensor, op: str = "sum", group: ProcessGroup | None = None) -> None:
    """Reduce ``t`` in place over ``group`` (``op``: ``"sum"``, ``"max"``, ``"min"``).

    **Collective**. ``t`` must be on ``comm_device(group)``.
    """
    if _world(group) == 1:
        return
    _note("all_reduce")
    dist.all_reduce(t, op=_OPS[op], group=group)


def all_to_all_single(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: Sequence[int] | None = None,
    in_splits: Sequence[int] | None = None,
    group: ProcessGroup | None = None,
) -> None:
    """``torch.distributed.all_to_all_single`` (rows ``in_splits[r]`` go to rank ``r``).

    **Collective**. Both tensors on ``comm_device(group)``.
    """
    if _world(group) == 1:
        out.copy_(inp)
        return
    _note("all_to_all_single")
    dist.all_to_all_single(
        out,
        inp,
        None if out_splits is None else list(out_splits),
        None if in_splits is None else list(in_splits),
        group=group,
    )


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order. **Collective**."""
    world = _world(group)
    if world == 1:
        return [obj]
    _note("all_gather_object")
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int, group: ProcessGroup | None = None) -> Any:
    """``obj`` of group rank ``src`` on every rank (others' arguments are ignored).

    **Collective**.
    """
    if _world(group) == 1:
        return obj
    _note("broadcast_object")
    payload = [obj if dist.get_rank(group) == src else None]
    dist.broadcast_object_list(payload, group=group, group_src=src)
    return payload[0]


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` arrives. **Collective**."""
    if _world(group) == 1:
        return
    _note("barrier")
    dist.barrier(group=group)
