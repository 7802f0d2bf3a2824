"""Strain and stress: the derivative of the energy by a homogeneous deformation.

Convention (ASE's): positions and cell are deformed as ``x' = x (I + eps)``,
``cell' = cell (I + eps)`` (rows are vectors), with ``eps`` the symmetric
displacement gradient of each system. Then

- ``virial = -dE/d eps``, shape ``(n_systems, 3, 3)``;
- ``stress = (1 / V) dE/d eps = -virial / V`` with ``V = |det cell|``.

A system whose cell has zero volume (open boundaries with placeholder zero
vectors) has no stress; it is reported as zeros, while its virial stays exact.
"""

from __future__ import annotations

import torch

__all__ = ["apply_strain", "cell_volume", "stress_from_virial"]


def apply_strain(
    positions: torch.Tensor, cell: torch.Tensor, system_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deform positions and cell by a zero strain that autograd can differentiate.

    Parameters
    ----------
    positions:
        Shape ``(n_atoms, 3)``.
    cell:
        Shape ``(n_systems, 3, 3)``.
    system_index:
        Int64, shape ``(n_atoms,)``.

    Returns
    -------
    (positions', cell', eps)
        ``eps`` is a zero leaf of shape ``(n_systems, 3, 3)`` requiring grad;
        ``dE/d eps`` of any energy computed from ``positions'`` and ``cell'`` is
        ``-virial`` (symmetric, since only the symmetric part of ``eps`` acts).
    """
    eps = torch.zeros_like(cell, requires_grad=True)
    sym = 0.5 * (eps + eps.transpose(1, 2))
    deform = torch.eye(3, dtype=cell.dtype, device=cell.device) + sym
    new_positions = torch.bmm(positions.unsqueeze(1), deform.index_select(0, system_index)).squeeze(
        1
    )
    return new_positions, torch.bmm(cell, deform), eps


def cell_volume(cell: torch.Tensor) -> torch.Tensor:
    """``|det cell|`` of every system, shape ``(n_systems,)``.

    The triple product ``|a . (b x c)|``: elementwise kernels only (a batched
    LU may synchronise with the host on some devices).
    """
    a, b, c = cell[:, 0], cell[:, 1], cell[:, 2]
    volume: torch.Tensor = (a * torch.linalg.cross(b, c)).sum(dim=1).abs()
    return volume


def stress_from_virial(virial: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
    """``stress = -virial / V``; zeros where the volume is zero.

    Parameters
    ----------
    virial:
        Shape ``(n_systems, 3, 3)``.
    cell:
        Shape ``(n_systems, 3, 3)``.
    """
    volume = cell_volume(cell.detach())
    safe = torch.where(volume > 0, volume, torch.ones_like(volume))
    stress = -virial / safe[:, None, None]
    return torch.where((volume > 0)[:, None, None], stress, torch.zeros_like(stress))
