"""The intent vocabulary: what a distribution-aware model body asks for.

Each verb does the right thing in the three places a model runs: single
process (the inert context: identity), under domain decomposition (the live
context's layout, or the ShardTensor's own), and under ``torch.compile`` (no
host synchronisation, no graph break). Argument checks compare host-side
integers only and raise locally; see :meth:`DDContext.validate` for the
rank-consistent check to run once after a halo rebuild.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, cast, overload

import torch

from nvdd.core import ConfigurationError, ValidationError, get_rank, get_world_size
from nvdd.shardtensor._autograd import sum_over_ranks
from nvdd.shardtensor._context import Scope, current_dd_context
from nvdd.shardtensor._protocol import HaloLayout
from nvdd.shardtensor._rules import layout_of, plain, wrap
from nvdd.shardtensor._shard_tensor import ShardTensor

__all__ = [
    "autograd_target",
    "localize",
    "refresh_neighbors",
    "scatter_to_owners",
    "system_sum",
    "to_local",
]

T = TypeVar("T", bound=torch.Tensor)
U = TypeVar("U")


def _check_rows(x: torch.Tensor, layout: HaloLayout, verb: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValidationError(f"rank {get_rank()}: {verb} needs a tensor, got {type(x).__name__}")
    if x.ndim == 0 or x.shape[0] != layout.n_padded:
        raise ValidationError(
            f"rank {get_rank()}: {verb} needs shape (n_padded={layout.n_padded}, ...), "
            f"got shape {tuple(x.shape)}"
        )


def _exchange(x: T, verb: str, fold: bool) -> T:
    if isinstance(x, ShardTensor):
        layout = layout_of(x)
        local = plain(x)
        out = layout.fold(local) if fold else layout.refresh(local)
        return cast(T, wrap(ShardTensor, out, layout))
    ctx_layout = current_dd_context().layout
    if ctx_layout is None:
        return x
    _check_rows(x, ctx_layout, verb)
    return cast(T, ctx_layout.fold(x) if fold else ctx_layout.refresh(x))


def refresh_neighbors(x: T) -> T:
    """Make the ghost (neighbour) rows of a per-node tensor current.

    **Collective** over the layout's group (every rank of it must call it) when
    a layout applies; the identity in the inert context.

    Parameters
    ----------
    x:
        ``shape (n_padded, ...)``. A ShardTensor uses its own layout; a plain
        tensor uses the live context's layout.

    Returns
    -------
    torch.Tensor
        The same kind as ``x`` (ShardTensor in, ShardTensor out): owned rows
        as in ``x``, ghost rows equal to their owners' current values. Ghost
        gradients are folded into their owners in the backward.

    Raises
    ------
    ValidationError
        If a plain ``x`` does not have ``n_padded`` rows (local check).
    """
    return _exchange(x, "refresh_neighbors", fold=False)


def scatter_to_owners(x: T) -> T:
    """Fold contributions written into ghost rows back to their owners.

    **Collective** over the layout's group (every rank of it must call it) when
    a layout applies; the identity in the inert context.

    Parameters
    ----------
    x:
        ``shape (n_padded, ...)`` holding partial sums (e.g. per-edge
        contributions scattered into receiver rows, some of them ghosts).

    Returns
    -------
    torch.Tensor
        The same kind as ``x``: every owned row is its own value plus the ghost
        copies of it on every rank; ghost rows are then refreshed. Use it on a
        tensor an opaque kernel scattered into; scatters dispatched on a
        ShardTensor fold by themselves.

    Raises
    ------
    ValidationError
        If a plain ``x`` does not have ``n_padded`` rows (local check).
    """
    return _exchange(x, "scatter_to_owners", fold=True)


def system_sum(
    values: torch.Tensor,
    system_index: torch.Tensor,
    n_systems: int,
    scope: Scope = Scope.OWNED,
) -> torch.Tensor:
    """Sum per-node values into per-system totals without double counting.

    **Collective** over the group (every rank must call it) for
    ``scope=Scope.OWNED`` under a layout on more than one rank; no
    communication otherwise.

    Parameters
    ----------
    values:
        ``shape (n_rows, ...)`` (trailing dims allowed, e.g. ``(n_rows, 3, 3)``
        virials). A ShardTensor uses its own layout and group; a plain tensor
        the live context's.
    system_index:
        ``shape (n_rows,)``, integer: the system of each row.
    n_systems:
        Number of systems (the same on every rank).
    scope:
        ``Scope.OWNED``: owned rows (``row < n_owned``) summed per system and
        all-reduced over the group, replicated on every rank; its backward is
        the identity, so each rank's gradient flows to its own owned rows only
        and forces need no division by the world size. ``Scope.LOCAL``: this
        rank's owned rows only, no collective.

    Returns
    -------
    torch.Tensor
        ``shape (n_systems, ...)``, a plain tensor. Single process (no layout):
        the plain per-system sum over every row, for either scope.

    Raises
    ------
    ConfigurationError
        On a bad ``scope`` or ``n_systems``.
    ValidationError
        On mismatched shapes (local check).
    """
    rank = get_rank()
    if not isinstance(scope, Scope):
        raise ConfigurationError(f"rank {rank}: scope must be a Scope, got {scope!r}")
    if not isinstance(n_systems, int) or n_systems < 0:
        raise ConfigurationError(f"rank {rank}: n_systems must be an int >= 0, got {n_systems!r}")
    if isinstance(values, ShardTensor):
        layout: HaloLayout | None = layout_of(values)
        group = layout.group if layout is not None else None
    else:
        ctx = current_dd_context()
        layout, group = ctx.layout, ctx.group
    v, idx = to_local(values), to_local(system_index)
    if v.ndim == 0 or idx.ndim != 1 or idx.shape[0] != v.shape[0]:
        raise ValidationError(
            f"rank {rank}: system_sum needs values of shape (n_rows, ...) and system_index of "
            f"shape (n_rows,), got {tuple(v.shape)} and {tuple(idx.shape)}"
        )
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise ValidationError(
            f"rank {rank}: system_index must be an integer tensor, got dtype {idx.dtype}"
        )
    if layout is not None:
        n_owned = layout.n_owned
        if v.shape[0] < n_owned:
            raise ValidationError(
                f"rank {rank}: system_sum needs at least n_owned={n_owned} rows, got shape "
                f"{tuple(v.shape)}"
            )
        v, idx = v[:n_owned], idx[:n_owned]
    out = v.new_zeros((n_systems, *v.shape[1:])).index_add_(0, idx, v)
    if layout is not None and scope is Scope.OWNED and get_world_size(group) > 1:
        out = sum_over_ranks(out, group)
    return out


@overload
def to_local(x: torch.Tensor) -> torch.Tensor: ...


@overload
def to_local(x: U) -> U: ...


def to_local(x: Any) -> Any:
    """The plain local tensor backing a ShardTensor (all ``n_padded`` rows), else ``x``.

    The result is a view of the same storage and stays in the autograd graph.
    No communication.
    """
    return plain(x) if isinstance(x, ShardTensor) else x


def localize(d: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict with :func:`to_local` applied to every value of ``d``.

    For handing a model-input dict to code that must see plain tensors (an
    opaque kernel, a scripted function). No communication.
    """
    return {k: to_local(v) for k, v in d.items()}


def autograd_target(x: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor to pass as ``torch.autograd.grad(..., inputs=)``.

    Under domain decomposition (a layout in the live context) this is the
    context's padded positions leaf, ``shape (n_padded, 3)``, whatever ``x`` is:
    the model may have built its inputs from it through a refresh, and forces
    need the gradient at the leaf. Otherwise it is ``x`` (or, without ``x``,
    the context's positions). No communication.

    Raises
    ------
    ConfigurationError
        If neither ``x`` nor the context's positions are available.
    """
    ctx = current_dd_context()
    if ctx.is_distributed and ctx.positions is not None:
        return ctx.positions
    if x is not None:
        return x
    if ctx.positions is not None:
        return ctx.positions
    raise ConfigurationError(
        f"rank {get_rank()}: autograd_target() has no x and the DD context has no positions"
    )
