"""Gathers shared by the sharded batches: every rank's rows to one rank, or to all."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nvdd.core import Batch, ConfigurationError, get_rank, get_world_size
from nvdd.partition._comm import reshard

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["gather_to", "gather_to_all"]


def gather_to(local: Batch, dst: int, group: ProcessGroup | None) -> Batch | None:
    """The whole batch in atom-id order on ``dst`` (None elsewhere).

    **Collective** over ``group``: one packed ``reshard_by_destination`` of every
    per-atom field to ``dst``; system fields are ``dst``'s copies.
    """
    world, rank = get_world_size(group), get_rank(group)
    if not 0 <= dst < world:
        raise ConfigurationError(f"rank {rank}: dst {dst} is outside [0, {world})")
    dest = torch.full((local.n_atoms,), dst, dtype=torch.int64, device=local.device)
    rows = reshard(local.atom_fields(), dest, group)
    if rank != dst:
        return None
    return local.with_atom_fields(rows).sort_by_id()


def gather_to_all(local: Batch, group: ProcessGroup | None) -> Batch:
    """The whole batch in atom-id order on every rank.

    **Collective** over ``group``: one packed exchange in which every rank sends
    its rows to every rank (O(N) memory per rank, as the result).
    """
    world = get_world_size(group)
    n = local.n_atoms
    tiled = {
        k: v.unsqueeze(0).expand(world, *v.shape).reshape(world * n, *v.shape[1:])
        for k, v in local.atom_fields().items()
    }
    dest = torch.arange(world, device=local.device).repeat_interleave(n)
    rows = reshard(tiled, dest, group)
    return local.with_atom_fields(rows).sort_by_id()
