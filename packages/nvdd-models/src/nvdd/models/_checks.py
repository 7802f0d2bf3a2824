"""Input checks shared by the neighbour lists and the models.

Every check *returns* a message (or None) instead of raising, so that a caller
under domain decomposition can hand the message to
:func:`nvdd.core.raise_if_any_rank` and fail on every rank together. The
single-process entry points of this package raise at once through :func:`fail`
(they perform no collective, so there is nothing for another rank to hang in).
"""

from __future__ import annotations

import math

import torch

from nvdd.core import ConfigurationError, ValidationError, get_rank

__all__ = [
    "check_geometry",
    "check_positive",
    "check_receivers",
    "check_system_index",
    "config_error",
    "fail",
    "shape_of",
]


def shape_of(t: object) -> tuple[int, ...] | str:
    """The shape of a tensor as a tuple, or the type name of anything else."""
    if isinstance(t, torch.Tensor):
        return tuple(int(s) for s in t.shape)
    return type(t).__name__


def fail(message: str | None) -> None:
    """Raise :class:`ValidationError` naming this rank when ``message`` is set."""
    if message is not None:
        raise ValidationError(f"rank {get_rank()}: {message}")


def config_error(message: str) -> ConfigurationError:
    """A :class:`ConfigurationError` naming this rank."""
    return ConfigurationError(f"rank {get_rank()}: {message}")


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    """Raise :class:`ConfigurationError` unless ``value`` is finite and positive."""
    ok = isinstance(value, int | float) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise config_error(f"{name} must be a finite number {bound}, got {value!r}")


def check_geometry(
    positions: object, cell: object, pbc: object, system_index: object
) -> str | None:
    """Check the four tensors a neighbour search reads; return the first problem.

    Parameters
    ----------
    positions:
        Floating, shape ``(n_atoms, 3)``.
    cell:
        Same dtype and device, shape ``(n_systems, 3, 3)``; rows are lattice vectors.
    pbc:
        Bool, shape ``(n_systems, 3)``.
    system_index:
        Int64, shape ``(n_atoms,)``. Its values are range-checked by the caller
        (that needs a device synchronisation the caller pays for anyway).
    """
    if not isinstance(positions, torch.Tensor) or positions.ndim != 2 or positions.shape[1] != 3:
        return f"positions has shape {shape_of(positions)}, expected (n_atoms, 3)"
    if not positions.is_floating_point():
        return f"positions must be floating point, got {positions.dtype}"
    n = int(positions.shape[0])
    if not isinstance(cell, torch.Tensor) or cell.ndim != 3 or tuple(cell.shape[1:]) != (3, 3):
        return f"cell has shape {shape_of(cell)}, expected (n_systems, 3, 3)"
    n_sys = int(cell.shape[0])
    if n_sys < 1:
        return "cell has shape (0, 3, 3), expected at least one system"
    if cell.dtype != positions.dtype or cell.device != positions.device:
        return (
            f"cell is {cell.dtype} on {cell.device}, expected {positions.dtype} on "
            f"{positions.device} (those of positions)"
        )
    if not isinstance(pbc, torch.Tensor) or tuple(pbc.shape) != (n_sys, 3):
        return f"pbc has shape {shape_of(pbc)}, expected ({n_sys}, 3)"
    if pbc.dtype != torch.bool:
        return f"pbc must be bool, got {pbc.dtype}"
    if pbc.device != positions.device:
        return f"pbc is on {pbc.device}, expected {positions.device} (the device of positions)"
    if not isinstance(system_index, torch.Tensor) or tuple(system_index.shape) != (n,):
        return f"system_index has shape {shape_of(system_index)}, expected ({n},)"
    if system_index.dtype != torch.int64 or system_index.device != positions.device:
        return (
            f"system_index is {system_index.dtype} on {system_index.device}, expected "
            f"torch.int64 on {positions.device}"
        )
    return None


def check_receivers(n_receivers: int | None, n_atoms: int) -> str | None:
    """Check the receiver bound of a domain-decomposed neighbour list."""
    if n_receivers is None:
        return None
    if isinstance(n_receivers, bool) or not isinstance(n_receivers, int):
        return f"n_receivers must be an int or None, got {type(n_receivers).__name__}"
    if not 0 <= n_receivers <= n_atoms:
        return f"n_receivers is {n_receivers}, expected 0 <= n_receivers <= n_atoms = {n_atoms}"
    return None


def check_system_index(system_index: torch.Tensor, n_systems: int) -> str | None:
    """Check that every value of ``system_index`` lies in ``[0, n_systems)``.

    One device-to-host copy of the minimum and maximum; ``system_index`` is
    int64, shape ``(n_atoms,)`` (shape and dtype checked by :func:`check_geometry`).
    """
    if system_index.numel() == 0:
        return None
    lo, hi = (int(v) for v in torch.stack(list(torch.aminmax(system_index))).tolist())
    if lo < 0 or hi >= n_systems:
        bad = lo if lo < 0 else hi
        return (
            f"system_index has {bad} (shape {tuple(system_index.shape)}), expected values in "
            f"0..{n_systems - 1}"
        )
    return None
