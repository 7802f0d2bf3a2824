"""Per-system outputs: system energies from per-atom ones, virials, and stress.

**Energies.** This module is the one place where per-atom energies become system energies.

Domain-decomposition seam (a): under DD the model runs on ``[owned | ghost]``
rows and only owned rows' energies count. Inside a live DD context
:func:`system_energy` is ``nvdd.shardtensor.system_sum(atom_energies,
system_index, n_systems, scope=...)`` (owned rows only): ``Scope.OWNED`` also
all-reduces over the mesh with an identity backward (a replicated energy),
``Scope.LOCAL`` keeps this rank's partial (the runtime all-reduces it when
someone asks). Every model of this package sums energies through here and
nowhere else.

**Strain and stress**: the derivative of the energy by a homogeneous deformation.

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

from nvdd.core import sum_by_system
from nvdd.shardtensor import Scope, current_dd_context, system_sum

__all__ = [
    "apply_strain",
    "cell_volume",
    "stress_from_virial",
    "system_energy",
    "system_outer_sum",
]


def system_energy(
    atom_energies: torch.Tensor,
    system_index: torch.Tensor,
    n_systems: int,
    n_counted: int | None = None,
    scope: Scope = Scope.OWNED,
) -> torch.Tensor:
    """Sum the counted rows' per-atom energies into per-system energies.

    **Collective** over the DD context's group when a live layout is set and
    ``scope`` is ``Scope.OWNED`` (every rank calls it; identity backward); no
    communication otherwise.

    Parameters
    ----------
    atom_energies:
        Shape ``(n_atoms,)``.
    system_index:
        Int64, shape ``(n_atoms,)``.
    n_systems:
        Number of systems.
    n_counted:
        Only rows ``[0, n_counted)`` count (the owned rows of a
        ``[owned | ghost]`` layout); default: every row. Ignored under a live
        DD context, where the layout's ``n_owned`` rows count.
    scope:
        Under a live DD context: ``Scope.OWNED`` (global totals, replicated on
        every rank) or ``Scope.LOCAL`` (this rank's partial). Ignored otherwise.

    Returns
    -------
    torch.Tensor
        Shape ``(n_systems,)``; differentiable in ``atom_energies``.
    """
    layout = current_dd_context().layout
    if layout is not None:
        if n_systems == 1 and scope is Scope.LOCAL and type(atom_energies) is torch.Tensor:
            # system_sum's value for one system (this rank's owned rows, no
            # collective) as a reduction: an index_add into a single value is
            # one atomic add per row, serialised on a GPU
            return atom_energies[: layout.n_owned].sum(0, keepdim=True)
        return system_sum(atom_energies, system_index, n_systems, scope=scope)
    if n_counted is not None:
        atom_energies, system_index = atom_energies[:n_counted], system_index[:n_counted]
    return sum_by_system(atom_energies, system_index, n_systems)


def system_outer_sum(
    a: torch.Tensor, b: torch.Tensor, edge_system: torch.Tensor, n_systems: int
) -> torch.Tensor:
    """``sum_e a_e (x) b_e`` per system: shape ``(n_systems, 3, 3)`` from ``(n_edges, 3)``.

    One system (the common case, and every rank under DD) is a single matrix
    product; several systems scatter the per-edge outer products. Under DD every
    global directed edge lives on exactly one rank (the owner of its receiver),
    so the per-rank partial sums are all-reduced by the output spec
    (``Reduce.ALL_REDUCE``), not here.
    """
    if n_systems == 1:
        return (a.transpose(0, 1) @ b).unsqueeze(0)
    outer = (a.unsqueeze(2) * b.unsqueeze(1)).reshape(-1, 9)
    out = a.new_zeros(n_systems, 9).index_add(0, edge_system, outer)
    return out.reshape(n_systems, 3, 3)


# ------------------------------------------------------- strain and stress
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
