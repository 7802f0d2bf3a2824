"""The few ShardTensor / DD-context operations the adapters need (one seam)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _st() -> Any:
    # nvdd.shardtensor is imported on first use: spec types and presets are usable
    # (and importable) without touching the dispatch layer.
    import nvdd.shardtensor

    return nvdd.shardtensor


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
    return _st().current_dd_context().layout is not None


def shard_layout(x: Any) -> Any:
    """The halo layout of a ShardTensor, else None."""
    return x.halo_layout if isinstance(x, _st().ShardTensor) else None


def to_local(x: Any) -> Any:
    """The plain tensor behind a ShardTensor, else ``x``."""
    return _st().to_local(x) if isinstance(x, torch.Tensor) else x


def as_shard(t: torch.Tensor, layout: Any) -> torch.Tensor:
    """Wrap ``t`` (rows ``[owned | ghost]`` of ``layout``) as a ShardTensor."""
    return _st().ShardTensor.from_local(t, layout)  # type: ignore[no-any-return]


def refresh(x: torch.Tensor) -> torch.Tensor:
    """Ghost rows made current (**Collective** when distributed; identity when inert)."""
    return _st().refresh_neighbors(x)  # type: ignore[no-any-return]


def scatter(x: torch.Tensor, layout: Any) -> torch.Tensor:
    """Fold ghost partials of ``x`` into owners (**Collective** when distributed)."""
    return _st().scatter_to_owners(as_shard(x, layout) if layout is not None else x)  # type: ignore[no-any-return]


class _AllReduceIdentityBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        if dist.is_initialized():
            dist.all_reduce(out, group=_st().current_dd_context().group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def all_reduce_identity_backward(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the DD group with an identity backward. **Collective** over the
    live context's group (all ranks of the scope); identity when inert."""
    if not dd_active():
        return x
    out: torch.Tensor = _AllReduceIdentityBackward.apply(to_local(x))  # type: ignore[no-untyped-call]
    return out
