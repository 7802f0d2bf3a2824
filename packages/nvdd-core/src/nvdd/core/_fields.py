"""Names of the core fields of a :class:`~nvdd.core.Batch`, and :class:`BatchFields`.

Layers of the batch modules (each imports only those below it): this module;
``_batch_validation`` and ``_ase``, which read a batch through
:class:`BatchFields`; ``_batch`` (the class, which calls both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["PER_ATOM_FIELDS", "PER_SYSTEM_FIELDS", "BatchFields"]

#: Core per-atom fields, in packing order; every one is always present.
PER_ATOM_FIELDS: tuple[str, ...] = (
    "positions",
    "atomic_numbers",
    "masses",
    "velocities",
    "forces",
    "system_index",
    "atom_ids",
)
#: Core per-system fields; every one is always present.
PER_SYSTEM_FIELDS: tuple[str, ...] = ("cell", "pbc", "energy", "stress")


class BatchFields(Protocol):
    """The fields of a :class:`~nvdd.core.Batch` that the modules below it read
    (validation, ASE conversion), so that they need not import ``_batch``."""

    positions: torch.Tensor
    atomic_numbers: torch.Tensor
    masses: torch.Tensor
    velocities: torch.Tensor
    forces: torch.Tensor
    system_index: torch.Tensor
    atom_ids: torch.Tensor
    cell: torch.Tensor
    pbc: torch.Tensor
    energy: torch.Tensor
    stress: torch.Tensor
    atom_extras: dict[str, torch.Tensor]
    system_extras: dict[str, torch.Tensor]

    @property
    def n_atoms(self) -> int: ...

    @property
    def n_systems(self) -> int: ...
