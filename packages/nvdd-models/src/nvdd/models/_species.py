"""Atomic number -> species row lookup shared by the models."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nvdd.models._checks import config_error

__all__ = ["MAX_Z", "check_species", "species_table"]

#: Largest atomic number a lookup table covers.
MAX_Z = 118


def species_table(species: Sequence[int], default_row: int | None = None) -> torch.Tensor:
    """Int64 table of shape ``(MAX_Z + 1,)`` mapping an atomic number to its row.

    ``species[k]`` maps to row ``k``; every other atomic number maps to
    ``default_row`` (or ``-1``, "unknown", when it is None).
    """
    fill = -1 if default_row is None else default_row
    table = torch.full((MAX_Z + 1,), fill, dtype=torch.int64)
    for row, z in enumerate(species):
        if isinstance(z, bool) or not isinstance(z, int) or not 0 <= z <= MAX_Z:
            raise config_error(f"species must be atomic numbers in 0..{MAX_Z}, got {z!r}")
        if int(table[z]) not in (fill,):
            raise config_error(f"species lists atomic number {z} twice: {list(species)}")
        table[z] = row
    return table


def check_species(table: torch.Tensor, atomic_numbers: torch.Tensor) -> str | None:
    """Message naming the first atom whose atomic number has no row, else None."""
    if atomic_numbers.numel() == 0:
        return None
    z = atomic_numbers
    out_of_range = (z < 0) | (z > MAX_Z)
    # both tests before one host read (a clamped lookup is harmless for the
    # out-of-range rows, which are reported first)
    unknown = table.index_select(0, z.clamp(0, MAX_Z)) < 0
    if not bool((out_of_range | unknown).any()):
        return None
    if bool(out_of_range.any()):
        row = int(out_of_range.nonzero()[0, 0])
        return f"atomic_numbers[{row}] = {int(z[row])} is outside 0..{MAX_Z}"
    if bool(unknown.any()):
        row = int(unknown.nonzero()[0, 0])
        known = (table >= 0).nonzero().squeeze(1).tolist()
        return (
            f"atomic_numbers[{row}] = {int(z[row])} has no parameters "
            f"(known atomic numbers: {known}; atomic_numbers shape {tuple(z.shape)})"
        )
    return None
