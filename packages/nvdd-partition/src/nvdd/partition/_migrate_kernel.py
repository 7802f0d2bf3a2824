"""Where each owned atom goes at a migration: one Warp kernel (one system), or
torch operations (several systems).

``SpatialPartitioner._destinations`` as torch operations is about 130 kernel
launches and 350 operator calls over the atoms (two wrapping passes, the
fractional coordinates, the grown-box test with its periodic images, the
nearest image, the cut-table lookup), each paying host time on a GPU; a
timeline of a halo rebuild on one H200 showed the rebuild step bound by host
time (``docs/design.md``, "One Warp launcher"). Here one thread per atom does
the same arithmetic in float64:

1. wrap (two passes of ``lattice_shifts``: ``floor(frac)`` on periodic axes,
   except 0 for a point below a lower face by no more than ``tol``), each
   subtracting the lattice vectors in the positions' dtype;
2. the fractional coordinates of the wrapped position, clamped into ``[0, 1)``
   on periodic axes (``owner_fractional``);
3. kept while inside this rank's box grown by ``grow`` on every axis (with the
   images one period away on periodic axes when the hysteresis is positive);
4. a kept atom, with a positive hysteresis, moves to the periodic image nearest
   its box (``round(centre - frac)``, ties to even as ``torch.round``); a
   leaving atom's owner is found in the nested cut table (``CutTable.locate``:
   the count of inner cuts at or below the coordinate, per axis);
5. a row with a non-finite coordinate keeps its position and this rank.

The matrix products sum in a fixed order and may differ from torch's in the
last bit, so a point within rounding of a face can be wrapped or owned
differently from ``wrap_positions`` / ``owner_of``: every rank migrates with
this kernel, and the halo selects ghosts with a rounding margin, so either
side of such a face is a valid owner.
"""

# mypy: disable-error-code="valid-type,misc,no-untyped-def,untyped-decorator,arg-type,assignment,operator,index,no-any-return,name-defined,call-overload,attr-defined,return-value,call-arg,type-var"

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import warp as wp

from nvdd.core import RecordedKernel
from nvdd.partition._geometry import face_tolerance

if TYPE_CHECKING:
    from nvdd.partition._state import _State

__all__ = ["Partitioner", "destinations_kernel", "kernel_destinations", "torch_destinations"]


class Partitioner(Protocol):
    """What the migration reads of a :class:`~nvdd.partition.SpatialPartitioner`
    (typed here: ``_spatial`` imports this module, not the reverse)."""

    _s: _State
    _on_device: dict[tuple[torch.device, object], tuple[torch.Tensor, ...]]

    @property
    def n_systems(self) -> int: ...

    def _domain_on(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]: ...

    def domain_cell(self, cell: torch.Tensor | None = None) -> torch.Tensor: ...

    def wrap_positions(
        self,
        positions: torch.Tensor,
        system_index: torch.Tensor | None = None,
        *,
        cell: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def _frac(
        self,
        positions: torch.Tensor,
        si: torch.Tensor,
        cell: torch.Tensor | None,
        *,
        wrapped: bool = False,
    ) -> torch.Tensor: ...

    def _keeps(
        self,
        frac: torch.Tensor,
        si: torch.Tensor,
        owner: torch.Tensor | int,
        h: float,
        cell: torch.Tensor | None,
    ) -> torch.Tensor: ...

    def _locate(self, frac: torch.Tensor, si: torch.Tensor) -> torch.Tensor: ...


_F64 = wp.float64


@wp.func
def _inner_count(x: _F64, cuts: Any, n: int) -> int:
    """How many of ``cuts[1 .. n-1]`` (the inner cuts of ``n`` boxes) are <= ``x``."""
    count = int(0)  # noqa: UP018, RUF046 (a dynamic variable in Warp's kernel language)
    for m in range(1, n):
        if cuts[m] <= x:
            count = count + 1
    return count


@wp.kernel
def destinations_kernel(
    positions: wp.array2d(dtype=Any),
    domain: wp.array2d(dtype=_F64),
    inverse: wp.array2d(dtype=_F64),
    periodic: wp.array(dtype=wp.int32),
    tol: _F64,
    box: wp.array2d(dtype=_F64),
    grow: wp.array(dtype=_F64),
    images: wp.int32,
    rank: wp.int32,
    c0: wp.array(dtype=_F64),
    c1: wp.array2d(dtype=_F64),
    c2: wp.array3d(dtype=_F64),
    wrapped: wp.array2d(dtype=Any),
    dest: wp.array(dtype=wp.int64),
):
    i = wp.tid()
    x = wp.vector(positions[i, 0], positions[i, 1], positions[i, 2])
    if not (wp.isfinite(x[0]) and wp.isfinite(x[1]) and wp.isfinite(x[2])):
        for b in range(3):
            wrapped[i, b] = x[b]
        dest[i] = wp.int64(rank)
        return
    zero = _F64(0.0)
    f = wp.vector(zero, zero, zero)
    for _ in range(2):
        for a in range(3):
            f[a] = (
                _F64(x[0]) * inverse[0, a] + _F64(x[1]) * inverse[1, a] + _F64(x[2]) * inverse[2, a]
            )
        s = wp.vector(zero, zero, zero)
        for a in range(3):
            near = f[a] < zero and f[a] >= -tol
            if periodic[a] != 0 and not near:
                s[a] = wp.floor(f[a])
        for b in range(3):
            delta = s[0] * domain[0, b] + s[1] * domain[1, b] + s[2] * domain[2, b]
            x[b] = x[b] - type(x[b])(delta)
    below_one = _F64(1.0) - _F64(1.1102230246251565e-16)  # 1 - eps(float64) / 2
    keep = bool(True)  # noqa: UP018 (a dynamic variable in Warp's kernel language)
    for a in range(3):
        f[a] = _F64(x[0]) * inverse[0, a] + _F64(x[1]) * inverse[1, a] + _F64(x[2]) * inverse[2, a]
        if periodic[a] != 0:
            f[a] = wp.min(wp.max(f[a], zero), below_one)
        lo = box[0, a] - grow[a]
        hi = box[1, a] + grow[a]
        inside = f[a] >= lo and f[a] < hi
        if images != 0 and periodic[a] != 0:
            down = f[a] + _F64(-1.0)
            up = f[a] + _F64(1.0)
            inside = inside or (down >= lo and down < hi) or (up >= lo and up < hi)
        keep = keep and inside
    if keep:
        if images != 0:
            s = wp.vector(zero, zero, zero)
            for a in range(3):
                if periodic[a] != 0:  # ties to even, as torch.round
                    s[a] = wp.rint(_F64(0.5) * (box[0, a] + box[1, a]) - f[a])
            for b in range(3):  # (the product in the positions' dtype, as torch)
                e0 = type(x[b])(s[0]) * type(x[b])(domain[0, b])
                e1 = type(x[b])(s[1]) * type(x[b])(domain[1, b])
                e2 = type(x[b])(s[2]) * type(x[b])(domain[2, b])
                x[b] = x[b] + (e0 + e1 + e2)
        dest[i] = wp.int64(rank)
    else:
        p1 = c1.shape[1] - 1
        p2 = c2.shape[2] - 1
        ii = _inner_count(f[0], c0, c0.shape[0] - 1)
        jj = _inner_count(f[1], c1[ii], p1)
        kk = _inner_count(f[2], c2[ii, jj], p2)
        dest[i] = wp.int64((ii * p1 + jj) * p2 + kk)
    for b in range(3):
        wrapped[i, b] = x[b]


_KERNEL = RecordedKernel(destinations_kernel, doubles=(4,))


def kernel_destinations(
    part: Partitioner,
    positions: torch.Tensor,
    rank: int,
    h: float,
    cell: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(wrapped positions, new owner)`` of this rank's atoms of ``part``'s one
    system: the domain cell of ``cell`` and its inverse (one ``inv_ex``, no host
    read), this rank's box, the pbc and the cut table (copied to the device
    once); ``h`` (Angstrom) converted per axis as ``SpatialPartitioner._keeps``
    does. Non-finite rows keep their position and ``rank``."""
    dev = positions.device
    _, _, boxes = part._domain_on(dev, torch.float64)
    key = (dev, "migration")
    fixed = part._on_device.get(key)
    if fixed is None:  # (pbc as int32, the full cut table in float64)
        table = part._s.tables[0]
        fixed = (part._s.pbc[0].to(dev, torch.int32),
                 *(c.to(dev, torch.float64).contiguous() for c in (table.c0, table.c1, table.c2)))  # fmt: skip
        part._on_device[key] = fixed
    domain = part.domain_cell(cell).to(dev, torch.float64)[0].contiguous()
    inverse = torch.linalg.inv_ex(domain).inverse.contiguous()
    # h / interplanar spacing, with the spacing's own rounding (as _keeps)
    grow = (h / (1.0 / torch.linalg.vector_norm(inverse, dim=0))).contiguous()
    pos = positions.detach().contiguous()
    n = int(pos.shape[0])
    wrapped = torch.empty_like(pos)
    dest = torch.empty(n, dtype=torch.int64, device=dev)
    args = [pos, domain, inverse, fixed[0], face_tolerance(pos.dtype), boxes[0, rank].contiguous(),
            grow, int(h > 0.0), int(rank), *fixed[1:], wrapped, dest]  # fmt: skip
    _KERNEL.declare_overloads()  # (before the module's first launch)
    _KERNEL(n, args, dev)
    return wrapped, dest


def torch_destinations(
    part: Partitioner,
    positions: torch.Tensor,
    si: torch.Tensor,
    rank: int,
    h: float,
    cell: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernel_destinations` as torch operations, any number of systems
    (every branch a ``torch.where``: no host read)."""
    wrapped = part.wrap_positions(positions, si, cell=cell)
    frac = part._frac(wrapped, si, cell, wrapped=True)
    keep = part._keeps(frac, si, rank, h, cell)
    if h > 0:
        wrapped = _nearest_image(part, wrapped, frac, si, rank, keep, cell)
    dest = torch.where(keep, torch.full_like(si, rank), part._locate(frac, si))
    bad = ~torch.isfinite(positions).all(dim=1)
    return torch.where(bad[:, None], positions, wrapped), torch.where(bad, rank, dest)


def _nearest_image(
    part: Partitioner,
    wrapped: torch.Tensor,
    frac: torch.Tensor,
    si: torch.Tensor,
    rank: int,
    keep: torch.Tensor,
    cell: torch.Tensor | None,
) -> torch.Tensor:
    """Kept atoms moved to the periodic image nearest their owner's box (the
    halo selects their ghosts around that box, not where they wrapped to)."""
    _, pbc, boxes = part._domain_on(frac.device, torch.float64)
    if part.n_systems == 1:
        box, periodic = boxes[0, rank], pbc[0] & keep[:, None]  # box broadcasts
        centre = 0.5 * (box[0] + box[1])
    else:
        box, periodic = boxes[si, rank], pbc[si] & keep[:, None]  # (n, 2, 3)
        centre = 0.5 * (box[:, 0] + box[:, 1])
    shift = torch.where(periodic, torch.round(centre - frac), torch.zeros_like(frac))
    dom = part.domain_cell(cell).to(wrapped)
    # a zero shift adds an exact zero: atoms not moved keep their bits
    if part.n_systems == 1:
        return wrapped + shift.to(wrapped.dtype) @ dom[0]
    return wrapped + torch.bmm(shift.to(wrapped.dtype).unsqueeze(1), dom[si]).squeeze(1)
