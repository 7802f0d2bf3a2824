"""Autograd functions of the verbs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nvdd.core import all_reduce as comm_all_reduce

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["sum_over_ranks"]


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward.

    Every rank computes the replicated total ``E = sum_r e_r`` from its own
    share ``e_r``. Each rank then back-propagates ``dE`` through its own share
    only, so the gradient that reaches rank ``r``'s rows is ``d e_r / d x_r``
    (plus whatever the halo exchanges route to it from other ranks' shares):
    summed over ranks that is the exact gradient of ``E``, with no factor of
    the world size to divide away, and no collective in the backward.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        comm_all_reduce(out, "sum", group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_ranks(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group``; the gradient passes through unchanged.

    **Collective** over ``group``: every rank must call it with the same shape.
    No host synchronisation (the all-reduce is enqueued on the current stream
    under NCCL).
    """
    out: torch.Tensor = _SumOverRanks.apply(x, group)  # type: ignore[no-untyped-call]
    return out
