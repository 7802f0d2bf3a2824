"""Outputs of a model run under the receptive-field safe path (record 0067).

Under :func:`nvdd.spec.receptive_field_spec` the model runs unmodified on the
``[owned | ghost]`` rows; only owned rows are exact. Its per-system outputs
(``energy``, ``stress``, ``virial``) sum over every row it was given, ghost
rows included, so they are dropped; the energy is rebuilt as the per-system
sum of owned rows' ``atom_energies`` when the model returns them. What cannot
be rebuilt is recorded as unavailable, with the reason an explicit request
raises (:class:`~nvdd.dynamics._provider.PendingTotals`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nvdd.core import ConfigurationError, ValidationError
from nvdd.dynamics._provider import extract_forces
from nvdd.spec import ForceStrategy, MLIPSpec, StrategyKind

__all__ = ["check_reach", "owned_energy_forces", "owned_row_outputs"]

_PER_SYSTEM = ("energy", "stress", "virial")


def owned_row_outputs(
    raw: dict[str, Any],
    spec: MLIPSpec,
    *,
    n_owned: int,
    system_index: torch.Tensor,
    n_systems: int,
    model_name: str,
) -> tuple[dict[str, Any], dict[str, str]]:
    """``raw`` with its per-system outputs replaced, and ``{name: why unavailable}``.

    Local (no communication). ``system_index``: the padded rows' systems; the
    energy returned is this rank's partial (owned rows), summed over ranks by
    consolidation on demand.
    """
    out = {k: v for k, v in raw.items() if k not in _PER_SYSTEM}
    unavailable: dict[str, str] = {}
    how = (
        f"{model_name} runs unmodified under the receptive-field spec {spec.name!r}: only "
        "its owned rows are exact, and its per-system outputs sum over ghost rows too"
    )
    atom = raw.get("atom_energies")
    if isinstance(atom, torch.Tensor) and atom.shape[:1] == system_index.shape[:1]:
        owned = atom.detach()[:n_owned].reshape(n_owned, -1).sum(dim=1)
        energy = owned.new_zeros(n_systems).index_add_(
            0, system_index[:n_owned].to(owned.device), owned
        )
        out["energy"] = energy
    elif "energy" in raw:
        unavailable["energy"] = (
            f"the per-system energy is not available: {how}; return per-atom energies as "
            "'atom_energies' (the energy is then their sum over owned atoms), or declare "
            "adapters / refresh_neighbors for the model (see 'Bring your own model')"
        )
    for name in ("stress", "virial"):
        if name not in raw:
            continue
        unavailable[name] = (
            f"the per-system {name} is not available: {how}; declare adapters / "
            "refresh_neighbors for the model to get it (see 'Bring your own model')"
        )
    return out, unavailable


def owned_energy_forces(
    raw: dict[str, Any], padded: torch.Tensor, n_owned: int, model: Any
) -> None:
    """The folding variant's forces: ``raw["forces"] = -d(sum of owned rows'
    atom_energies)/d padded`` on every padded row (the model's own forces, exact
    on no row of a one-``L rc`` halo, are replaced). Local; the caller folds.

    Raises :class:`~nvdd.core.ValidationError` naming the model when its
    ``atom_energies`` are missing or not differentiable w.r.t. ``padded``.
    """
    name = type(model).__name__
    atom = raw.get("atom_energies")
    if not isinstance(atom, torch.Tensor) or atom.shape[:1] != padded.shape[:1]:
        raise ValidationError(
            f"{name} under receptive_field_spec(..., fold=True) must return 'atom_energies' "
            f"with one row per position it is given (got {sorted(raw)}); without them use "
            "receptive_field_spec(layers) (fold=False)"
        )
    owned = atom[:n_owned].sum()
    if not owned.requires_grad:
        raise ValidationError(
            f"{name} under receptive_field_spec(..., fold=True): its 'atom_energies' are not "
            "differentiable w.r.t. the positions it is given (detached, or computed from a "
            "copy of them); use receptive_field_spec(layers) (fold=False), which needs no "
            "gradient of them"
        )
    # (the one force extraction: -d(sum of the owned rows' energies)/d padded)
    raw["forces"] = extract_forces(
        {"energy": atom[:n_owned]}, padded, ForceStrategy.AUTOGRAD, model
    )


#: Periodic images per axis and ghost rows the halo can hold (nvdd.halo's limits).
_MAX_IMAGE_SPAN = 1 << 16
_MAX_ROWS = (1 << 31) - 1


def check_reach(spec: MLIPSpec, batch: Any, ghost_width: float, model_name: str) -> None:
    """Refuse a receptive-field halo the halo cannot hold, before building it
    (``StrategyKind.HALO``; graph partition holds any width).

    Local, and the same on every rank (the cell, pbc and atom count are every
    rank's). Under periodic boundaries a ghost width wider than the box is
    served by several images per axis (exact, at the cost of the model's work
    on them); past the halo's limits it is impossible, and the error says why.
    """
    if not spec.owned_rows_exact or spec.strategy is not StrategyKind.HALO:
        return  # (graph partition: ghosts are atoms, not images; any width works)
    reach = 1 if spec.options.receptive_field_fold else 2
    cell = batch.cell.detach().to("cpu", torch.float64)
    pbc = batch.pbc.detach().to("cpu")
    for s in range(int(cell.shape[0])):
        if not bool(pbc[s].any()):
            continue
        recip = torch.linalg.inv(cell[s]).T  # rows: reciprocal vectors
        spacing = 1.0 / torch.linalg.vector_norm(recip, dim=1)
        images = [
            math.ceil(ghost_width / float(spacing[a])) if bool(pbc[s, a]) else 0 for a in range(3)
        ]
        copies = math.prod(2 * n + 1 for n in images)
        if max(2 * n + 1 for n in images) > _MAX_IMAGE_SPAN or copies > _MAX_ROWS:
            widths = ", ".join(f"{float(x):.4g}" for x in spacing)
            raise ConfigurationError(
                f"{model_name} under {spec.name!r}: the receptive-field halo is "
                f"{ghost_width:.6g} Angstrom ({reach} x {spec.options.receptive_field_layers} "
                f"layers x cutoff + skin), which needs {images} periodic images per axis of system {s} "
                f"(lattice-plane spacings {widths} Angstrom): more than the halo can hold. Use a "
                "larger periodic cell, check the declared layers, or declare adapters / "
                "refresh_neighbors so the halo is one cutoff wide"
            )
