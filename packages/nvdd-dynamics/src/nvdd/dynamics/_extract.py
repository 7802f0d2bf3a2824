"""Forces out of one forward's raw outputs: the model's own, or ``-dE/dx`` by autograd.

Every force provider (the whole batch on one rank, the halo, graph partition,
each component of a pipeline) reads its forces with :func:`extract_forces`, so
the rules and the error messages are the same in every mode.
"""

from __future__ import annotations

from typing import Any

import torch

from nvdd.core import ValidationError
from nvdd.spec import ForceStrategy, ModelContract, unwrap_model

__all__ = ["extract_forces"]


def extract_forces(
    raw: dict[str, Any], positions: torch.Tensor, strategy: ForceStrategy, model: ModelContract
) -> torch.Tensor:
    """Take the forces out of ``raw`` (popped), detached, one row per position.

    The model's ``forces`` when it returns them (whatever ``strategy`` says);
    otherwise, under ``ForceStrategy.AUTOGRAD``, ``-d(sum energy)/d positions``
    (zeros when the energy does not depend on ``positions``).

    Parameters
    ----------
    raw:
        The forward's outputs by name (a mutable copy: ``forces`` is removed).
    positions:
        The positions the model ran on, shape ``(n_rows, 3)``: the autograd
        leaf when ``strategy`` is ``AUTOGRAD``.
    strategy:
        The spec's :class:`~nvdd.spec.ForceStrategy`.
    model:
        The model that returned ``raw`` (named in errors).

    Returns
    -------
    torch.Tensor
        Shape ``positions.shape``, detached.

    Raises
    ------
    ValidationError
        When ``raw`` holds neither ``forces`` nor (under ``AUTOGRAD``) an
        ``energy``, or the forces do not have one row per position.
    """
    if "forces" in raw:
        forces = raw.pop("forces")
    elif strategy is ForceStrategy.AUTOGRAD and "energy" in raw:
        (grad,) = torch.autograd.grad(raw["energy"].sum(), positions, allow_unused=True)
        forces = -grad if grad is not None else torch.zeros_like(positions)
    else:
        raise ValidationError(
            f"{_name(model)} returned neither 'forces' nor a differentiable 'energy' "
            f"(got {sorted(raw)}) under {strategy}"
        )
    if forces.shape != positions.shape:
        raise ValidationError(
            f"{_name(model)}: forces have shape {tuple(forces.shape)}, expected one row per "
            f"position {tuple(positions.shape)}"
        )
    out: torch.Tensor = forces.detach()
    return out


def _name(model: ModelContract) -> str:
    return type(unwrap_model(model)).__name__
