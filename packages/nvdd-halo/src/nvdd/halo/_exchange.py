"""Forward (owned -> ghost) and reverse (ghost -> owner sum) exchanges.

``Route`` holds what a plan fixed once (the send rows and the split sizes of
every peer); the exchanges below reuse it, so no count is ever exchanged again.
Forward and reverse are exact adjoints (a selection matrix and its transpose),
and each is the other's autograd backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nvdd.core import all_to_all_single
from nvdd.halo import _kernels
from nvdd.halo._packing import pack_rows, row_layout, unpack_rows

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Route", "forward_exchange", "forward_many", "reverse_exchange", "reverse_many"]

# Dtypes every backend moves natively; anything else travels as bytes.
_NATIVE = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8)
#: Fold ghost rows into owners with the Warp CSR kernel on these device types
#: (index_add_ elsewhere); see docs/fragments/nvdd-halo.md for the timings.
FOLD_WITH_WARP = ("cuda",)


@dataclass(eq=False)
class Route:
    """The fixed communication pattern of a plan.

    Attributes
    ----------
    send_index:
        int64, shape ``(n_send,)``: owned row of every row sent, grouped by
        destination rank.
    send_counts, recv_counts:
        Rows sent to / received from every rank of the group.
    n_owned, n_ghost:
        Rows of this rank's owned block and ghost block.
    group, world_size, comm_device:
        Where and how the collectives run.
    """

    send_index: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    n_owned: int
    n_ghost: int
    group: ProcessGroup | None
    world_size: int
    comm_device: torch.device
    _index_on: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)
    _sorted_on: dict[torch.device, tuple[torch.Tensor, ...]] = field(
        default_factory=dict, repr=False
    )

    def index_on(self, device: torch.device) -> torch.Tensor:
        """``send_index`` on ``device`` (cached)."""
        if device not in self._index_on:
            self._index_on[device] = self.send_index.to(device)
        return self._index_on[device]

    def sorted_on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(rows, src)``: the sent rows' owned rows sorted (stably) and, for
        each, its position among the sent rows (cached; no host read: the
        fold's runs of equal rows are found on the device)."""
        if device not in self._sorted_on:
            idx = self.index_on(device)
            perm = torch.argsort(idx, stable=True)
            self._sorted_on[device] = (idx[perm].contiguous(), perm.contiguous())
        return self._sorted_on[device]


def _all_to_all(route: Route, rows: torch.Tensor, forward: bool) -> torch.Tensor:
    """Move rows along the route; returns the other side's rows on rows' device.

    **Collective** over ``route.group``: every rank calls it with the same
    direction, trailing shape and dtype.
    """
    if route.world_size == 1:
        return rows
    send_counts, recv_counts = (
        (route.send_counts, route.recv_counts)
        if forward
        else (route.recv_counts, route.send_counts)
    )
    n_out = sum(recv_counts)
    trailing = tuple(rows.shape[1:])
    native = rows.dtype in _NATIVE
    buf = rows.to(route.comm_device).contiguous()
    if not native:
        buf = buf.reshape(int(buf.shape[0]), -1).view(torch.uint8)
    out = torch.empty((n_out, *buf.shape[1:]), dtype=buf.dtype, device=route.comm_device)
    all_to_all_single(out, buf, recv_counts, send_counts, group=route.group)
    if not native:
        out = out.view(rows.dtype).reshape(n_out, *trailing)
    return out.to(rows.device)


def _fold(route: Route, rows: torch.Tensor) -> torch.Tensor:
    """Sum sent-side rows ``(n_send, *f)`` into owned rows ``(n_owned, *f)``."""
    dev = rows.device
    out = torch.zeros((route.n_owned, *rows.shape[1:]), dtype=rows.dtype, device=dev)
    if rows.shape[0] == 0:
        return out
    if dev.type in FOLD_WITH_WARP and rows.dtype in (torch.float32, torch.float64):
        owner, src = route.sorted_on(dev)
        flat = rows.reshape(int(rows.shape[0]), -1).contiguous()
        _kernels.fold_rows(flat, owner, src, out.reshape(route.n_owned, -1))
        return out
    return out.index_add_(0, route.index_on(dev), rows)


def forward_raw(route: Route, x: torch.Tensor) -> torch.Tensor:
    """Owned rows ``(n_owned, *f)`` -> ghost rows ``(n_ghost, *f)``. **Collective**."""
    return _all_to_all(route, x.index_select(0, route.index_on(x.device)), forward=True)


def reverse_raw(route: Route, g: torch.Tensor) -> torch.Tensor:
    """Ghost rows ``(n_ghost, *f)`` -> owner sums ``(n_owned, *f)``. **Collective**."""
    return _fold(route, _all_to_all(route, g, forward=False))


def _forward_many_raw(route: Route, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if route.world_size == 1:
        idx = route.index_on(xs[0].device)
        return [x.index_select(0, idx) for x in xs]
    layout = row_layout([str(k) for k in range(len(xs))], xs)
    buf = pack_rows(xs, layout, index=route.index_on(xs[0].device), device=route.comm_device)
    return unpack_rows(_all_to_all(route, buf, forward=True), layout, device=xs[0].device)


def _reverse_many_raw(route: Route, gs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if route.world_size == 1:
        return [_fold(route, g) for g in gs]
    layout = row_layout([str(k) for k in range(len(gs))], gs)
    buf = pack_rows(gs, layout, device=route.comm_device)
    back = unpack_rows(_all_to_all(route, buf, forward=False), layout, device=gs[0].device)
    return [_fold(route, b) for b in back]


def _exchange_raw(route: Route, x: torch.Tensor, forward: bool) -> torch.Tensor:
    """:func:`forward_raw` or :func:`reverse_raw`. **Collective**."""
    return forward_raw(route, x) if forward else reverse_raw(route, x)


class _Exchange(torch.autograd.Function):
    """One exchange; its backward is the adjoint exchange (the other direction)."""

    @staticmethod
    def forward(ctx: Any, route: Route, x: torch.Tensor, forward: bool) -> torch.Tensor:
        ctx.route = route
        ctx.forward = forward
        return _exchange_raw(route, x, forward)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        return None, _exchange_raw(ctx.route, grad.contiguous(), not ctx.forward), None


def _zeros_for_missing(
    grads: Sequence[torch.Tensor | None],
    shapes: Sequence[tuple[tuple[int, ...], torch.dtype]],
    n_rows: int,
    device: torch.device,
) -> list[torch.Tensor]:
    """Every gradient contiguous; a missing one becomes zeros of ``(n_rows, *shape[1:])``."""
    return [
        torch.zeros((n_rows, *shape[1:]), dtype=dtype, device=device)
        if g is None
        else g.contiguous()
        for g, (shape, dtype) in zip(grads, shapes, strict=True)
    ]


class _ForwardMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, route: Route, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.route = route
        ctx.shapes = [(tuple(x.shape), x.dtype, x.is_floating_point()) for x in xs]
        outs = _forward_many_raw(route, xs)
        for o, (_, _, floating) in zip(outs, ctx.shapes, strict=True):
            if not floating:
                ctx.mark_non_differentiable(o)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        floats = [k for k, (_, _, fl) in enumerate(ctx.shapes) if fl]
        result: list[torch.Tensor | None] = [None] * len(ctx.shapes)
        if floats:
            gs = _zeros_for_missing(
                [grads[k] for k in floats],
                [ctx.shapes[k][:2] for k in floats],
                ctx.route.n_ghost,
                _device(grads),
            )
            for k, r in zip(floats, _reverse_many_raw(ctx.route, gs), strict=True):
                result[k] = r
        return (None, *result)


def _device(ts: Sequence[torch.Tensor | None]) -> torch.device:
    for t in ts:
        if t is not None:
            return t.device
    return torch.device("cpu")  # pragma: no cover - autograd passes at least one grad


class _ReverseMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, route: Route, *gs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.route = route
        ctx.shapes = [(tuple(g.shape), g.dtype) for g in gs]
        return tuple(_reverse_many_raw(route, gs))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        gs = _zeros_for_missing(grads, ctx.shapes, ctx.route.n_owned, _device(grads))
        return (None, *_forward_many_raw(ctx.route, gs))


def forward_exchange(route: Route, x: torch.Tensor) -> torch.Tensor:
    """Differentiable forward exchange (backward: :func:`reverse_exchange`)."""
    out: torch.Tensor = _Exchange.apply(route, x, True)  # type: ignore[no-untyped-call]
    return out


def reverse_exchange(route: Route, g: torch.Tensor) -> torch.Tensor:
    """Differentiable reverse exchange (backward: :func:`forward_exchange`)."""
    out: torch.Tensor = _Exchange.apply(route, g, False)  # type: ignore[no-untyped-call]
    return out


def forward_many(route: Route, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Several fields in one packed buffer and one collective; differentiable
    for floating fields."""
    return list(_ForwardMany.apply(route, *xs))  # type: ignore[no-untyped-call]


def reverse_many(route: Route, gs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Several floating fields folded to owners in one collective; differentiable."""
    return list(_ReverseMany.apply(route, *gs))  # type: ignore[no-untyped-call]
