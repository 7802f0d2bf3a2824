"""Typing of what a model returns."""

from __future__ import annotations

from typing import TypedDict

import torch

__all__ = ["ModelOutputs"]


class ModelOutputs(TypedDict, total=False):
    """The named outputs of a model forward; every key is optional.

    Attributes
    ----------
    energy:
        Per-system energy, shape ``(n_systems,)``.
    forces:
        Per-atom forces ``-dE/dx``, shape ``(n_atoms, 3)``.
    stress:
        Per-system stress ``(1/V) dE/d(strain)``, shape ``(n_systems, 3, 3)``.
    virial:
        Per-system virial ``-dE/d(strain)``, shape ``(n_systems, 3, 3)``.
    atom_energies:
        Per-atom energy contributions, shape ``(n_atoms,)``.
    atom_virials:
        Per-atom virials, shape ``(n_atoms, 3, 3)``, summing to ``virial`` (only
        models that say so return them, e.g. ``LJConfig(atom_virials=True)``).
    """

    energy: torch.Tensor
    forces: torch.Tensor
    stress: torch.Tensor
    virial: torch.Tensor
    atom_energies: torch.Tensor
    atom_virials: torch.Tensor
