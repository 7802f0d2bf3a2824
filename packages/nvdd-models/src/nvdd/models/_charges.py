"""Per-atom charges: one ``Batch`` field (``atom_extras["charges"]``) read by the
electrostatic models.

Charges travel with their atoms like any other per-atom extra (scatter, gather,
migration); the electrostatic presets list ``"charges"`` in their
``sharded_fields``, so the DD runtime also copies them to ghost rows when it
rebuilds the halo.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nvdd.core import Batch
from nvdd.models._checks import config_error
from nvdd.models._species import MAX_Z

__all__ = ["CHARGES", "assign_charges", "charges_problem"]

#: Name of the per-atom charges field in ``Batch.atom_extras`` (units of e).
CHARGES = "charges"


def assign_charges(batch: Batch, charges: Mapping[int, float]) -> Batch:
    """``batch`` with ``atom_extras["charges"]`` set from a charge per element.

    Parameters
    ----------
    batch:
        Any batch; its dtype and device are used for the charges.
    charges:
        ``{atomic number: charge in e}``; every element of the batch must be listed.

    Returns
    -------
    Batch
        A new batch (the input is unchanged) whose ``atom_extras["charges"]``
        has shape ``(n_atoms,)``.

    Raises
    ------
    ConfigurationError
        If an element of the batch has no charge, or a key is not an atomic number.
    """
    table = torch.full((MAX_Z + 1,), float("nan"), dtype=torch.float64)
    for z, q in charges.items():
        if isinstance(z, bool) or not isinstance(z, int) or not 0 <= z <= MAX_Z:
            raise config_error(f"charges: keys must be atomic numbers in 0..{MAX_Z}, got {z!r}")
        table[z] = float(q)
    per_atom = table.index_select(0, batch.atomic_numbers.cpu())
    missing = torch.isnan(per_atom)
    if bool(missing.any()):
        zs = sorted({int(z) for z in batch.atomic_numbers.cpu()[missing].tolist()})
        raise config_error(
            f"charges: no charge given for atomic number(s) {zs} (given: {sorted(charges)})"
        )
    values = per_atom.to(dtype=batch.dtype, device=batch.device)
    extras = {**batch.atom_extras, CHARGES: values}
    return batch.replace(atom_extras=extras)


def charges_problem(batch: Batch) -> str | None:
    """Message naming what is wrong with ``batch``'s charges, or None.

    Checks presence, shape ``(n_atoms,)``, dtype (that of the positions), device
    and finiteness (one host synchronisation).
    """
    q = batch.atom_extras.get(CHARGES)
    if q is None:
        return (
            f"the batch has no per-atom charges: set atom_extras[{CHARGES!r}] (shape "
            f"(n_atoms,), e.g. with nvdd.models.assign_charges); it has "
            f"{sorted(batch.atom_extras)}"
        )
    if tuple(q.shape) != (batch.n_atoms,):
        return f"atom_extras[{CHARGES!r}] has shape {tuple(q.shape)}, expected ({batch.n_atoms},)"
    if q.dtype != batch.dtype or q.device != batch.device:
        return (
            f"atom_extras[{CHARGES!r}] is {q.dtype} on {q.device}, expected {batch.dtype} on "
            f"{batch.device} (those of positions)"
        )
    if q.numel() and not bool(torch.isfinite(q).all()):
        row = int((~torch.isfinite(q)).nonzero()[0, 0])
        return f"atom_extras[{CHARGES!r}][{row}] = {float(q[row])} is not finite"
    return None
