"""Small communication helpers: group resolution, object broadcast, integer sums."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nvdd.core import ConfigurationError, all_reduce, comm_device, get_world_size
from nvdd.core import broadcast_object as core_broadcast_object
from nvdd.halo import reshard_by_destination

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["all_reduce_max", "all_reduce_sum", "broadcast_object", "reshard", "resolve_group"]

_PAD = "__nvdd_partition_pad__"


def resolve_group(mesh: object) -> tuple[ProcessGroup | None, DeviceMesh | None]:
    """``(group, mesh)`` from a 1-D DeviceMesh, a ProcessGroup, or None (default group)."""
    if mesh is None:
        return None, None
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ConfigurationError(
                f"ShardedBatch needs a 1-D DeviceMesh, got {mesh.ndim} dimensions "
                f"{mesh.mesh_dim_names} of shape {tuple(mesh.shape)}"
            )
        return mesh.get_group(), mesh
    if isinstance(mesh, dist.ProcessGroup):
        return mesh, None
    raise ConfigurationError(
        f"mesh must be a 1-D DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}"
    )


def broadcast_object(obj: Any, src: int, group: ProcessGroup | None) -> Any:
    """``obj`` of group rank ``src`` on every rank.

    **Collective** over ``group``: every rank calls it; only ``src``'s ``obj`` is
    read. A no-op in a world of one rank.
    """
    return core_broadcast_object(obj, src, group)


def _all_reduce(values: torch.Tensor, group: ProcessGroup | None, op: str) -> torch.Tensor:
    if get_world_size(group) == 1:
        return values.cpu()
    t = values.to(comm_device(group), torch.int64)
    all_reduce(t, op, group)
    return t.cpu()


def all_reduce_sum(values: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Element-wise sum of an int64 vector over ``group``, returned on CPU.

    **Collective** over ``group`` (one all-reduce); identity in a world of one.
    """
    return _all_reduce(values, group, "sum")


def all_reduce_max(values: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Element-wise maximum of an int64 vector over ``group``, returned on CPU.

    **Collective** over ``group`` (one all-reduce); identity in a world of one.
    """
    return _all_reduce(values, group, "max")


def reshard(
    fields: dict[str, torch.Tensor], destination: torch.Tensor, group: ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """:func:`nvdd.halo.reshard_by_destination` with an aligned row layout.

    **Collective** over ``group`` (every rank calls it with the same field names,
    dtypes and trailing shapes). Fields are passed in decreasing element size and
    the row is padded to a multiple of 8 bytes, so every field starts at an offset
    its dtype can be viewed at, on every rank, whatever the row count (float32
    positions next to int64 ids, bool extras).
    """
    order = sorted(fields, key=lambda k: -fields[k].element_size())
    packed = {k: fields[k] for k in order}
    row = sum(t.element_size() * math.prod(t.shape[1:]) for t in packed.values())
    if row % 8:
        n = int(destination.shape[0])
        packed[_PAD] = torch.zeros(n, 8 - row % 8, dtype=torch.uint8, device=destination.device)
    out = reshard_by_destination(packed, destination, group)
    out.pop(_PAD, None)
    return {k: out[k] for k in fields}
