"""`Batch`: one or several atomic systems, with global atom ids; `TensorMemo`:
whether a batch's field is still the tensor seen before.

Conventions (those of ASE): positions in Angstrom, cell rows are the lattice
vectors (``positions = fractional @ cell``), masses in atomic mass units,
velocities in ASE units (Angstrom * sqrt(eV / amu)), energies in eV, stress in
eV / Angstrom**3.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from nvdd.core._batch_validation import check_batch
from nvdd.core._errors import ValidationError
from nvdd.core._fields import PER_ATOM_FIELDS, PER_SYSTEM_FIELDS
from nvdd.core._masses import masses_for

if TYPE_CHECKING:
    from ase import Atoms

__all__ = ["Batch", "TensorMemo"]


def _as_float(
    name: str, value: Any, like: torch.Tensor, default: torch.Tensor | None = None
) -> torch.Tensor:
    if value is None:
        if default is None:  # pragma: no cover - internal misuse
            raise ValueError(name)
        return default
    if not isinstance(value, torch.Tensor):
        return torch.as_tensor(value, dtype=like.dtype, device=like.device)
    return value


class Batch:
    """A batch of atomic systems with aligned per-atom and per-system fields.

    Parameters
    ----------
    positions:
        Floating tensor, shape ``(n_atoms, 3)``. Its dtype and device are those of
        every other floating field.
    atomic_numbers:
        Integer tensor, shape ``(n_atoms,)``; stored as int64.
    cell:
        Shape ``(n_systems, 3, 3)`` (or ``(3, 3)`` for one system), rows are the
        lattice vectors. Default: zeros (open boundaries).
    pbc:
        Bool, shape ``(n_systems, 3)`` (or ``(3,)``). Default: all False.
    masses:
        Shape ``(n_atoms,)``; default: standard masses of ``atomic_numbers``.
    velocities, forces:
        Shape ``(n_atoms, 3)``; default zeros.
    system_index:
        Int64, shape ``(n_atoms,)``, values in ``[0, n_systems)``; default zeros.
    atom_ids:
        Int64, shape ``(n_atoms,)``, unique and non-negative: the global identity
        of every atom, kept through every reordering, scatter and migration.
        Default ``arange(n_atoms)``.
    energy:
        Shape ``(n_systems,)``; default zeros.
    stress:
        Shape ``(n_systems, 3, 3)``; default zeros.
    atom_extras, system_extras:
        Free-form named tensors whose first dimension is ``n_atoms`` (or
        ``n_systems``). They travel with their atoms / systems in every helper.
    validate:
        Run :meth:`validate` (default True). Internal hot paths pass False.

    Raises
    ------
    ValidationError
        On any malformed field; the message names the field, its shape and what
        was expected.
    """

    __slots__ = (*PER_ATOM_FIELDS, *PER_SYSTEM_FIELDS, "atom_extras", "system_extras")

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

    def __init__(
        self,
        positions: torch.Tensor,
        atomic_numbers: torch.Tensor,
        *,
        cell: torch.Tensor | Sequence[Any] | None = None,
        pbc: torch.Tensor | Sequence[Any] | None = None,
        masses: torch.Tensor | None = None,
        velocities: torch.Tensor | None = None,
        forces: torch.Tensor | None = None,
        system_index: torch.Tensor | None = None,
        atom_ids: torch.Tensor | None = None,
        energy: torch.Tensor | None = None,
        stress: torch.Tensor | None = None,
        atom_extras: Mapping[str, torch.Tensor] | None = None,
        system_extras: Mapping[str, torch.Tensor] | None = None,
        validate: bool = True,
    ) -> None:
        if not isinstance(positions, torch.Tensor):
            raise ValidationError(
                f"positions must be a torch.Tensor, got {type(positions).__name__}"
            )
        if not positions.is_floating_point():
            raise ValidationError(f"positions must be floating point, got {positions.dtype}")
        dev, dt = positions.device, positions.dtype
        if not isinstance(atomic_numbers, torch.Tensor):
            atomic_numbers = torch.as_tensor(atomic_numbers, device=dev)
        if atomic_numbers.dtype != torch.int64 and not atomic_numbers.is_floating_point():
            atomic_numbers = atomic_numbers.long()
        n = positions.shape[0] if positions.ndim >= 1 else 0

        cell_t = None if cell is None else _as_float("cell", cell, positions)
        if cell_t is not None and cell_t.ndim == 2:
            cell_t = cell_t.unsqueeze(0)
        if cell_t is not None:
            n_sys = cell_t.shape[0]
        elif system_index is not None and system_index.numel() > 0:
            n_sys = int(system_index.max()) + 1
        else:
            n_sys = 1
        if cell_t is None:
            cell_t = torch.zeros(n_sys, 3, 3, dtype=dt, device=dev)
        if pbc is None:
            pbc_t = torch.zeros(n_sys, 3, dtype=torch.bool, device=dev)
        else:
            pbc_t = torch.as_tensor(pbc, device=dev)
            if pbc_t.dtype != torch.bool:
                raise ValidationError(f"pbc must be bool, got {pbc_t.dtype}")
            if pbc_t.ndim == 1:
                pbc_t = pbc_t.unsqueeze(0).expand(n_sys, -1).clone()

        self.positions = positions
        self.atomic_numbers = atomic_numbers
        self.cell = cell_t
        self.pbc = pbc_t
        self.masses = masses if masses is not None else masses_for(atomic_numbers, dt)
        self.velocities = velocities if velocities is not None else torch.zeros_like(positions)
        self.forces = forces if forces is not None else torch.zeros_like(positions)
        self.system_index = (
            system_index
            if system_index is not None
            else torch.zeros(n, dtype=torch.int64, device=dev)
        )
        self.atom_ids = (
            atom_ids if atom_ids is not None else torch.arange(n, dtype=torch.int64, device=dev)
        )
        self.energy = energy if energy is not None else torch.zeros(n_sys, dtype=dt, device=dev)
        self.stress = (
            stress if stress is not None else torch.zeros(n_sys, 3, 3, dtype=dt, device=dev)
        )
        self.atom_extras = dict(atom_extras or {})
        self.system_extras = dict(system_extras or {})
        if validate:
            self.validate()

    # ------------------------------------------------------------------ basics
    @property
    def n_atoms(self) -> int:
        """Number of atoms (rows of every per-atom field)."""
        return int(self.positions.shape[0])

    @property
    def n_systems(self) -> int:
        """Number of systems (rows of every per-system field)."""
        return int(self.cell.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype of positions (and every other floating field)."""
        return self.positions.dtype

    @property
    def device(self) -> torch.device:
        """The device every field lives on."""
        return self.positions.device

    def validate(self) -> None:
        """Check every field; raise :class:`ValidationError` naming the first problem.

        Checks shapes, dtypes and devices, finite floating values, atomic numbers in
        range, positive masses, system indices in range, non-singular cells on
        periodic axes, unique non-negative atom ids, and extra-field lengths. This
        synchronises with the device; hot paths skip it.
        """
        check_batch(self)

    def atoms_per_system(self) -> torch.Tensor:
        """Atom count of every system, int64 shape ``(n_systems,)``."""
        return torch.bincount(self.system_index, minlength=self.n_systems)

    def atom_fields(self) -> dict[str, torch.Tensor]:
        """Every per-atom field (core fields in packing order, then extras)."""
        out = {name: getattr(self, name) for name in PER_ATOM_FIELDS}
        out.update(self.atom_extras)
        return out

    def system_fields(self) -> dict[str, torch.Tensor]:
        """Every per-system field (core fields, then extras)."""
        out = {name: getattr(self, name) for name in PER_SYSTEM_FIELDS}
        out.update(self.system_extras)
        return out

    def replace(self, *, validate: bool = False, **fields: Any) -> Batch:
        """A shallow copy with the named fields (core or extra) replaced.

        Extras are matched by name to ``atom_extras`` or ``system_extras``; a name
        that is neither a core field nor an existing extra raises.
        """
        new = self._shallow()
        for name, value in fields.items():
            if name in PER_ATOM_FIELDS or name in PER_SYSTEM_FIELDS:
                object.__setattr__(new, name, value)
            elif name in ("atom_extras", "system_extras"):
                object.__setattr__(new, name, dict(value))
            elif name in new.atom_extras:
                new.atom_extras[name] = value
            elif name in new.system_extras:
                new.system_extras[name] = value
            else:
                raise ValidationError(f"Batch has no field {name!r}")
        if validate:
            new.validate()
        return new

    def with_atom_fields(
        self, fields: Mapping[str, torch.Tensor], *, validate: bool = False
    ) -> Batch:
        """A batch with these per-atom rows and this batch's systems.

        ``fields`` must hold every core per-atom field; any other key becomes an
        atom extra. Used to rebuild a batch after rows were moved between ranks.
        """
        missing = [f for f in PER_ATOM_FIELDS if f not in fields]
        if missing:
            raise ValidationError(f"with_atom_fields: missing per-atom fields {missing}")
        new = self._shallow()
        for name in PER_ATOM_FIELDS:
            object.__setattr__(new, name, fields[name])
        new.atom_extras = {k: v for k, v in fields.items() if k not in PER_ATOM_FIELDS}
        if validate:
            new.validate()
        return new

    def _shallow(self) -> Batch:
        new = Batch.__new__(Batch)
        for name in (*PER_ATOM_FIELDS, *PER_SYSTEM_FIELDS):
            object.__setattr__(new, name, getattr(self, name))
        new.atom_extras = dict(self.atom_extras)
        new.system_extras = dict(self.system_extras)
        return new

    # ------------------------------------------------------------ reordering
    def select(self, index: torch.Tensor) -> Batch:
        """The atoms picked by ``index`` (bool mask or int64 rows), all systems kept.

        Every per-atom field, extras included, is indexed together, so ids stay
        aligned with their rows.
        """
        if index.dtype == torch.bool:
            if index.shape != (self.n_atoms,):
                raise ValidationError(
                    f"select: bool mask has shape {tuple(index.shape)}, expected ({self.n_atoms},)"
                )
        elif index.is_floating_point() or index.ndim != 1:
            raise ValidationError(
                f"select: index must be a 1-D int or bool tensor, got {index.dtype} "
                f"shape {tuple(index.shape)}"
            )
        return self.with_atom_fields({k: v[index] for k, v in self.atom_fields().items()})

    def reorder(self, permutation: torch.Tensor) -> Batch:
        """Rows reordered by ``permutation`` (a permutation of ``range(n_atoms)``)."""
        perm = permutation.long()
        ok = perm.shape == (self.n_atoms,) and bool(
            torch.equal(
                torch.sort(perm).values,
                torch.arange(self.n_atoms, device=perm.device),
            )
        )
        if not ok:
            raise ValidationError(
                f"reorder: expected a permutation of range({self.n_atoms}), got shape "
                f"{tuple(perm.shape)}"
            )
        return self.select(perm)

    def sort_by_id(self) -> Batch:
        """Rows in increasing global atom id."""
        return self.select(torch.argsort(self.atom_ids))

    @staticmethod
    def concatenate(batches: Sequence[Batch], *, validate: bool = True) -> Batch:
        """Stack different systems into one batch (system indices are offset).

        Atom ids must stay unique across the inputs (checked when ``validate``).
        All inputs need the same dtype, device and extra-field names.
        """
        first = _check_compatible(batches, "concatenate")
        offsets: list[int] = []
        total = 0
        for b in batches:
            offsets.append(total)
            total += b.n_systems
        atoms = {
            name: torch.cat([b.atom_fields()[name] for b in batches])
            for name in first.atom_fields()
        }
        atoms["system_index"] = torch.cat(
            [b.system_index + off for b, off in zip(batches, offsets, strict=True)]
        )
        systems = {
            name: torch.cat([b.system_fields()[name] for b in batches])
            for name in first.system_fields()
        }
        new = first._shallow()
        for name in PER_SYSTEM_FIELDS:
            object.__setattr__(new, name, systems[name])
        new.system_extras = {k: v for k, v in systems.items() if k not in PER_SYSTEM_FIELDS}
        return new.with_atom_fields(atoms, validate=validate)

    @staticmethod
    def merge(batches: Sequence[Batch], *, validate: bool = True) -> Batch:
        """Join atom subsets of the same systems (e.g. shards gathered from ranks).

        System fields are taken from the first input; the others must have the same
        number of systems. Atom ids must stay unique (checked when ``validate``).
        """
        first = _check_compatible(batches, "merge")
        for i, b in enumerate(batches):
            if b.n_systems != first.n_systems:
                raise ValidationError(
                    f"merge: input {i} has {b.n_systems} systems, input 0 has {first.n_systems}"
                )
        atoms = {
            name: torch.cat([b.atom_fields()[name] for b in batches])
            for name in first.atom_fields()
        }
        return first.with_atom_fields(atoms, validate=validate)

    # ------------------------------------------------------------- conversion
    def to(
        self,
        device: torch.device | str | torch.dtype | None = None,
        dtype: torch.dtype | None = None,
    ) -> Batch:
        """A copy on ``device`` with floating fields cast to ``dtype``; as with
        ``torch.Tensor.to``, a dtype may come first (``batch.to(torch.float32)``:
        integer fields such as ``atom_ids`` keep their dtype)."""
        if isinstance(device, torch.dtype):
            if dtype is not None:
                raise ValidationError(f"Batch.to: two dtypes given, {device} and {dtype}")
            device, dtype = None, device
        if dtype is not None and not dtype.is_floating_point:
            raise ValidationError(f"Batch.to: dtype must be floating point, got {dtype}")

        def conv(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device) if device is not None else t
            return t.to(dtype) if dtype is not None and t.is_floating_point() else t

        new = Batch.__new__(Batch)
        for name in (*PER_ATOM_FIELDS, *PER_SYSTEM_FIELDS):
            object.__setattr__(new, name, conv(getattr(self, name)))
        new.atom_extras = {k: conv(v) for k, v in self.atom_extras.items()}
        new.system_extras = {k: conv(v) for k, v in self.system_extras.items()}
        return new

    def clone(self) -> Batch:
        """A deep copy (every tensor cloned)."""
        new = Batch.__new__(Batch)
        for name in (*PER_ATOM_FIELDS, *PER_SYSTEM_FIELDS):
            object.__setattr__(new, name, getattr(self, name).clone())
        new.atom_extras = {k: v.clone() for k, v in self.atom_extras.items()}
        new.system_extras = {k: v.clone() for k, v in self.system_extras.items()}
        return new

    def detach(self) -> Batch:
        """A shallow copy with every tensor detached from autograd."""
        new = Batch.__new__(Batch)
        for name in (*PER_ATOM_FIELDS, *PER_SYSTEM_FIELDS):
            object.__setattr__(new, name, getattr(self, name).detach())
        new.atom_extras = {k: v.detach() for k, v in self.atom_extras.items()}
        new.system_extras = {k: v.detach() for k, v in self.system_extras.items()}
        return new

    @classmethod
    def from_ase(
        cls,
        atoms: Atoms | Sequence[Atoms],
        *,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ) -> Batch:
        """Build a batch from one ASE ``Atoms`` or a sequence of them.

        Ids come from ``atoms.arrays["atom_ids"]`` when present, else are numbered
        consecutively across the inputs. Needs the optional extra ``ase``.
        """
        from nvdd.core._ase import fields_from_ase

        return Batch(**fields_from_ase(atoms, dtype=dtype, device=device))

    def to_ase(self) -> list[Atoms]:
        """One ASE ``Atoms`` per system (ids in ``arrays["atom_ids"]``, energy,
        forces and stress in a single-point calculator). Needs the extra ``ase``."""
        from nvdd.core._ase import batch_to_ase

        return batch_to_ase(self.to("cpu"))

    def __repr__(self) -> str:
        extras = ""
        if self.atom_extras or self.system_extras:
            extras = f", atom_extras={sorted(self.atom_extras)}, " + (
                f"system_extras={sorted(self.system_extras)}"
            )
        return (
            f"Batch(n_atoms={self.n_atoms}, n_systems={self.n_systems}, dtype={self.dtype}, "
            f"device={self.device}{extras})"
        )


def _check_compatible(batches: Sequence[Batch], what: str) -> Batch:
    if len(batches) == 0:
        raise ValidationError(f"{what}: needs at least one batch")
    first = batches[0]
    for i, b in enumerate(batches[1:], start=1):
        if b.dtype != first.dtype or b.device != first.device:
            raise ValidationError(
                f"{what}: input {i} is {b.dtype} on {b.device}, input 0 is "
                f"{first.dtype} on {first.device}"
            )
        if set(b.atom_extras) != set(first.atom_extras) or set(b.system_extras) != set(
            first.system_extras
        ):
            raise ValidationError(
                f"{what}: input {i} has extras {sorted(b.atom_extras)}/{sorted(b.system_extras)}, "
                f"input 0 has {sorted(first.atom_extras)}/{sorted(first.system_extras)}"
            )
    return first


class TensorMemo:
    """Remembers one tensor by identity and version (content unchanged since).

    The fields of a :class:`Batch` are tensors that a caller (or a barostat)
    may replace or modify in place between two steps. Whatever a consumer
    derives from a field and keeps (a neighbour list's periodicity, a
    species table, the cell of the last halo build) is valid while the field
    is the tensor it saw, unmodified: that is what this answers. A check
    costs no device work: comparing values would be a host read on an
    accelerator. The tensor is held weakly.
    """

    def __init__(self) -> None:
        self._ref: weakref.ReferenceType[torch.Tensor] | None = None
        self._version = -1

    def __getstate__(self) -> dict[str, int]:
        """A pickled memo forgets its tensor (a cache: the copy compares by value)."""
        return {}

    def __setstate__(self, state: dict[str, int]) -> None:
        self._ref = None
        self._version = -1

    def same(self, t: torch.Tensor | None) -> bool:
        """Whether ``t`` is the remembered tensor, not modified in place since
        (writes that bypass torch's version counter are not seen)."""
        return (
            t is not None and self._ref is not None and self._ref() is t
            and t._version == self._version
        )  # fmt: skip

    def remember(self, t: torch.Tensor) -> None:
        """Remember ``t`` (weakly) at its current version."""
        self._ref = weakref.ref(t)
        self._version = t._version
