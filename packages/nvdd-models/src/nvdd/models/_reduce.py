"""Per-system reductions: the one place where per-atom energies become system energies.

Domain-decomposition seam (a): under DD the model runs on ``[owned | ghost]``
rows and only owned rows' energies count. Inside a live DD context
:func:`system_energy` is ``nvdd.shardtensor.system_sum(atom_energies,
system_index, n_systems, scope=...)`` (owned rows only): ``Scope.OWNED`` also
all-reduces over the mesh with an identity backward (a replicated energy),
``Scope.LOCAL`` keeps this rank's partial (the runtime all-reduces it when
someone asks). Every model of this package sums energies through here and
nowhere else.
"""

from __future__ import annotations

import torch

from nvdd.core import sum_by_system
from nvdd.shardtensor import Scope, current_dd_context, system_sum

__all__ = ["system_energy", "system_outer_sum"]


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
