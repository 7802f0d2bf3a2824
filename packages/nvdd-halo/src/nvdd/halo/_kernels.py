"""Host wrappers of the Warp kernels of the halo plan (CPU and CUDA; float32 and float64).

Three kernels build a plan; one more folds ghost rows back to their owners:

- ``compute_fractional``: fractional coordinates ``frac = x @ inv(cell[s])`` and
  a flag for non-finite positions or system indices out of range (rows with
  such an index read nothing: the check costs no separate host read).
- ``count_images``: per (candidate rank, atom), the number of periodic images
  of the atom inside the rank's expanded box. The box is a product of three
  intervals, so the images inside it form a product of three integer ranges
  and the count is closed-form (no loop over images).
- ``fill_images``: the same ranges enumerated (lexicographic image order), one
  packed metadata row ``[row, n0, n1, n2, atom_id, system]`` per ghost, written
  at the offsets of an exclusive prefix sum of the counts (``torch.cumsum``).
- ``fold_rows``: deterministic sum of ghost rows into their owner rows, over
  the sent rows sorted by owner row (no atomics; the summation order is fixed;
  nothing read on the host).

Every kernel with a range or a capacity writes an overflow flag instead of
truncating; the host turns it into a :class:`~nvdd.core.CapacityOverflowError`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import warp as wp

from nvdd.core import RecordedKernel, ValidationError, init_warp
from nvdd.halo._warp_kernels import (
    COUNT_LIMIT,
    MAX_IMAGE_SPAN,
    compute_fractional_kernel,
    count_images_kernel,
    fill_images_kernel,
    fold_rows_kernel,
)

#: Warp's Python API, untyped for mypy (its stubs type the kernel language, not this use).
_wp: Any = wp

__all__ = [
    "MAX_IMAGE_SPAN",
    "compute_fractional",
    "count_images",
    "fill_images",
    "fold_rows",
]

_COUNT_LIMIT = COUNT_LIMIT

# Column layout of a packed ghost metadata row.
META_ROW, META_IMAGE, META_ID, META_SYSTEM, META_WIDTH = 0, 1, 4, 5, 6


@cache
def _ready() -> bool:
    """Initialise Warp once (lazily: importing this module has no side effect)."""
    init_warp()  # quiet unless NVDD_VERBOSE=1
    for wdt in (_wp.float32, _wp.float64):
        a2, a3 = _wp.array2d(dtype=wdt), _wp.array3d(dtype=wdt)
        _wp.overload(compute_fractional_kernel, {"positions": a2, "inv_cell": a3, "frac": a2})
        _wp.overload(count_images_kernel, {"frac": a2, "elo": a3, "ehi": a3})
        _wp.overload(fill_images_kernel, {"frac": a2, "elo": a3, "ehi": a3})
        _wp.overload(fold_rows_kernel, {"values": a2, "out": a2})
    return True


_FLOATS = (torch.float32, torch.float64)


def _check(
    name: str,
    t: torch.Tensor,
    dtype: torch.dtype | tuple[torch.dtype, ...],
    ndim: int,
    device: torch.device,
) -> None:
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ValidationError(f"{name} has dtype {t.dtype}, expected one of {dtypes}")
    if t.ndim != ndim:
        raise ValidationError(f"{name} has shape {tuple(t.shape)}, expected {ndim} dimensions")
    if t.device != device:
        raise ValidationError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValidationError(f"{name} (shape {tuple(t.shape)}) must be contiguous")


#: One ``nvdd.core.RecordedKernel`` per kernel (module-level: each holds its
#: first call's arguments until a later call replaces them). A fresh
#: ``wp.launch`` with a new stream wrapper costs about 117 us of host time on an
#: H200, a replayed one about 28 us (``benchmarks/micro_warp_launch.py``); the
#: fold runs once per multi-rank step.
_KERNELS: dict[Any, RecordedKernel] = {}


def _launch(
    kernel: Any, dim: int | tuple[int, ...], inputs: list[Any], device: torch.device
) -> None:
    found = _KERNELS.get(kernel)
    if found is None:
        found = _KERNELS[kernel] = RecordedKernel(kernel, prepare=_ready)
    found(dim, inputs, device)


def compute_fractional(
    positions: torch.Tensor, system: torch.Tensor, inv_cell: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fractional coordinates and a non-finite flag.

    Parameters
    ----------
    positions:
        float32/64, shape ``(n_atoms, 3)``, contiguous.
    system:
        int64, shape ``(n_atoms,)``.
    inv_cell:
        Same dtype as positions, shape ``(n_systems, 3, 3)``: ``inv(cell)``.

    Returns
    -------
    frac:
        Shape ``(n_atoms, 3)``, ``positions[i] @ inv_cell[system[i]]``.
    bad:
        int32, shape ``(1,)``: 2 if a system index lies outside
        ``[0, n_systems)`` (those rows are not read from ``inv_cell``: their
        ``frac`` is zero, or NaN for a non-finite position), else 1 if any
        position is not finite, else 0.
    """
    dev = positions.device
    _check("positions", positions, _FLOATS, 2, dev)
    _check("system", system, torch.int64, 1, dev)
    _check("inv_cell", inv_cell, positions.dtype, 3, dev)
    frac = torch.empty_like(positions)
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    _launch(
        compute_fractional_kernel,
        int(positions.shape[0]),
        [positions, system, inv_cell, frac, bad],
        dev,
    )
    return frac, bad


def count_images(
    frac: torch.Tensor,
    system: torch.Tensor,
    cand_rank: torch.Tensor,
    cand_ok: torch.Tensor,
    elo: torch.Tensor,
    ehi: torch.Tensor,
    periodic: torch.Tensor,
    my_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of every atom inside every candidate rank's expanded box.

    Parameters
    ----------
    frac:
        float32/64, shape ``(n_atoms, 3)``.
    system:
        int64, shape ``(n_atoms,)``.
    cand_rank:
        int32, shape ``(n_cand,)``: candidate destination ranks, ascending.
    cand_ok:
        int32, shape ``(n_systems, n_cand)``: 1 where the candidate is tested
        for atoms of that system.
    elo, ehi:
        frac's dtype, shape ``(n_systems, world_size, 3)``: expanded boxes.
    periodic:
        int32, shape ``(n_systems, 3)``.
    my_rank:
        This rank (its n = 0 image is the owned row, never a ghost).

    Returns
    -------
    counts:
        int32, shape ``(n_cand, n_atoms)``.
    overflow:
        int32, shape ``(1,)``: 1 if a range or a count exceeded its limit.
    """
    dev = frac.device
    _check_select(frac, system, cand_rank, cand_ok, elo, ehi, periodic)
    counts = torch.empty(int(cand_rank.shape[0]), int(frac.shape[0]), dtype=torch.int32, device=dev)
    overflow = torch.zeros(1, dtype=torch.int32, device=dev)
    inputs = [frac, system, cand_rank, cand_ok, elo, ehi, periodic, int(my_rank), counts, overflow]
    _launch(count_images_kernel, tuple(counts.shape), inputs, dev)
    return counts, overflow


def fill_images(
    frac: torch.Tensor,
    system: torch.Tensor,
    atom_ids: torch.Tensor,
    cand_rank: torch.Tensor,
    cand_ok: torch.Tensor,
    elo: torch.Tensor,
    ehi: torch.Tensor,
    periodic: torch.Tensor,
    my_rank: int,
    offsets: torch.Tensor,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ghost metadata rows, at the offsets of the counts' prefix sum.

    Parameters are those of :func:`count_images`, plus ``atom_ids`` (int64,
    shape ``(n_atoms,)``), ``offsets`` (int64, shape ``(n_cand, n_atoms)``: the
    exclusive prefix sum of the counts, row-major) and ``capacity`` (rows to
    allocate).

    Returns
    -------
    meta:
        int64, shape ``(capacity, 6)``: ``[row, n0, n1, n2, atom_id, system]``,
        grouped by candidate rank, then atom row, then image (lexicographic).
    overflow:
        int32, shape ``(1,)``: 1 if a row would land past ``capacity`` (nothing
        is written there).
    """
    dev = frac.device
    _check_select(frac, system, cand_rank, cand_ok, elo, ehi, periodic)
    _check("atom_ids", atom_ids, torch.int64, 1, dev)
    _check("offsets", offsets, torch.int64, 2, dev)
    meta = torch.empty(capacity, META_WIDTH, dtype=torch.int64, device=dev)
    overflow = torch.zeros(1, dtype=torch.int32, device=dev)
    inputs = [frac, system, atom_ids, cand_rank, cand_ok, elo, ehi, periodic, int(my_rank)]
    _launch(fill_images_kernel, tuple(offsets.shape), [*inputs, offsets, meta, overflow], dev)
    return meta, overflow


def _check_select(
    frac: torch.Tensor,
    system: torch.Tensor,
    cand_rank: torch.Tensor,
    cand_ok: torch.Tensor,
    elo: torch.Tensor,
    ehi: torch.Tensor,
    periodic: torch.Tensor,
) -> None:
    dev = frac.device
    _check("frac", frac, _FLOATS, 2, dev)
    _check("system", system, torch.int64, 1, dev)
    _check("cand_rank", cand_rank, torch.int32, 1, dev)
    _check("cand_ok", cand_ok, torch.int32, 2, dev)
    _check("elo", elo, frac.dtype, 3, dev)
    _check("ehi", ehi, frac.dtype, 3, dev)
    _check("periodic", periodic, torch.int32, 2, dev)


def fold_rows(
    values: torch.Tensor,
    rows: torch.Tensor,
    src: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out[rows[j]] += values[src[j]]`` for every ``j``, in the order of ``j``.

    One thread per run of equal ``rows`` (and column) sums its run, so the sum
    is deterministic and no atomics are used; nothing about the runs is read on
    the host (no synchronisation).

    Parameters
    ----------
    values:
        float32/64, shape ``(n_values, n_cols)``.
    rows:
        int64, shape ``(n,)``, sorted (non-decreasing): target rows of ``out``.
    src:
        int64, shape ``(n,)``: the row of ``values`` added at each entry.
    out:
        values' dtype, shape ``(n_rows, n_cols)``; updated in place and returned.
    """
    dev = values.device
    _check("values", values, _FLOATS, 2, dev)
    _check("out", out, values.dtype, 2, dev)
    for name, t in (("rows", rows), ("src", src)):
        _check(name, t, torch.int64, 1, dev)
    if rows.shape != src.shape:
        raise ValidationError(
            f"rows {tuple(rows.shape)} and src {tuple(src.shape)} must have the same shape"
        )
    dim = (int(rows.shape[0]), int(out.shape[1]))
    if dim[0] == 0:
        return out
    _launch(fold_rows_kernel, dim, [values, rows, src, out], dev)
    return out
