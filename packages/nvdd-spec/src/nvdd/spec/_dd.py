"""The few ShardTensor / DD-context operations the adapters need (one seam)."""

from __future__ import annotations

from typing import Any

import torch

from nvdd.core import get_world_size
from nvdd.shardtensor import (
    ShardTensor,
    current_dd_context,
    refresh_neighbors,
    scatter_to_owners,
    sum_over_ranks,
)
from nvdd.shardtensor import to_local as _to_local

__all__ = [
    "all_reduce_identity_backward",
    "as_shard",
    "dd_active",
    "refresh",
    "scatter",
    "shard_layout",
    "to_local",
]


def dd_active() -> bool:
    """Whether a distributed (non-inert) DD context is live."""
    return current_dd_context().layout is not None


def shard_layout(x: Any) -> Any:
    """The halo layout of a ShardTensor, else None."""
    return x.halo_layout if isinstance(x, ShardTensor) else None


def to_local(x: Any) -> Any:
    """The plain tensor behind a ShardTensor, else ``x``."""
    return _to_local(x) if isinstance(x, torch.Tensor) else x


def as_shard(t: torch.Tensor, layout: Any) -> torch.Tensor:
    """Wrap ``t`` (rows ``[owned | ghost]`` of ``layout``) as a ShardTensor."""
    return ShardTensor.from_local(t, layout)


def refresh(x: torch.Tensor) -> torch.Tensor:
    """Ghost rows made current (**Collective** when distributed; identity when inert)."""
    return refresh_neighbors(x)


def scatter(x: torch.Tensor, layout: Any) -> torch.Tensor:
    """Fold ghost partials of ``x`` into owners (**Collective** when distributed)."""
    return scatter_to_owners(as_shard(x, layout) if layout is not None else x)


def all_reduce_identity_backward(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the DD group with an identity backward. **Collective** over the
    live context's group (all ranks of the scope); identity when inert."""
    ctx = current_dd_context()
    if ctx.layout is None or get_world_size(ctx.group) == 1:
        return x
    return sum_over_ranks(to_local(x), ctx.group)
