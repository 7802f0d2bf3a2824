"""The live domain-decomposition context of one forward pass."""

from __future__ import annotations

import contextvars
import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nvdd.core import (
    ConfigurationError,
    ValidationError,
    all_reduce,
    comm_device,
    get_rank,
    get_world_size,
)
from nvdd.core import raise_if_any_rank as _raise_if_any_rank
from nvdd.shardtensor._protocol import HaloLayout, check_layout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DDContext", "Scope", "current_dd_context", "dd_scope"]


class Scope(enum.Enum):
    """Which rows a per-system reduction sums, and whether it crosses ranks.

    ``OWNED``
        Owned rows only, summed over every rank of the group: the global
        per-system total, the same on every rank (**Collective**).
    ``LOCAL``
        Owned rows only, this rank's share; no communication.
    """

    OWNED = "owned"
    LOCAL = "local"


@dataclass(frozen=True, eq=False)
class DDContext:
    """What a model's forward needs to know about the decomposition it runs under.

    Parameters
    ----------
    layout:
        The halo layout of this rank's per-atom rows, or ``None`` when not
        distributed (the *inert* context: every verb is the identity).
    group:
        Process group of the per-system reductions; defaults to
        ``layout.group``.
    n_systems:
        Number of systems in the batch (every rank knows all of them).
    positions:
        The padded positions leaf, ``shape (n_padded, 3)``, that forces are
        differentiated against (see :func:`autograd_target`), or ``None``.
    topology_version:
        Incremented by the runtime whenever the halo plan is rebuilt, so a
        model can cache anything derived from the rows (a neighbour list)
        and know when to rebuild it.

    Raises
    ------
    ConfigurationError
        On a non-layout, a negative ``n_systems`` or ``topology_version``, a
        ``positions`` that is not a tensor.

    Notes
    -----
    The constructor checks types only, which every rank gets right or wrong
    together. Facts that can differ between ranks (the rows of ``positions``,
    ``n_systems`` and ``topology_version`` agreeing across ranks) are checked by
    :meth:`validate`, a collective that raises on every rank at once.
    """

    layout: HaloLayout | None = None
    group: ProcessGroup | None = None
    n_systems: int = 1
    positions: torch.Tensor | None = None
    topology_version: int = 0

    def __post_init__(self) -> None:
        rank = get_rank()
        if self.layout is not None:
            check_layout(self.layout)
            if self.group is None:
                object.__setattr__(self, "group", self.layout.group)
        if not isinstance(self.n_systems, int) or self.n_systems < 0:
            raise ConfigurationError(
                f"rank {rank}: DDContext.n_systems must be an int >= 0, got {self.n_systems!r}"
            )
        if not isinstance(self.topology_version, int) or self.topology_version < 0:
            raise ConfigurationError(
                f"rank {rank}: DDContext.topology_version must be an int >= 0, got "
                f"{self.topology_version!r}"
            )
        if self.positions is not None and not isinstance(self.positions, torch.Tensor):
            raise ConfigurationError(
                f"rank {rank}: DDContext.positions must be a tensor or None, got "
                f"{type(self.positions).__name__}"
            )

    def with_positions(self, positions: torch.Tensor | None) -> DDContext:
        """This context with ``positions`` instead (the runtime's context of one
        forward: it makes one context per halo plan and one of these per step).
        The layout was checked when this context was made, and is not again.

        Raises
        ------
        ConfigurationError
            When ``positions`` is not a tensor or None.
        """
        if positions is not None and not isinstance(positions, torch.Tensor):
            raise ConfigurationError(
                f"rank {get_rank()}: DDContext.positions must be a tensor or None, got "
                f"{type(positions).__name__}"
            )
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__["positions"] = positions
        return new

    def _shape_problem(self) -> str | None:
        pos = self.positions
        if pos is None:
            return None
        if self.layout is None:
            return (
                None
                if pos.ndim == 2
                else f"DDContext.positions must be 2-D, got {tuple(pos.shape)}"
            )
        if pos.ndim != 2 or pos.shape[0] != self.layout.n_padded:
            return (
                f"DDContext.positions must have shape (n_padded={self.layout.n_padded}, 3), "
                f"got shape {tuple(pos.shape)}"
            )
        return None

    @property
    def is_distributed(self) -> bool:
        """True when a layout is set (the verbs act); False for the inert context."""
        return self.layout is not None

    @property
    def world_size(self) -> int:
        """Ranks in :attr:`group` (1 for the inert context). Host-side, no communication."""
        return 1 if self.layout is None else get_world_size(self.group)

    @property
    def n_owned(self) -> int | None:
        """Owned rows of this rank; for the inert context the rows of
        :attr:`positions` (every row is owned), or ``None`` without them."""
        if self.layout is not None:
            return self.layout.n_owned
        return None if self.positions is None else int(self.positions.shape[0])

    def owned_mask(
        self, n_rows: int | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """``shape (n_rows,)`` bool: True on owned rows.

        Parameters
        ----------
        n_rows:
            Rows of the mask; default ``layout.n_padded`` (or the rows of
            :attr:`positions` in the inert context). Must be given for an
            inert context without positions.
        device:
            Default: the device of :attr:`positions`, else CPU.
        """
        if device is None:
            device = self.positions.device if self.positions is not None else "cpu"
        if n_rows is None:
            if self.layout is not None:
                n_rows = self.layout.n_padded
            elif self.positions is not None:
                n_rows = int(self.positions.shape[0])
            else:
                raise ConfigurationError(
                    f"rank {get_rank()}: owned_mask needs n_rows for an inert context "
                    "without positions"
                )
        if self.layout is None:
            return torch.ones(n_rows, dtype=torch.bool, device=device)
        return torch.arange(n_rows, device=device) < self.layout.n_owned

    def validate(self) -> None:
        """Check the context on every rank and raise the same error everywhere.

        **Collective** over :attr:`group` (two small all-reduces; every rank of the
        group must call it; synchronises with the host). Checks the positions'
        rows on each rank and that ``n_systems`` and ``topology_version`` agree
        across ranks (a mismatch would make the per-system all-reduce hang or
        mix shapes). The constructor checks types only; call this once after a
        halo rebuild, before the first verb, so a rank with a malformed context
        cannot leave its peers waiting in an exchange. The inert context is
        checked locally (no collective).
        """
        problems = [p for p in (self._shape_problem(),) if p is not None]
        if self.layout is not None and get_world_size(self.group) > 1:
            counts = [
                self.n_systems,
                -self.n_systems,
                self.topology_version,
                -self.topology_version,
            ]
            t = torch.tensor(counts, dtype=torch.int64, device=comm_device(self.group))
            all_reduce(t, "max", self.group)
            hi_sys, lo_sys, hi_top, lo_top = (int(v) for v in t.tolist())
            if hi_sys != -lo_sys:
                problems.append(
                    f"n_systems={self.n_systems} differs across ranks (range {-lo_sys}..{hi_sys})"
                )
            if hi_top != -lo_top:
                problems.append(
                    f"topology_version={self.topology_version} differs across ranks "
                    f"(range {-lo_top}..{hi_top})"
                )
        message = "; ".join(problems) or None
        if self.layout is None:  # inert: a world of one, no collective
            if message is not None:
                raise ValidationError(f"rank {get_rank()}: {message}")
            return
        _raise_if_any_rank(message, self.group, exc_type=ValidationError)


#: The inert context: not distributed, a world of one.
_INERT = DDContext()
_CURRENT: contextvars.ContextVar[DDContext] = contextvars.ContextVar(
    "nvdd_dd_context", default=_INERT
)


class _Mirror:
    """The innermost live context, as a plain attribute ``torch.compile`` can read.

    Dynamo (torch 2.13) cannot trace ``ContextVar.get`` (a graph break), but it
    reads and guards module-level attributes: a compiled region sees the context
    through this mirror, kept in step by :func:`dd_scope`. It is process-wide,
    so two threads compiling under different contexts at once would see the
    last one entered; eager code always reads the ContextVar.
    """

    ctx: DDContext = _INERT


_MIRROR = _Mirror()


def current_dd_context() -> DDContext:
    """The live context of the current forward; the inert context outside :func:`dd_scope`.

    The inert context has ``layout=None`` and a world of one: every verb is
    the identity there, so single-process code runs unchanged. Inside
    ``torch.compile`` the context is read from a guarded module attribute
    (recompiling when a context with a different layout type or row counts
    appears), so reading it costs no graph break.
    """
    if torch.compiler.is_compiling():
        return _MIRROR.ctx
    return _CURRENT.get()


@contextmanager
def dd_scope(ctx: DDContext | None) -> Iterator[DDContext]:
    """Make ``ctx`` the live context inside the ``with`` block (``None``: inert).

    Scopes nest; leaving one restores the previous context (also on error).
    The context lives in a :class:`contextvars.ContextVar`, so threads and
    asyncio tasks each see their own.
    """
    ctx = _INERT if ctx is None else ctx
    if not isinstance(ctx, DDContext):
        raise ConfigurationError(
            f"rank {get_rank()}: dd_scope needs a DDContext or None, got {type(ctx).__name__}"
        )
    token = _CURRENT.set(ctx)
    previous, _MIRROR.ctx = _MIRROR.ctx, ctx
    try:
        yield ctx
    finally:
        _MIRROR.ctx = previous
        _CURRENT.reset(token)
