"""Forces and stress by autograd, shared by every model of this package.

Domain-decomposition seam (c): forces are ``-dE_local/dx`` on *every* row
(owned and ghost), where ``E_local`` sums the counted rows' atom energies
through :func:`nvdd.models._reduce.system_energy`; under DD the reverse halo
exchange then folds ghost rows' forces into their owners.

Under a live DD context whose positions require grad (the runtime's padded
leaf, ``ForceStrategy.AUTOGRAD``), the derivative is taken with respect to
``nvdd.shardtensor.autograd_target(positions)``, the leaf itself, so that the
gradient of any refresh or fold the model ran on the way (their backward is a
reverse exchange) reaches the rows it belongs to. Otherwise (single process, or
a runtime that hands plain positions) the function differentiates a detached
copy of ``positions``, exactly as a single-process model does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nvdd.core import ModelOutputs
from nvdd.models._reduce import apply_strain, stress_from_virial, system_energy
from nvdd.shardtensor import Scope, autograd_target, current_dd_context

__all__ = ["AtomEnergyFn", "freeze_parameters", "outputs_by_autograd"]

#: ``(positions, cell) -> atom_energies``: differentiable in both arguments.
AtomEnergyFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def freeze_parameters(module: torch.nn.Module) -> None:
    """Turn off ``requires_grad`` of every parameter of ``module`` (the ``freeze=True``
    of the wrappers of pretrained models).

    The forces differentiate the positions only; while a weight requires grad,
    autograd also keeps what its gradient would need (each linear layer's input),
    which nobody takes (records 0088, 0089). Parameter by parameter, so that a
    TorchScript module (no ``requires_grad_``) is frozen too.
    """
    for p in module.parameters():
        p.requires_grad_(False)


def outputs_by_autograd(
    atom_energy_fn: AtomEnergyFn,
    positions: torch.Tensor,
    cell: torch.Tensor,
    system_index: torch.Tensor,
    *,
    n_counted: int | None = None,
    compute_stress: bool = True,
    create_graph: bool = False,
    energy_scope: Scope = Scope.OWNED,
) -> ModelOutputs:
    """Energy, forces, atom energies and (optionally) virial and stress.

    **Collective** under a live DD context when ``atom_energy_fn`` communicates
    (refresh / fold of features) or ``energy_scope`` is ``Scope.OWNED``: the
    forward and the backward then run collectives over the context's group, and
    every rank must call this at the same point. No communication otherwise.

    Parameters
    ----------
    atom_energy_fn:
        Maps ``(positions, cell)`` to per-atom energies, shape ``(n_atoms,)``.
    positions:
        Shape ``(n_atoms, 3)``.
    cell:
        Shape ``(n_systems, 3, 3)``.
    system_index:
        Int64, shape ``(n_atoms,)``.
    n_counted:
        Only the first ``n_counted`` rows' atom energies enter the energy (the
        owned rows under DD); forces are still returned on every row.
    compute_stress:
        Also differentiate by a homogeneous strain (``virial``, ``stress``).
    create_graph:
        Keep the graph of the derivatives (to train on forces); outputs are
        detached otherwise.
    energy_scope:
        Under a live DD context: ``Scope.OWNED`` (replicated energy, identity
        backward) or ``Scope.LOCAL`` (this rank's partial). Forces and virial
        are the same either way: each rank differentiates its own share.
    """
    n_systems = int(cell.shape[0])
    with torch.enable_grad():
        if current_dd_context().is_distributed and positions.requires_grad:
            pos, target = positions, autograd_target(positions)
            if not target.requires_grad:  # a context leaf the batch was not built from
                target = positions
        else:
            pos = target = positions.detach().requires_grad_(True)
        eps: torch.Tensor | None = None
        if compute_stress:
            pos_in, cell_in, eps = apply_strain(pos, cell.detach(), system_index)
        else:
            pos_in, cell_in = pos, cell.detach()
        atom_energies = atom_energy_fn(pos_in, cell_in)
        energy = system_energy(atom_energies, system_index, n_systems, n_counted, energy_scope)
        inputs = [target] if eps is None else [target, eps]
        grads: tuple[torch.Tensor | None, ...] = (None,) * len(inputs)
        if energy.requires_grad:
            grads = torch.autograd.grad(
                energy.sum(), inputs, create_graph=create_graph, allow_unused=True
            )
    g_pos = grads[0] if grads[0] is not None else torch.zeros_like(target)
    out: ModelOutputs = {
        "energy": energy if create_graph else energy.detach(),
        "forces": -g_pos if create_graph else -g_pos.detach(),
        "atom_energies": atom_energies if create_graph else atom_energies.detach(),
    }
    if eps is not None:
        g_eps = grads[1] if grads[1] is not None else torch.zeros_like(eps)
        virial = -g_eps if create_graph else -g_eps.detach()
        out["virial"] = virial
        out["stress"] = stress_from_virial(virial, cell)
    return out
