"""The halo-layout protocol: what a ShardTensor needs from a halo plan.

A *layout* describes one rank's per-atom rows ``[owned | ghost]``: rows
``0 .. n_owned-1`` are atoms this rank owns, rows ``n_owned .. n_padded-1`` are
read-only copies ("ghosts") of atoms owned by other ranks or periodic images of
this rank's own atoms. nvdd-halo's plan implements it; this package never
imports a concrete halo.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from nvdd.core import ValidationError, get_rank

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["HaloLayout", "check_layout", "describe_layout"]


@runtime_checkable
class HaloLayout(Protocol):
    """One rank's ``[owned | ghost]`` row layout and its two exchanges.

    Attributes
    ----------
    n_owned:
        Number of owned rows (they come first).
    n_padded:
        Total number of rows, owned plus ghost (``n_padded >= n_owned``).
    group:
        The process group the exchanges (and per-system all-reduces) run over;
        ``None`` means the default group when ``torch.distributed`` is
        initialised, a world of one otherwise.

    Notes
    -----
    Both exchanges take and return *plain* tensors of ``shape (n_padded, ...)``
    and are autograd-aware; ShardTensor always hands them its local tensor.

    ``refresh(x)``
        **Collective** over ``group``: returns a tensor whose owned rows equal
        ``x``'s owned rows and whose ghost rows are the current values of their
        owners. Backward: ghost-row gradients are summed into their owners.
    ``fold(x)``
        **Collective** over ``group``: ghost rows are summed into their owners'
        rows (across ranks), then the result is refreshed. Fold is self-adjoint.

    Optional attribute ``explicit_images`` (default True when absent): True when
    ghost rows are periodic images placed where they interact, so the rows are
    a system with open boundaries (the halo strategy); False when ghost rows
    are the atoms themselves and a model must apply the real cell and pbc (the
    graph-partition strategy).
    """

    @property
    def n_owned(self) -> int:
        """Number of owned rows (they come first)."""
        ...

    @property
    def n_padded(self) -> int:
        """Total number of rows, owned plus ghost."""
        ...

    @property
    def group(self) -> ProcessGroup | None:
        """The process group of the exchanges (``None``: the default group)."""
        ...

    def refresh(self, x: torch.Tensor) -> torch.Tensor:
        """**Collective** over ``group``: ``x`` with its ghost rows set to their owners' rows.

        ``x`` has shape ``(n_padded, ...)``; backward sums ghost-row gradients into
        their owners.
        """
        ...

    def fold(self, x: torch.Tensor) -> torch.Tensor:
        """**Collective** over ``group``: ghost rows summed into their owners, then refreshed.

        ``x`` has shape ``(n_padded, ...)``; self-adjoint.
        """
        ...


def describe_layout(layout: HaloLayout) -> str:
    """A short description for error messages: ``n_owned=.., n_padded=..``."""
    return f"{type(layout).__name__}(n_owned={layout.n_owned}, n_padded={layout.n_padded})"


def check_layout(layout: object) -> HaloLayout:
    """Return ``layout`` if it satisfies :class:`HaloLayout`, else raise.

    Local check (no communication): the members exist, the row counts are
    integers and ``0 <= n_owned <= n_padded``.

    Raises
    ------
    ValidationError
        Naming the rank, the missing member or the offending counts.
    """
    if not isinstance(layout, HaloLayout):
        missing = [
            m for m in ("n_owned", "n_padded", "group", "refresh", "fold") if not hasattr(layout, m)
        ]
        raise ValidationError(
            f"rank {get_rank()}: {type(layout).__name__} is not a HaloLayout "
            f"(missing {', '.join(missing)})"
        )
    n_owned, n_padded = layout.n_owned, layout.n_padded
    if not isinstance(n_owned, int) or not isinstance(n_padded, int):
        raise ValidationError(
            f"rank {get_rank()}: layout row counts must be int, got n_owned={n_owned!r}, "
            f"n_padded={n_padded!r}"
        )
    if not 0 <= n_owned <= n_padded:
        raise ValidationError(
            f"rank {get_rank()}: layout needs 0 <= n_owned <= n_padded, got "
            f"n_owned={n_owned}, n_padded={n_padded}"
        )
    return layout
