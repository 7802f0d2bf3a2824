"""`HaloPlan` and `build_halo_plan`: explicit-image ghosts and their exchanges.

The plan selects the ghosts once per build; its exchanges run every step:
forward (owned -> ghost) and reverse (ghost -> owner sum). ``Route`` (below,
before the plan) holds what a plan fixed once (the send rows and the split sizes of
every peer); the exchanges below reuse it, so no count is ever exchanged again.
Forward and reverse are exact adjoints (a selection matrix and its transpose),
and each is the other's autograd backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nvdd.core import (
    CapacityOverflowError,
    ConfigurationError,
    ValidationError,
    all_to_all_single,
    comm_device,
    get_rank,
    get_world_size,
    raise_if_any_rank,
)
from nvdd.halo import _kernels
from nvdd.halo._config import ParticleHaloConfig
from nvdd.halo._kernels import META_ID, META_IMAGE, META_ROW, META_SYSTEM, META_WIDTH
from nvdd.halo._packing import pack_rows, row_layout, unpack_rows
from nvdd.halo._select import Failure, SelectBackend, check_plan_inputs, select_ghosts

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "HaloPlan",
    "Route",
    "build_halo_plan",
    "forward_exchange",
    "forward_many",
    "image_shift",
    "reverse_exchange",
    "reverse_many",
]

# ------------------------------------------------------------- the exchanges

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


# ------------------------------------------------------------------ the plan


def image_shift(image: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
    """``image @ cell`` row by row: ``(n, 3)`` images times one ``(3, 3)`` cell
    or a ``(n, 3, 3)`` cell per row (differentiable in both).

    Elementwise (one product, one sum over three terms) rather than a matrix
    product: for ``(n, 3) @ (3, 3)`` cuBLAS picks a tiled GEMM kernel that took
    40 us a step for the 112k ghost rows of a 4M-atom LJ rank on an H100
    (record 0095), where these two kernels read and write a few megabytes.
    """
    if cell.dim() == 2:
        cell = cell.unsqueeze(0)
    return (image.unsqueeze(-1) * cell).sum(-2)


class HaloPlan:
    """Which rows every rank sends where, with which periodic image; and the exchanges.

    Built by :func:`build_halo_plan`; reused until the next rebuild. The padded
    layout of every per-atom tensor on this rank is ``[owned | ghost]``: rows
    ``[0, n_owned)`` are this rank's atoms, rows ``[n_owned, n_padded)`` are
    ghost copies (explicit periodic images, LAMMPS-style), so a model can run
    with open boundaries on the padded rows.

    Attributes
    ----------
    n_owned, n_ghost, n_padded:
        Row counts of the owned block, the ghost block and both.
    ghost_atom_ids:
        int64, shape ``(n_ghost,)``: global id of every ghost's atom.
    ghost_owner_rank, ghost_owner_row:
        int64, shape ``(n_ghost,)``: the rank owning the atom and its owned row
        there.
    ghost_image:
        int64, shape ``(n_ghost, 3)``: the periodic image ``n`` of the ghost,
        whose position is ``owner position + n @ cell`` (non-zero only on
        periodic axes).
    ghost_system_index:
        int64, shape ``(n_ghost,)``: system of every ghost.
    group:
        The process group of the plan.
    explicit_images:
        True for a spatial halo (ghost rows are periodic images placed where
        they interact: a model runs on the padded rows with open boundaries);
        False for a plan of :func:`~nvdd.halo.build_request_plan` (ghost rows are
        the atoms themselves: the model applies the real cell and pbc).
    periodic_axes:
        ``None``, or bool of shape ``(n_systems, 3)`` on the CPU: the axes of a
        spatial halo whose periodicity the model applies
        (``ParticleHaloConfig.wrapped``: axes the rank grid leaves whole). The
        padded rows are then periodic along exactly these axes (with the real
        cell) and open along the others; ``None``: open along every axis.

    Notes
    -----
    Ghost rows are ordered by source rank, then source row, then image
    (lexicographic). Split sizes were exchanged once at build time; every
    exchange is one ``all_to_all_single``. The exchange methods are
    **Collective** over ``group``: every rank of the group calls the same method
    with the same trailing shapes and dtypes. Their input checks are local unless
    the config asked for ``sync_checks``.
    """

    def __init__(
        self,
        route: Route,
        *,
        rank: int,
        ghost_atom_ids: torch.Tensor,
        ghost_owner_rank: torch.Tensor,
        ghost_owner_row: torch.Tensor,
        ghost_image: torch.Tensor,
        ghost_system_index: torch.Tensor,
        n_systems: int,
        sync_checks: bool = False,
        explicit_images: bool = True,
        periodic_axes: torch.Tensor | None = None,
    ) -> None:
        self._route = route
        self.explicit_images = explicit_images
        self.periodic_axes = periodic_axes
        self.rank = rank
        self.ghost_atom_ids = ghost_atom_ids
        self.ghost_owner_rank = ghost_owner_rank
        self.ghost_owner_row = ghost_owner_row
        self.ghost_image = ghost_image
        self.ghost_system_index = ghost_system_index
        self.n_systems = n_systems
        self.sync_checks = sync_checks
        self._images: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def __repr__(self) -> str:
        return (
            f"HaloPlan(rank={self.rank}, world_size={self.world_size}, n_owned={self.n_owned}, "
            f"n_ghost={self.n_ghost}, send_counts={self.send_counts})"
        )

    # -- sizes ----------------------------------------------------------------
    @property
    def n_owned(self) -> int:
        """Rows of the owned block."""
        return self._route.n_owned

    @property
    def n_ghost(self) -> int:
        """Rows of the ghost block."""
        return self._route.n_ghost

    @property
    def n_padded(self) -> int:
        """``n_owned + n_ghost``."""
        return self._route.n_owned + self._route.n_ghost

    @property
    def group(self) -> ProcessGroup | None:
        """The process group (``None``: the default group)."""
        return self._route.group

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._route.world_size

    @property
    def send_counts(self) -> tuple[int, ...]:
        """Rows this rank sends to every rank in a forward exchange."""
        return tuple(self._route.send_counts)

    @property
    def recv_counts(self) -> tuple[int, ...]:
        """Ghost rows this rank receives from every rank."""
        return tuple(self._route.recv_counts)

    @property
    def send_index(self) -> torch.Tensor:
        """int64, shape ``(n_send,)``: owned row of every row sent, by destination."""
        return self._route.send_index

    # -- checks ---------------------------------------------------------------
    def _rows_check(self, name: str, x: object, rows: int, what: str) -> str | None:
        if not isinstance(x, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(x).__name__}"
        if x.ndim < 1 or int(x.shape[0]) != rows:
            return f"{name} has shape {tuple(x.shape)}, expected first dimension {rows} ({what})"
        return None

    def _rows_check_many(self, name: str, xs: Sequence[object], rows: int, what: str) -> str | None:
        msg = None
        for k, x in enumerate(xs):
            msg = msg or self._rows_check(f"{name} input {k}", x, rows, what)
        return msg

    def _raise(self, message: str | None) -> None:
        if self.sync_checks:
            raise_if_any_rank(message, self.group)
        elif message is not None:
            raise ValidationError(f"rank {self.rank}: {message}")

    def _require_rows(self, name: str, x: object, rows: int, what: str) -> None:
        """:meth:`_raise` the :meth:`_rows_check` of one input (**Collective** with
        ``sync_checks``)."""
        self._raise(self._rows_check(name, x, rows, what))

    # -- exchanges ------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Owned rows -> ghost rows: every ghost gets its owner row's value.

        **Collective** over ``group``. Differentiable; its backward is
        :meth:`reverse`.

        Parameters
        ----------
        x:
            Shape ``(n_owned, *f)``, any dtype.

        Returns
        -------
        torch.Tensor
            Shape ``(n_ghost, *f)``, on ``x``'s device.
        """
        self._require_rows("forward input", x, self.n_owned, "n_owned")
        return forward_exchange(self._route, x)

    def forward_many(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`forward` of several fields in one packed buffer and one collective.

        **Collective** over ``group``. Fields may differ in dtype and trailing
        shape; they must share a device. Differentiable for floating fields.

        Parameters
        ----------
        xs:
            Tensors of shape ``(n_owned, *f_k)``.

        Returns
        -------
        list of torch.Tensor
            Shapes ``(n_ghost, *f_k)``.
        """
        msg = self._rows_check_many("forward_many", xs, self.n_owned, "n_owned")
        if msg is None and len({x.device for x in xs}) > 1:
            msg = f"forward_many inputs are on several devices: {[str(x.device) for x in xs]}"
        self._raise(msg)
        return forward_many(self._route, list(xs)) if xs else []

    def reverse(self, g: torch.Tensor) -> torch.Tensor:
        """Ghost rows -> owner rows: every ghost row is summed into its owner row.

        **Collective** over ``group``. The exact adjoint of :meth:`forward`
        (``<forward(x), y> == <x, reverse(y)>`` summed over ranks) and its
        autograd backward. The sum order is fixed (deterministic).

        Parameters
        ----------
        g:
            Shape ``(n_ghost, *f)``.

        Returns
        -------
        torch.Tensor
            Shape ``(n_owned, *f)``: zeros where an owned row has no ghost.
        """
        self._require_rows("reverse input", g, self.n_ghost, "n_ghost")
        return reverse_exchange(self._route, g)

    def reverse_many(self, gs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`reverse` of several fields in one packed buffer and one collective.

        **Collective** over ``group``. Differentiable.
        """
        self._raise(self._rows_check_many("reverse_many", gs, self.n_ghost, "n_ghost"))
        return reverse_many(self._route, list(gs)) if gs else []

    def ghost_image_as(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``ghost_image`` converted to ``dtype`` on ``device`` (cached)."""
        key = (dtype, device)
        if key not in self._images:
            self._images[key] = self.ghost_image.to(device=device, dtype=dtype)
        return self._images[key]

    def ghost_positions(self, positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        """Positions of the ghosts: owner position + ``ghost_image @ cell``.

        **Collective** over ``group``. The image shift is recomputed from the
        current ``cell``, so a changing cell needs no rebuild. Differentiable
        with respect to ``positions`` and ``cell``.

        Parameters
        ----------
        positions:
            Owned positions, shape ``(n_owned, 3)``.
        cell:
            Shape ``(n_systems, 3, 3)``, rows are lattice vectors.

        Returns
        -------
        torch.Tensor
            Shape ``(n_ghost, 3)``.
        """
        msg = self._rows_check("positions", positions, self.n_owned, "n_owned")
        if msg is None and (
            not isinstance(cell, torch.Tensor) or tuple(cell.shape) != (self.n_systems, 3, 3)
        ):
            shape = tuple(cell.shape) if isinstance(cell, torch.Tensor) else type(cell).__name__
            msg = f"cell has shape {shape}, expected ({self.n_systems}, 3, 3)"
        self._raise(msg)
        ghosts = forward_exchange(self._route, positions)  # (the rows checked just above)
        image = self.ghost_image_as(cell.dtype, cell.device)
        if self.n_systems == 1:
            shift = image_shift(image, cell[0])
        else:
            sys_idx = self.ghost_system_index.to(cell.device)
            shift = image_shift(image, cell[sys_idx])
        return ghosts + shift.to(ghosts.dtype)

    # -- the halo-layout protocol of nvdd-shardtensor ---------------------------
    def owned(self, x_padded: torch.Tensor) -> torch.Tensor:
        """The owned rows ``x_padded[:n_owned]`` (a view)."""
        return x_padded[: self.n_owned]

    def pad(self, x_owned: torch.Tensor) -> torch.Tensor:
        """``cat([x_owned, forward(x_owned)])``, shape ``(n_padded, *f)``. **Collective**."""
        return torch.cat([x_owned, self.forward(x_owned)])

    def refresh(self, x_padded: torch.Tensor) -> torch.Tensor:
        """Fresh ghost rows from the owned rows; the input's ghost rows are ignored.

        **Collective** over ``group``. Autograd-aware.

        Parameters
        ----------
        x_padded:
            Shape ``(n_padded, *f)``.

        Returns
        -------
        torch.Tensor
            ``cat([x[:n_owned], forward(x[:n_owned])])``.
        """
        self._require_rows("refresh input", x_padded, self.n_padded, "n_padded")
        return self.pad(self.owned(x_padded))

    def fold(self, x_padded: torch.Tensor) -> torch.Tensor:
        """Sum ghost rows into their owners, then refresh the ghosts.

        **Collective** over ``group`` (two exchanges). Autograd-aware.

        Parameters
        ----------
        x_padded:
            Shape ``(n_padded, *f)``.

        Returns
        -------
        torch.Tensor
            ``cat([owned, forward(owned)])`` with
            ``owned = x[:n_owned] + reverse(x[n_owned:])``.
        """
        self._require_rows("fold input", x_padded, self.n_padded, "n_padded")
        owned = self.owned(x_padded) + self.reverse(x_padded[self.n_owned :])
        return self.pad(owned)


def _header_exchange(
    send_counts: torch.Tensor, failure: Failure, group: ProcessGroup | None, world: int
) -> tuple[torch.Tensor, Failure]:
    """One all_to_all of ``[rows for you, my failure kind]``; every rank learns
    every rank's failure kind in the same collective that carries the counts."""
    header = torch.stack([send_counts, torch.full_like(send_counts, int(failure))], dim=1)
    if world == 1:
        return header[:, 0].clone(), failure
    dev = comm_device(group)
    received = torch.empty(world, 2, dtype=torch.int64, device=dev)
    all_to_all_single(received, header.to(dev), group=group)
    received = received.cpu()
    return received[:, 0].contiguous(), Failure(int(received[:, 1].max()))


def build_halo_plan(
    config: ParticleHaloConfig,
    positions: torch.Tensor,
    atom_ids: torch.Tensor,
    system_index: torch.Tensor,
    cell: torch.Tensor,
    *,
    backend: SelectBackend | str = SelectBackend.WARP,
    sync_checks: bool = False,
) -> HaloPlan:
    """Build the halo plan of this rank's owned atoms.

    **Collective** over ``config.group``: every rank calls it once per rebuild.
    Two ``all_to_all_single`` calls: a header (ghost-row counts per peer plus a
    failure flag, so bad input on any rank raises on every rank with no extra
    collective) and the ghost metadata (owner row, image, atom id, system).

    For every owned atom and every rank whose box, expanded by the fractional
    ghost width of each axis, contains a periodic image of the atom (image
    offsets only on periodic axes that are not ``config.wrapped``), that rank
    receives one ghost row per image,
    including this rank's own atoms across periodic faces, but never the image
    ``n = 0`` to this rank (that is the owned row). Any ``ghost_width`` works:
    ranks beyond the adjacent ones and several images per axis are included.

    Parameters
    ----------
    config:
        The boxes, pbc, ghost width and group (same on every rank).
    positions:
        float32/64, shape ``(n_owned, 3)``: this rank's owned atoms. They need
        not be wrapped: images are relative to the positions as given, and
        :meth:`HaloPlan.ghost_positions` applies the same images later. (At a
        rebuild the partitioner wraps and migrates, so owned atoms lie in their
        own box; an atom outside it is still ghosted correctly.)
    atom_ids:
        int64, shape ``(n_owned,)``: global ids.
    system_index:
        int64, shape ``(n_owned,)``: system of every atom.
    cell:
        Shape ``(n_systems, 3, 3)``, positions' dtype and device, rows are
        lattice vectors, non-singular on all three axes (the partitioner
        supplies a synthetic vector on open axes; image shifts there are zero).
    backend:
        ``"warp"`` (default) or ``"torch"``: implementation of the selection
        kernels (same results).
    sync_checks:
        When True, every exchange of the plan first all-reduces its input check,
        so a malformed input on one rank raises on every rank (one more small
        collective per call). Off by default: exchange inputs are shaped by code
        that runs the same on every rank.

    Returns
    -------
    HaloPlan

    Raises
    ------
    ConfigurationError
        Locally, when the config's world size is not the group's.
    ValidationError
        On every rank together, for malformed inputs, non-finite positions or a
        singular cell on any rank (the message names the rank and the value).
    CapacityOverflowError
        On every rank together, when a rank's ghost rows exceed
        ``config.max_ghost_rows`` or the indexing limits.
    """
    group = config.group
    world, rank = get_world_size(group), get_rank(group)
    if world != config.world_size:
        raise ConfigurationError(
            f"rank {rank}: config has boxes for {config.world_size} ranks, the group has {world}"
        )
    backend = SelectBackend(backend)
    message = check_plan_inputs(config, positions, atom_ids, system_index, cell)
    failure = Failure.INVALID if message is not None else Failure.NONE
    selection = None
    if message is None:
        selection, failure, message = select_ghosts(
            config, positions, atom_ids, system_index, cell, rank, backend
        )
    send_counts = selection.send_counts if selection is not None else torch.zeros(world).long()
    recv_counts, worst = _header_exchange(send_counts, failure, group, world)
    if worst is not Failure.NONE or selection is None:
        exc = CapacityOverflowError if worst is Failure.CAPACITY else ValidationError
        raise_if_any_rank(message, group, exc_type=exc)
        raise exc(f"rank {rank}: halo plan failed")  # pragma: no cover - raised above
    limit = config.max_ghost_rows
    if limit is not None and world > 1:
        n_recv = int(recv_counts.sum())
        over = f"{n_recv} ghost rows to receive exceed max_ghost_rows = {limit}"
        raise_if_any_rank(over if n_recv > limit else None, group, exc_type=CapacityOverflowError)

    dev = positions.device
    meta = selection.meta
    send_list, recv_list = send_counts.tolist(), recv_counts.tolist()
    if world == 1:
        recv = meta
    else:
        cdev = comm_device(group)
        recv = torch.empty(sum(recv_list), META_WIDTH, dtype=torch.int64, device=cdev)
        all_to_all_single(recv, meta.to(cdev), recv_list, send_list, group=group)
        recv = recv.to(dev)
    # built on the atoms' device: only the world-sized counts cross from the host
    owner_rank = torch.repeat_interleave(
        torch.arange(world, dtype=torch.int64, device=dev),
        torch.as_tensor(recv_list, dtype=torch.int64).to(dev),
        output_size=int(recv.shape[0]),
    )
    route = Route(
        send_index=meta[:, META_ROW].contiguous(),
        send_counts=send_list,
        recv_counts=recv_list,
        n_owned=int(positions.shape[0]),
        n_ghost=int(recv.shape[0]),
        group=group,
        world_size=world,
        comm_device=comm_device(group),
    )
    return HaloPlan(
        route,
        rank=rank,
        ghost_atom_ids=recv[:, META_ID].contiguous(),
        ghost_owner_rank=owner_rank,
        ghost_owner_row=recv[:, META_ROW].contiguous(),
        ghost_image=recv[:, META_IMAGE : META_IMAGE + 3].contiguous(),
        ghost_system_index=recv[:, META_SYSTEM].contiguous(),
        n_systems=config.n_systems,
        sync_checks=sync_checks,
        periodic_axes=config.wrapped
        if config.wrapped is not None and config.wrapped.any()
        else None,
    )
