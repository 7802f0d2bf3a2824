"""Conversion between :class:`~nvdd.core.Batch` and ASE ``Atoms`` (optional extra ``ase``).

Below ``_batch`` (whose ``from_ase`` / ``to_ase`` call it): it returns the fields
of a batch (:class:`AseFields`) and reads one through
:class:`~nvdd.core._fields.BatchFields`, never importing the class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import torch

from nvdd.core._errors import OptionalDependencyError, ValidationError

if TYPE_CHECKING:
    from ase import Atoms

    from nvdd.core._fields import BatchFields

__all__ = ["AseFields", "batch_to_ase", "fields_from_ase"]

_ID_KEY = "atom_ids"
#: Per-atom energies (``atom_extras``, kept by the integrators) become ASE's
#: ``energies`` result (an extxyz column).
_ENERGIES_KEY = "atom_energies"
#: Per-atom virials (``atom_extras``, shape ``(n_atoms, 3, 3)``, summing to the
#: system virial ``-dE/d strain``) become ASE's per-atom ``stresses`` result.
_VIRIALS_KEY = "atom_virials"


def _ase() -> Any:
    try:
        import ase
        import ase.calculators.singlepoint
    except ImportError as exc:  # pragma: no cover - exercised only without ase
        raise OptionalDependencyError(
            "ase", "ASE conversion", extra="nvdd-core[ase]", cause=exc
        ) from exc
    return ase


class AseFields(TypedDict):
    """The keyword arguments of :class:`~nvdd.core.Batch` that ``Atoms`` give."""

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


def fields_from_ase(
    atoms: Atoms | Sequence[Atoms], *, dtype: torch.dtype, device: torch.device | str
) -> AseFields:
    """The fields of the batch :meth:`Batch.from_ase` builds (see there)."""
    ase = _ase()
    items = [atoms] if isinstance(atoms, ase.Atoms) else list(atoms)
    if not items:
        raise ValidationError("from_ase: got an empty sequence of Atoms")
    pos, z, m, v, f, sysi, ids, cell, pbc, energy, stress = ([] for _ in range(11))
    next_id = 0
    for s, a in enumerate(items):
        n = len(a)
        pos.append(a.get_positions())
        z.append(a.get_atomic_numbers())
        m.append(a.get_masses())
        v.append(a.get_velocities())
        sysi.append(np.full(n, s, dtype=np.int64))
        if _ID_KEY in a.arrays:
            ids.append(np.asarray(a.arrays[_ID_KEY], dtype=np.int64))
        else:
            ids.append(np.arange(next_id, next_id + n, dtype=np.int64))
        next_id = int(max(next_id + n, ids[-1].max() + 1 if n else next_id))
        cell.append(np.asarray(a.get_cell()))
        pbc.append(np.asarray(a.get_pbc(), dtype=bool))
        calc = a.calc
        results: dict[str, Any] = dict(getattr(calc, "results", {}) or {})
        f.append(np.asarray(results.get("forces", np.zeros((n, 3)))))
        energy.append(float(results.get("energy", 0.0)))
        st = results.get("stress")
        if st is None:
            stress.append(np.zeros((3, 3)))
        else:
            st = np.asarray(st)
            stress.append(_voigt_to_matrix(st) if st.shape == (6,) else st.reshape(3, 3))

    def t(x: Any, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x), dtype=dt, device=device)

    return AseFields(
        positions=t(np.concatenate(pos)),
        atomic_numbers=t(np.concatenate(z), torch.int64),
        masses=t(np.concatenate(m)),
        velocities=t(np.concatenate(v)),
        forces=t(np.concatenate(f)),
        system_index=t(np.concatenate(sysi), torch.int64),
        atom_ids=t(np.concatenate(ids), torch.int64),
        cell=t(np.stack(cell)),
        pbc=t(np.stack(pbc), torch.bool),
        energy=t(np.asarray(energy)),
        stress=t(np.stack(stress)),
    )


def batch_to_ase(cpu: BatchFields) -> list[Atoms]:
    """See :meth:`Batch.to_ase`; ``cpu`` is the batch on the CPU.

    Per-atom outputs kept in ``atom_extras`` go into the single-point calculator
    (extxyz columns when written): ``atom_energies`` as ``energies``, and
    ``atom_virials`` as ``stresses`` (``(n_atoms, 6)``, see :func:`_atom_stresses`)
    for a system of positive volume (a cell with a zero vector has no stress).
    """
    ase = _ase()
    from ase.calculators.singlepoint import SinglePointCalculator

    out = []
    for s in range(cpu.n_systems):
        rows = (cpu.system_index == s).nonzero().flatten()
        a = ase.Atoms(
            numbers=cpu.atomic_numbers[rows].numpy(),
            positions=cpu.positions[rows].double().numpy(),
            masses=cpu.masses[rows].double().numpy(),
            cell=cpu.cell[s].double().numpy(),
            pbc=cpu.pbc[s].numpy(),
        )
        a.set_velocities(cpu.velocities[rows].double().numpy())
        a.arrays[_ID_KEY] = cpu.atom_ids[rows].numpy().copy()
        results: dict[str, Any] = {
            "energy": float(cpu.energy[s]),
            "forces": cpu.forces[rows].double().numpy(),
            "stress": _matrix_to_voigt(cpu.stress[s].double().numpy()),
        }
        per_atom = cpu.atom_extras.get(_ENERGIES_KEY)
        if per_atom is not None and per_atom.shape == (cpu.n_atoms,):
            results["energies"] = per_atom[rows].double().numpy()
        virials = cpu.atom_extras.get(_VIRIALS_KEY)
        if virials is not None and virials.shape == (cpu.n_atoms, 3, 3):
            volume = abs(float(np.linalg.det(cpu.cell[s].double().numpy())))
            if volume > 0:
                results["stresses"] = _atom_stresses(virials[rows].double().numpy(), volume)
        a.calc = SinglePointCalculator(a, **results)  # type: ignore[no-untyped-call]
        out.append(a)
    return out


def _atom_stresses(atom_virials: np.ndarray, volume: float) -> np.ndarray:
    """ASE's per-atom ``stresses`` of per-atom virials: ``-W_i / V`` in Voigt form.

    ASE's convention (``ase.calculators.lj.LennardJones``, ``Atoms.get_stresses``):
    shape ``(n_atoms, 6)``, columns ``xx yy zz yz xz xy``, each atom's share of
    ``dE/d strain`` divided by the volume ``V`` of the whole cell (not a per-atom
    volume), so that the rows sum to the system ``stress``; no ideal-gas term.

    Parameters
    ----------
    atom_virials:
        Shape ``(n_atoms, 3, 3)``, ``W_i`` with ``sum_i W_i = -dE/d strain``.
    volume:
        ``|det cell|`` (> 0).
    """
    m = -0.5 * (atom_virials + atom_virials.transpose(0, 2, 1)) / volume
    return np.stack([m[:, 0, 0], m[:, 1, 1], m[:, 2, 2], m[:, 1, 2], m[:, 0, 2], m[:, 0, 1]], 1)


def _voigt_to_matrix(v: np.ndarray) -> np.ndarray:
    xx, yy, zz, yz, xz, xy = v
    return np.array([[xx, xy, xz], [xy, yy, yz], [xz, yz, zz]])


def _matrix_to_voigt(m: np.ndarray) -> np.ndarray:
    m = 0.5 * (m + m.T)  # Voigt notation holds the symmetric part
    return np.array([m[0, 0], m[1, 1], m[2, 2], m[1, 2], m[0, 2], m[0, 1]])
