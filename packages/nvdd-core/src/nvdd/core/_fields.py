"""Names of the core fields of a :class:`~nvdd.core.Batch`."""

from __future__ import annotations

__all__ = ["PER_ATOM_FIELDS", "PER_SYSTEM_FIELDS"]

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
