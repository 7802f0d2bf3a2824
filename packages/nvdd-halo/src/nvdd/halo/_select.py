"""Ghost selection on one rank: which owned rows go to which rank, with which image.

Local work only (no collective): geometry of the expanded boxes, candidate
ranks, then the count / prefix-sum / fill kernels. Problems are returned as
messages so that the caller can share them with every rank before raising.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nvdd.halo import _kernels, _reference
from nvdd.halo._config import ParticleHaloConfig

__all__ = [
    "Failure",
    "SelectBackend",
    "Selection",
    "check_plan_inputs",
    "check_plan_values",
    "expanded_boxes",
    "fractional_widths",
    "rounding_margin",
    "select_ghosts",
]

#: A cell is singular when |det| <= this * |a| |b| |c|.
_SINGULAR_RTOL = 1e-10
#: Margin (fractional units) that makes the candidate-rank pruning conservative.
_CANDIDATE_MARGIN = 1e-4


class Failure(enum.IntEnum):
    """Kind of a local failure, ordered by precedence when ranks disagree."""

    NONE = 0
    INVALID = 1
    CAPACITY = 2


class SelectBackend(enum.Enum):
    """Implementation of the selection kernels."""

    WARP = "warp"
    TORCH = "torch"


@dataclass(frozen=True)
class Selection:
    """What one rank sends.

    Attributes
    ----------
    meta:
        int64, shape ``(n_send, 6)``: ``[row, n0, n1, n2, atom_id, system]`` per
        ghost row, grouped by destination rank (ascending), then row, then image.
    send_counts:
        int64 on CPU, shape ``(world_size,)``: rows for each destination.
    """

    meta: torch.Tensor
    send_counts: torch.Tensor


def fractional_widths(cell: torch.Tensor, ghost_width: float) -> torch.Tensor:
    """Ghost width per cell axis in fractional units, shape ``(n_systems, 3)``.

    Along axis ``a`` it is ``ghost_width / d_a`` with ``d_a`` the spacing of the
    lattice planes spanned by the other two vectors; ``1 / d_a`` is the norm of
    column ``a`` of ``inv(cell)`` (the reciprocal vector), which makes the
    expanded box right for triclinic cells.
    """
    inv = torch.linalg.inv(cell.to(torch.float64))
    norms: torch.Tensor = torch.linalg.vector_norm(inv, dim=1)
    return ghost_width * norms


def rounding_margin(dtype: torch.dtype, frac_magnitude: float) -> float:
    """Fractional margin added to every expanded box, covering rounding.

    Ownership, fractional coordinates and model distances are each computed in
    floating point, so an image exactly at the ghost width (or an owned atom
    exactly on a face) can land on either side of an exact test. Selecting ghosts
    a few units in the last place beyond the ghost width is always safe (a model
    only keeps pairs within its cutoff), while dropping one loses a pair: the
    margin is ``64 eps(dtype) (1 + |frac|)``, about ``3e-14`` of a cell length
    in float64 and ``1.5e-5`` in float32.
    """
    return 64.0 * torch.finfo(dtype).eps * (1.0 + frac_magnitude)


def expanded_boxes(
    config: ParticleHaloConfig, cell: torch.Tensor, margin: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Boxes grown by the fractional ghost width plus ``margin``: the closed
    intervals ``[lo - w - margin, hi + w + margin]`` as the half-open
    ``[lo - w - margin, hi + w + margin)`` the kernels test (the margin makes
    the difference immaterial).

    Returns float64 CPU tensors of shape ``(n_systems, world_size, 3)``. Along
    an axis of ``config.wrapped`` (periodicity left to the model) every box is
    the whole line ``(-inf, +inf)``: one row per atom, image 0.
    """
    w = fractional_widths(cell.detach().cpu(), config.ghost_width)[:, None, :] + margin
    lo, hi = config.boxes[:, :, 0, :] - w, config.boxes[:, :, 1, :] + w
    if config.wrapped is None:
        return lo, hi
    whole = config.wrapped[:, None, :]
    return lo.masked_fill(whole, -torch.inf), hi.masked_fill(whole, torch.inf)


def check_plan_inputs(
    config: ParticleHaloConfig,
    positions: object,
    atom_ids: object,
    system_index: object,
    cell: object,
) -> str | None:
    """What is wrong with this rank's plan inputs (None when nothing is): their
    types, shapes, dtypes and devices, read on the host without touching the
    device. Their values (system indices in range, a finite non-singular cell)
    are checked by :func:`select_ghosts` with the flags it reads anyway
    (:func:`check_plan_values`)."""
    if not isinstance(positions, torch.Tensor):
        return f"positions must be a torch.Tensor, got {type(positions).__name__}"
    if positions.dtype not in (torch.float32, torch.float64):
        return f"positions has dtype {positions.dtype}, expected float32 or float64"
    if positions.ndim != 2 or positions.shape[1] != 3:
        return f"positions has shape {tuple(positions.shape)}, expected (n_owned, 3)"
    n, dev, s = int(positions.shape[0]), positions.device, config.n_systems
    for name, t in (("atom_ids", atom_ids), ("system_index", system_index)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (n,):
            what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
            return f"{name} is {what}, expected int64 of shape ({n},)"
        if t.device != dev:
            return f"{name} is on {t.device}, positions on {dev}"
    if not isinstance(cell, torch.Tensor) or tuple(cell.shape) != (s, 3, 3):
        shape = tuple(cell.shape) if isinstance(cell, torch.Tensor) else type(cell).__name__
        return f"cell has shape {shape}, expected ({s}, 3, 3) (n_systems of the config)"
    if cell.dtype != positions.dtype or cell.device != dev:
        return f"cell is {cell.dtype} on {cell.device}, positions {positions.dtype} on {dev}"
    return None


def check_plan_values(
    system_index: torch.Tensor, n_systems: int, outside: bool, cell: torch.Tensor
) -> str | None:
    """What is wrong with the values of plan inputs whose metadata passed
    :func:`check_plan_inputs`: a system index outside ``[0, n_systems)``
    (``outside``, read on the device by the selection with its other flags), a
    non-finite or singular ``cell`` (float64 on the CPU, from the same read).
    Reads ``system_index`` again only to name a bad value."""
    if outside:
        bad = system_index[(system_index < 0) | (system_index >= n_systems)][0]
        return f"system_index holds {int(bad)}, expected values in [0, {n_systems})"
    c = cell.to(torch.float64)
    if not bool(torch.isfinite(c).all()):
        return f"cell is not finite: {c.tolist()}"
    det = torch.linalg.det(c).abs()
    scale = torch.linalg.vector_norm(c, dim=2).prod(dim=1)
    singular = det <= _SINGULAR_RTOL * scale
    if bool(singular.any()):
        k = int(singular.nonzero()[0, 0])
        return (
            f"cell of system {k} is singular (|det| = {float(det[k]):.3e}): {c[k].tolist()}; "
            f"the halo needs three independent vectors (a synthetic one on open axes)"
        )
    return None


def _bounding_boxes(frac: torch.Tensor, system: torch.Tensor, n_sys: int) -> torch.Tensor:
    """Per-system bounding box of the fractional coordinates, shape ``(2, n_sys, 3)``
    (lower, upper; +inf / -inf for a system without atoms), on their device."""
    f = frac.detach()
    if n_sys == 1 and f.shape[0] > 0:
        return torch.stack(torch.aminmax(f, dim=0)).reshape(2, 1, 3)
    idx = system[:, None].expand(-1, 3)
    bb_lo = torch.full((n_sys, 3), torch.inf, dtype=f.dtype, device=f.device)
    bb_hi = torch.full((n_sys, 3), -torch.inf, dtype=f.dtype, device=f.device)
    bb_lo = bb_lo.scatter_reduce(0, idx, f, "amin")
    bb_hi = bb_hi.scatter_reduce(0, idx, f, "amax")
    return torch.stack([bb_lo, bb_hi])


def _candidates(
    bbox: torch.Tensor,
    elo: torch.Tensor,
    ehi: torch.Tensor,
    pbc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks whose expanded box may hold an image of some owned atom.

    A conservative test on ``bbox`` (float64 on the CPU, from
    :func:`_bounding_boxes`), the bounding box of the owned atoms of every system
    (the kernels then test every atom exactly). Returns ``cand_rank`` (int64,
    ascending, shape ``(n_cand,)``) and ``cand_ok`` (bool, ``(n_systems, n_cand)``)
    on the CPU.
    """
    bb_lo, bb_hi = bbox[0][:, None, :], bbox[1][:, None, :]
    eps = _CANDIDATE_MARGIN
    with torch.no_grad():
        first = torch.ceil(elo - bb_hi - eps)
        last = torch.floor(ehi - bb_lo + eps)
        periodic_ok = first <= last
        open_ok = (bb_lo - eps < ehi) & (bb_hi + eps >= elo)
        ok = torch.where(pbc[:, None, :], periodic_ok, open_ok).all(dim=2)  # (n_sys, world)
    ranks = ok.any(dim=0).nonzero().flatten()
    return ranks, ok[:, ranks]


def _functions(backend: SelectBackend) -> tuple[Callable[..., Any], ...]:
    if backend is SelectBackend.WARP:
        return _kernels.compute_fractional, _kernels.count_images, _kernels.fill_images
    return (
        _reference.compute_fractional_torch,
        _reference.count_images_torch,
        _reference.fill_images_torch,
    )


def select_ghosts(
    config: ParticleHaloConfig,
    positions: torch.Tensor,
    atom_ids: torch.Tensor,
    system_index: torch.Tensor,
    cell: torch.Tensor,
    rank: int,
    backend: SelectBackend = SelectBackend.WARP,
) -> tuple[Selection | None, Failure, str | None]:
    """Every (owned row, destination rank, image) of this rank's ghosts.

    Inputs must have passed :func:`check_plan_inputs`. Returns the selection,
    or ``None`` with a failure kind and a message (a system index out of
    range, a non-finite or singular cell, non-finite positions, a count past
    a limit). Local: no collective.
    """
    dev, dt = positions.device, positions.dtype
    world = config.world_size
    compute_fractional, count_images, fill_images = _functions(backend)
    pos = positions.detach().contiguous()
    system = system_index.contiguous()
    cell64 = cell.detach().to(torch.float64)
    inv_cell = torch.linalg.inv_ex(cell64).inverse.to(dt).contiguous()  # (checked inputs)
    frac, bad = compute_fractional(pos, system, inv_cell)  # (rows out of range read nothing)
    # one copy to the host: the failure flags, max |frac|, the bounding boxes and
    # the cell (each read alone would make a GPU stream drain)
    n_sys = config.n_systems
    in_range = system if n_sys == 1 else system.clamp(0, n_sys - 1)  # (scatter indices)
    bound_dev = frac.detach().abs().amax() if frac.numel() else frac.new_zeros(())
    host = torch.cat(
        [
            bad.reshape(1).to(torch.float64),
            bound_dev.reshape(1).to(torch.float64),
            _bounding_boxes(frac, in_range, n_sys).to(torch.float64).reshape(-1),
            cell64.reshape(-1),
        ]
    ).cpu()
    flag = int(host[0])
    bbox = host[2 : 2 + 6 * n_sys].reshape(2, n_sys, 3)
    host_cell = host[2 + 6 * n_sys :].reshape(n_sys, 3, 3)
    problem = check_plan_values(system, n_sys, flag == 2, host_cell)
    if problem is not None:
        return None, Failure.INVALID, problem
    if flag:
        row = int((~torch.isfinite(pos)).any(dim=1).nonzero()[0, 0])
        return None, Failure.INVALID, f"positions[{row}] = {pos[row].tolist()} is not finite"

    bound = float(host[1])
    elo64, ehi64 = expanded_boxes(config, host_cell, rounding_margin(dt, bound))
    image_pbc = config.image_pbc  # (a wrapped axis is unbounded and image-free)
    cand_rank, cand_ok = _candidates(bbox, elo64, ehi64, image_pbc)
    n_cand, n = int(cand_rank.numel()), int(pos.shape[0])
    send_counts = torch.zeros(world, dtype=torch.int64)
    empty = torch.empty(0, _kernels.META_WIDTH, dtype=torch.int64, device=dev)
    if n_cand == 0 or n == 0:
        return Selection(empty, send_counts), Failure.NONE, None

    # the kernels' small inputs in one copy to the device (values are exact in
    # float64: small integers, and float64 boxes cast to dt alike on either side)
    parts = (cand_rank, cand_ok, elo64, ehi64, image_pbc)
    packed = torch.cat([t.to(torch.float64).reshape(-1) for t in parts]).to(dev)
    pieces = torch.split(packed, [t.numel() for t in parts])
    as_int = [
        p.to(torch.int32).reshape(t.shape).contiguous() for p, t in zip(pieces, parts, strict=True)
    ]
    args = (
        frac,
        system,
        as_int[0],
        as_int[1],
        pieces[2].to(dt).reshape(elo64.shape).contiguous(),
        pieces[3].to(dt).reshape(ehi64.shape).contiguous(),
        as_int[4],
    )
    counts, overflow = count_images(*args, rank)
    flat = counts.reshape(-1).to(torch.int64)
    offsets = (torch.cumsum(flat, 0) - flat).reshape(counts.shape)
    read = torch.cat(
        [counts.to(torch.int64).sum(dim=1), overflow.to(torch.int64).reshape(-1)]
    ).cpu()
    per_cand = read[:n_cand]
    overflowed = bool(read[n_cand:].any())
    total = int(per_cand.sum())
    limit = config.max_ghost_rows
    if overflowed or total > _kernels._COUNT_LIMIT:
        return (
            None,
            Failure.CAPACITY,
            (
                f"ghost_width {config.ghost_width} needs more periodic images than the limits allow "
                f"(over {_kernels.MAX_IMAGE_SPAN} per axis or {_kernels._COUNT_LIMIT} rows; "
                f"{total} rows counted before the overflow)"
            ),
        )
    if limit is not None and total > limit:
        return (
            None,
            Failure.CAPACITY,
            (
                f"{total} ghost rows to send exceed max_ghost_rows = {limit} "
                f"({n} owned atoms, ghost_width {config.ghost_width})"
            ),
        )
    meta, fill_overflow = fill_images(
        args[0], args[1], atom_ids.contiguous(), *args[2:], rank, offsets, total
    )
    if bool(fill_overflow.any()):  # pragma: no cover - count and fill disagree: a bug
        return None, Failure.CAPACITY, f"fill pass overflowed its {total} counted rows"
    send_counts[cand_rank] = per_cand
    return Selection(meta, send_counts), Failure.NONE, None
