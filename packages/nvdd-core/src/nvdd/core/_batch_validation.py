"""Field-by-field validation of a :class:`~nvdd.core.Batch` (read through
:class:`~nvdd.core._fields.BatchFields`: ``_batch`` imports this module, not the
reverse)."""

from __future__ import annotations

import torch

from nvdd.core._errors import ValidationError
from nvdd.core._fields import PER_ATOM_FIELDS, PER_SYSTEM_FIELDS, BatchFields

__all__ = ["check_batch", "check_cell"]

_MAX_Z = 118


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _expect(
    name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype | None, device: torch.device
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValidationError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if _shape(t) != shape:
        raise ValidationError(f"{name} has shape {_shape(t)}, expected {shape}")
    if dtype is not None and t.dtype != dtype:
        raise ValidationError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if t.device != device:
        raise ValidationError(
            f"{name} is on {t.device}, expected {device} (the device of positions)"
        )
    return t


def _finite(name: str, t: torch.Tensor) -> None:
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        row = int(bad.reshape(t.shape[0], -1).any(dim=1).nonzero()[0, 0]) if t.ndim else 0
        raise ValidationError(f"{name} has non-finite values (first at row {row})")


def check_cell(cell: torch.Tensor, pbc: torch.Tensor, *, rel_tol: float = 1e-10) -> None:
    """Raise unless the lattice vectors of every system's periodic axes are independent.

    Parameters
    ----------
    cell:
        Shape ``(n_systems, 3, 3)``, rows are lattice vectors.
    pbc:
        Bool, shape ``(n_systems, 3)``.
    rel_tol:
        The Gram determinant of the periodic vectors must exceed
        ``rel_tol * prod(|v_i|**2)``.
    """
    for s in range(cell.shape[0]):
        axes = [a for a in range(3) if bool(pbc[s, a])]
        if not axes:
            continue
        vecs = cell[s, axes].to(torch.float64)
        norms = (vecs * vecs).sum(dim=1)
        gram = torch.linalg.det(vecs @ vecs.T)
        if bool((norms == 0).any()) or float(gram) <= rel_tol * float(torch.prod(norms)):
            raise ValidationError(
                f"cell of system {s} is singular on its periodic axes {axes}: {cell[s].tolist()}"
            )


def check_batch(b: BatchFields) -> None:
    """Validate every field of ``b``; see :meth:`Batch.validate`."""
    pos = b.positions
    if not isinstance(pos, torch.Tensor) or pos.ndim != 2 or pos.shape[1] != 3:
        shape = _shape(pos) if isinstance(pos, torch.Tensor) else type(pos).__name__
        raise ValidationError(f"positions has shape {shape}, expected (n_atoms, 3)")
    if not pos.is_floating_point():
        raise ValidationError(f"positions must be floating point, got {pos.dtype}")
    n, dt, dev = int(pos.shape[0]), pos.dtype, pos.device
    s = int(b.cell.shape[0]) if isinstance(b.cell, torch.Tensor) and b.cell.ndim == 3 else -1
    if s < 1:
        shape = _shape(b.cell) if isinstance(b.cell, torch.Tensor) else None
        raise ValidationError(f"cell has shape {shape}, expected (n_systems >= 1, 3, 3)")

    _expect("atomic_numbers", b.atomic_numbers, (n,), torch.int64, dev)
    _expect("masses", b.masses, (n,), dt, dev)
    _expect("velocities", b.velocities, (n, 3), dt, dev)
    _expect("forces", b.forces, (n, 3), dt, dev)
    _expect("system_index", b.system_index, (n,), torch.int64, dev)
    _expect("atom_ids", b.atom_ids, (n,), torch.int64, dev)
    _expect("cell", b.cell, (s, 3, 3), dt, dev)
    _expect("pbc", b.pbc, (s, 3), torch.bool, dev)
    _expect("energy", b.energy, (s,), dt, dev)
    _expect("stress", b.stress, (s, 3, 3), dt, dev)

    for name in ("positions", "masses", "velocities", "forces", "cell", "energy", "stress"):
        _finite(name, getattr(b, name))
    if n:
        z = b.atomic_numbers
        if bool(((z < 0) | (z > _MAX_Z)).any()):
            bad = int(z[(z < 0) | (z > _MAX_Z)][0])
            raise ValidationError(f"atomic_numbers has {bad}, expected 0..{_MAX_Z}")
        if bool((b.masses <= 0).any()):
            row = int((b.masses <= 0).nonzero()[0, 0])
            raise ValidationError(f"masses must be positive; row {row} has {float(b.masses[row])}")
        si = b.system_index
        if bool(((si < 0) | (si >= s)).any()):
            bad = int(si[(si < 0) | (si >= s)][0])
            raise ValidationError(f"system_index has {bad}, expected 0..{s - 1}")
        ids = b.atom_ids
        if bool((ids < 0).any()):
            raise ValidationError(f"atom_ids must be non-negative, found {int(ids.min())}")
        sorted_ids = torch.sort(ids).values
        dup = sorted_ids[1:] == sorted_ids[:-1]
        if bool(dup.any()):
            raise ValidationError(
                f"atom_ids must be unique; id {int(sorted_ids[1:][dup][0])} appears more than once"
            )
    check_cell(b.cell, b.pbc)

    core = {*PER_ATOM_FIELDS, *PER_SYSTEM_FIELDS}
    for kind, extras, rows in (("atom", b.atom_extras, n), ("system", b.system_extras, s)):
        for key, t in extras.items():
            if key in core:
                raise ValidationError(f"{kind} extra {key!r} shadows a core field")
            if not isinstance(t, torch.Tensor) or t.ndim < 1 or int(t.shape[0]) != rows:
                shape = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValidationError(
                    f"{kind} extra {key!r} has shape {shape}, expected first dimension {rows}"
                )
            if t.device != dev:
                raise ValidationError(f"{kind} extra {key!r} is on {t.device}, expected {dev}")
