"""`ParticleHaloConfig`: the sub-domain boxes, boundary conditions and ghost width."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nvdd.core import ConfigurationError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ParticleHaloConfig", "check_tiling"]


@dataclass(frozen=True, eq=False)
class ParticleHaloConfig:
    """Configuration of a particle halo: who owns which box, and how wide the halo is.

    Every rank builds the same config, so construction errors are local
    (:class:`~nvdd.core.ConfigurationError`) and need no collective.

    Parameters
    ----------
    boxes:
        Float tensor, shape ``(n_systems, world_size, 2, 3)``: per system and per
        rank the half-open fractional box ``[lo, hi)`` along the three cell axes
        (``boxes[s, r, 0]`` = lo, ``boxes[s, r, 1]`` = hi). Stored as float64 on
        the CPU. On a periodic axis lo/hi lie in ``[0, 1]`` and the boxes tile
        ``[0, 1)``; on an open axis fractional coordinates are unbounded
        (``frac = positions @ inv(cell)``, no origin shift), the boxes tile the
        whole real line (the outermost extend to ``-inf`` / ``+inf``) and inner
        cuts may lie anywhere. Grid cuts, uneven cuts and recursive-bisection
        boxes are all accepted; the tiling is checked exactly.
    pbc:
        Bool tensor, shape ``(n_systems, 3)``: periodic axes of every system.
    ghost_width:
        Halo width in Angstrom (a true distance, ``cutoff + skin``), > 0. It is
        turned into a fractional width per axis with the interplanar spacings of
        the current cell, so triclinic cells are handled. It may exceed a box's
        width or the cell length (multi-hop halos and several images per axis).
    group:
        Process group the boxes are indexed by (``None``: the default group).
    max_ghost_rows:
        Optional safety cap on the ghost rows one rank may send or receive in one
        plan; a plan that needs more raises
        :class:`~nvdd.core.CapacityOverflowError` on every rank. ``None``: no cap
        beyond the int32 indexing limit.
    wrapped:
        Optional bool tensor, shape ``(n_systems, 3)``: periodic axes whose
        periodicity the *model* applies (its neighbour list, with the real cell
        and pbc on that axis) instead of explicit image rows. Allowed only on an
        axis every box of the system spans whole (``[0, 1)``: the rank grid
        leaves it uncut); there the halo sends no image along it and treats it
        as unbounded, so ghost rows differ from their owners only along the
        other periodic axes. ``None`` (default): no such axis, explicit images
        on every periodic axis.

    Raises
    ------
    ConfigurationError
        On a malformed shape or dtype, a non-positive or non-finite
        ``ghost_width``, or boxes that do not tile a system's domain exactly
        (the message names the system and the offending boxes), or a
        ``wrapped`` axis that is open or cut by some box.
    """

    boxes: torch.Tensor
    pbc: torch.Tensor
    ghost_width: float
    group: ProcessGroup | None = field(default=None, repr=False)
    max_ghost_rows: int | None = None
    wrapped: torch.Tensor | None = None

    def __post_init__(self) -> None:
        boxes, pbc = self.boxes, self.pbc
        if not isinstance(boxes, torch.Tensor) or not boxes.is_floating_point():
            raise ConfigurationError(
                f"boxes must be a floating torch.Tensor, got {type(boxes).__name__}"
                + (f" of dtype {boxes.dtype}" if isinstance(boxes, torch.Tensor) else "")
            )
        if boxes.ndim != 4 or tuple(boxes.shape[2:]) != (2, 3) or boxes.shape[0] < 1:
            raise ConfigurationError(
                f"boxes has shape {tuple(boxes.shape)}, expected (n_systems, world_size, 2, 3)"
            )
        n_sys, world = int(boxes.shape[0]), int(boxes.shape[1])
        if world < 1:
            raise ConfigurationError(f"boxes has shape {tuple(boxes.shape)}: no rank")
        if not isinstance(pbc, torch.Tensor) or pbc.dtype != torch.bool:
            raise ConfigurationError(
                f"pbc must be a bool torch.Tensor, got "
                f"{pbc.dtype if isinstance(pbc, torch.Tensor) else type(pbc).__name__}"
            )
        if tuple(pbc.shape) != (n_sys, 3):
            raise ConfigurationError(f"pbc has shape {tuple(pbc.shape)}, expected ({n_sys}, 3)")
        gw = self.ghost_width
        if isinstance(gw, bool) or not isinstance(gw, int | float) or not math.isfinite(gw):
            raise ConfigurationError(f"ghost_width must be a finite number, got {gw!r}")
        if gw <= 0:
            raise ConfigurationError(f"ghost_width must be > 0 (Angstrom), got {gw}")
        cap = self.max_ghost_rows
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ConfigurationError(f"max_ghost_rows must be None or an int >= 0, got {cap!r}")
        boxes64 = boxes.detach().to("cpu", torch.float64).contiguous()
        pbc_cpu = pbc.detach().to("cpu").contiguous()
        object.__setattr__(self, "boxes", boxes64)
        object.__setattr__(self, "pbc", pbc_cpu)
        object.__setattr__(self, "ghost_width", float(gw))
        for s in range(n_sys):
            check_tiling(boxes64[s], pbc_cpu[s], system=s)
        if self.wrapped is not None:
            object.__setattr__(self, "wrapped", _check_wrapped(self.wrapped, boxes64, pbc_cpu))

    @property
    def image_pbc(self) -> torch.Tensor:
        """Bool, shape ``(n_systems, 3)``: the axes that get explicit image rows
        (``pbc`` without the ``wrapped`` axes)."""
        if self.wrapped is None:
            return self.pbc
        return self.pbc & ~self.wrapped

    @property
    def n_systems(self) -> int:
        """Number of systems the boxes describe."""
        return int(self.boxes.shape[0])

    @property
    def world_size(self) -> int:
        """Number of ranks (boxes per system)."""
        return int(self.boxes.shape[1])


def whole_axes(boxes: torch.Tensor, pbc: torch.Tensor) -> torch.Tensor:
    """Bool, shape ``(n_systems, 3)``: the periodic axes every box of a system
    spans whole (``lo == 0`` and ``hi == 1`` for every rank: the grid leaves the
    axis uncut). ``boxes``: shape ``(n_systems, world_size, 2, 3)``."""
    b = boxes.detach().to("cpu", torch.float64)
    spans = ((b[:, :, 0, :] == 0.0) & (b[:, :, 1, :] == 1.0)).all(dim=1)
    return spans & pbc.detach().to("cpu")


def _check_wrapped(wrapped: object, boxes: torch.Tensor, pbc: torch.Tensor) -> torch.Tensor:
    if not isinstance(wrapped, torch.Tensor) or wrapped.dtype != torch.bool:
        got = wrapped.dtype if isinstance(wrapped, torch.Tensor) else type(wrapped).__name__
        raise ConfigurationError(f"wrapped must be a bool torch.Tensor, got {got}")
    w = wrapped.detach().to("cpu").contiguous()
    if tuple(w.shape) != tuple(pbc.shape):
        raise ConfigurationError(
            f"wrapped has shape {tuple(w.shape)}, expected {tuple(pbc.shape)} (like pbc)"
        )
    bad = w & ~whole_axes(boxes, pbc)
    if bool(bad.any()):
        s, a = (int(v) for v in bad.nonzero()[0])
        why = "open" if not bool(pbc[s, a]) else "cut by the boxes"
        raise ConfigurationError(
            f"wrapped axis {a} of system {s} is {why}: only a periodic axis every box spans "
            "whole can be left to the model"
        )
    return w


def _fmt_box(boxes: torch.Tensor, r: int) -> str:
    lo, hi = boxes[r, 0].tolist(), boxes[r, 1].tolist()
    return f"rank {r} [{lo}, {hi})"


def check_tiling(boxes: torch.Tensor, pbc: torch.Tensor, *, system: int = 0) -> None:
    """Raise unless ``boxes`` tile one system's fractional domain exactly.

    The domain is ``[0, 1)`` on periodic axes and the real line on open axes.
    The check is exact (no tolerance): coordinates are replaced by their rank
    among the distinct cut values of their axis, which turns every box into an
    integer box with the same overlaps; then no two boxes may overlap and the
    integer volumes must add up to the whole grid of cut cells.

    Parameters
    ----------
    boxes:
        Float64, shape ``(world_size, 2, 3)``.
    pbc:
        Bool, shape ``(3,)``.
    system:
        Index used in error messages.

    Raises
    ------
    ConfigurationError
        Naming the system and the boxes at fault.
    """
    world = int(boxes.shape[0])
    lo, hi = boxes[:, 0, :], boxes[:, 1, :]
    where = f"boxes of system {system}"
    if bool(torch.isnan(boxes).any()):
        r = int(torch.isnan(boxes).reshape(world, -1).any(dim=1).nonzero()[0, 0])
        raise ConfigurationError(f"{where}: {_fmt_box(boxes, r)} holds NaN")
    for a in range(3):
        if bool(pbc[a]):
            bad = (lo[:, a] < 0) | (hi[:, a] > 1) | torch.isinf(lo[:, a]) | torch.isinf(hi[:, a])
            if bool(bad.any()):
                r = int(bad.nonzero()[0, 0])
                raise ConfigurationError(
                    f"{where}: axis {a} is periodic but {_fmt_box(boxes, r)} is not inside [0, 1]"
                )
            start, end = 0.0, 1.0
        else:
            start, end = -math.inf, math.inf
        empty = lo[:, a] >= hi[:, a]
        if bool(empty.any()):
            r = int(empty.nonzero()[0, 0])
            raise ConfigurationError(
                f"{where}: {_fmt_box(boxes, r)} is empty along axis {a} (needs lo < hi)"
            )
        if float(lo[:, a].min()) != start or float(hi[:, a].max()) != end:
            kind = "periodic: [0, 1)" if bool(pbc[a]) else "open: (-inf, +inf)"
            raise ConfigurationError(
                f"{where}: along axis {a} ({kind}) the boxes span "
                f"[{float(lo[:, a].min())}, {float(hi[:, a].max())}) instead of the whole axis"
            )

    # Exact integer geometry: each coordinate -> its index among the axis's cuts.
    ilo = torch.empty(world, 3, dtype=torch.int64)
    ihi = torch.empty(world, 3, dtype=torch.int64)
    cells = 1
    for a in range(3):
        cuts = torch.unique(torch.cat([lo[:, a], hi[:, a]]))
        ilo[:, a] = torch.searchsorted(cuts, lo[:, a].contiguous())
        ihi[:, a] = torch.searchsorted(cuts, hi[:, a].contiguous())
        cells *= int(cuts.numel()) - 1
    # Pairwise overlap of half-open integer boxes, in chunks to bound memory.
    chunk = max(1, (1 << 22) // max(world, 1))
    for start_row in range(0, world, chunk):
        rows = slice(start_row, min(world, start_row + chunk))
        inter = (ilo[rows, None, :] < ihi[None, :, :]) & (ilo[None, :, :] < ihi[rows, None, :])
        both = inter.all(dim=2)
        idx = torch.arange(rows.start, rows.stop)
        both[idx - rows.start, idx] = False
        if bool(both.any()):
            i, j = (int(v) for v in both.nonzero()[0])
            raise ConfigurationError(
                f"{where} overlap: {_fmt_box(boxes, i + rows.start)} and {_fmt_box(boxes, j)}"
            )
    volume = int(((ihi - ilo).prod(dim=1)).sum())
    if volume != cells:
        raise ConfigurationError(
            f"{where} leave a gap: they cover {volume} of the {cells} cells cut by their "
            f"faces (per-axis cuts: "
            f"{[torch.unique(torch.cat([lo[:, a], hi[:, a]])).tolist() for a in range(3)]})"
        )
