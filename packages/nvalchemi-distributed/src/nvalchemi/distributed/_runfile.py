"""Run files for ``nvdd run --run-file FILE``: a system and a (composed) model in TOML.

Example (LJ + Ewald on rock salt)::

    [system]
    builtin = "nacl"        # rock-salt NaCl, charges +1 / -1 (or: structure = "x.extxyz",
                            # a path relative to this file's folder)
    cells = 4               # conventional cells per edge (8 atoms each)
    charges = { 11 = 1.0, 17 = -1.0 }   # per element; required with `structure`

    [[model]]
    kind = "lj"
    cutoff = 8.0
    species = { 11 = [0.1, 2.35], 17 = [0.1, 4.0] }   # epsilon (eV), sigma (A)
    pairs = { "11-17" = [0.5, 2.6] }

    [[model]]
    kind = "ewald"          # or "pme"
    cutoff = 8.0
    accuracy = 1e-6

Components: ``lj``, ``mpnn``, ``ewald``, ``pme``, ``d3`` (keys: their config
fields; ``d3`` also ``functional``). Two or more components make an
``nvdd.models.PipelineModel``, which ``DomainParallel`` runs under one halo as
wide as the widest component needs.
"""

from __future__ import annotations

import itertools
import tomllib
from pathlib import Path
from typing import Any

import torch

from nvdd.core import (
    Batch,
    ConfigurationError,
    NvddError,
    OptionalDependencyError,
    maxwell_boltzmann,
)

__all__ = ["build_model", "build_system", "load_run_file", "rocksalt", "run_file_problems"]

NACL_A = 5.64  # Angstrom
_MASSES = {11: 22.99, 17: 35.45}
_TOP_KEYS = ("model", "system")
_SYSTEM_KEYS = ("builtin", "cells", "charges", "jitter", "structure")


def load_run_file(path: str | Path) -> dict[str, Any]:
    """The parsed run file (``system`` table and ``model`` array). A relative
    ``[system] structure`` path is made relative to the run file's folder.

    Raises
    ------
    ConfigurationError
        Unreadable TOML, or no ``[[model]]`` entry.
    """
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(f"run file {str(path)!r}: {exc}") from exc
    if not data.get("model"):
        raise ConfigurationError(f"run file {str(path)!r} has no [[model]] entry")
    system = data.get("system")
    if isinstance(system, dict) and isinstance(system.get("structure"), str):
        system["structure"] = str(Path(path).parent / Path(system["structure"]).expanduser())
    return data


def _int_keys(table: dict[str, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in table.items()}


def _component(entry: dict[str, Any]) -> Any:
    try:
        import nvdd.models as m
    except ImportError as exc:
        raise OptionalDependencyError(
            "nvdd-models", "--run-file", extra="nvalchemi-distributed[models]", cause=exc
        ) from exc
    entry = dict(entry)
    kind = entry.pop("kind", None)
    try:
        if kind == "lj":
            species = {
                z: (float(v[0]), float(v[1]))
                for z, v in _int_keys(entry.pop("species", {})).items()
            }
            pairs: dict[tuple[int, int], tuple[float, float]] = {}
            for key, v in entry.pop("pairs", {}).items():
                a, b = (int(z) for z in str(key).split("-"))
                pairs[(a, b)] = (float(v[0]), float(v[1]))
            return m.LennardJones(m.LJConfig(species=species, pairs=pairs, **entry))
        if kind == "mpnn":
            return m.ReferenceMPNN(m.MPNNConfig(**entry))
        if kind == "ewald":
            return m.Ewald(m.EwaldConfig(**entry))
        if kind == "pme":
            if "mesh" in entry:
                entry["mesh"] = tuple(entry["mesh"])
            return m.ParticleMeshEwald(m.PMEConfig(**entry))
        if kind == "d3":
            name = entry.pop("functional", None)
            if name is not None:
                return m.DFTD3(m.D3Config.from_functional(name, **entry))
            return m.DFTD3(m.D3Config(**entry))
    except (TypeError, ValueError, IndexError) as exc:
        raise ConfigurationError(f"run file: [[model]] kind = {kind!r}: {exc}") from exc
    raise ConfigurationError(
        f"run file: unknown [[model]] kind {kind!r} (lj, mpnn, ewald, pme, d3)"
    )


def build_model(data: dict[str, Any]) -> Any:
    """The model of a run file: one component, or a ``PipelineModel`` of several."""
    parts = [_component(e) for e in data["model"]]
    if len(parts) == 1:
        return parts[0]
    from nvdd.models import PipelineModel

    return PipelineModel(parts)


def rocksalt(
    cells: int, *, dtype: torch.dtype, temperature_k: float, seed: int, jitter: float = 0.0
) -> Batch:
    """Rock-salt NaCl, ``cells**3`` conventional cells (8 atoms each), charges +1 / -1,
    Maxwell-Boltzmann velocities with zero momentum."""
    fcc = torch.tensor([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]], dtype=dtype)
    frac, z = [], []
    for ijk in itertools.product(range(cells), repeat=3):
        base = torch.tensor(ijk, dtype=dtype)
        for b in fcc:
            frac += [b + base, b + base + torch.tensor([0.5, 0.0, 0.0], dtype=dtype)]
            z += [11, 17]
    g = torch.Generator().manual_seed(seed)
    positions = torch.stack(frac) * NACL_A
    positions = positions + jitter * torch.randn(positions.shape, generator=g, dtype=dtype)
    zs = torch.tensor(z)
    masses = torch.tensor([_MASSES[int(a)] for a in z], dtype=dtype)
    v = maxwell_boltzmann(masses, temperature_k, generator=g)
    cell = torch.eye(3, dtype=dtype) * cells * NACL_A
    positions = torch.remainder(positions, cells * NACL_A)
    charges = torch.where(zs == 11, 1.0, -1.0).to(dtype)
    return Batch(
        positions=positions,
        atomic_numbers=zs,
        masses=masses,
        velocities=v,
        cell=cell,
        pbc=[True, True, True],
        atom_extras={"charges": charges},
    )


def build_system(
    data: dict[str, Any],
    *,
    dtype: torch.dtype,
    device: torch.device,
    temperature_k: float,
    seed: int,
) -> Batch:
    """The system of a run file (a built-in crystal, or a structure file with charges)."""
    system = dict(data.get("system", {}))
    if "structure" in system:
        from nvalchemi.distributed._structure import read_structure

        # one frame (FILE@INDEX for a trajectory), as checked before launch
        label = f"[system] structure = {str(system['structure'])!r}"
        atoms = read_structure(str(system["structure"]), label)
        batch = Batch.from_ase(atoms, dtype=dtype, device=device)
        if "charges" in system:
            from nvdd.models import assign_charges

            batch = assign_charges(batch, _int_keys(system["charges"]))
        return batch
    builtin = system.get("builtin", "nacl")
    if builtin != "nacl":
        raise ConfigurationError(f"run file: unknown [system] builtin {builtin!r} (nacl)")
    batch = rocksalt(
        int(system.get("cells", 3)),
        dtype=dtype,
        temperature_k=temperature_k,
        seed=seed,
        jitter=float(system.get("jitter", 0.0)),
    )
    if "charges" in system:
        from nvdd.models import assign_charges

        batch = assign_charges(batch, _int_keys(system["charges"]))
    return batch.to(device)


def _system_problems(system: Any, periodic: bool) -> list[str]:
    """The ``[system]`` table's keys and values, its structure file read."""
    if not isinstance(system, dict):
        return [f"[system] must be a table, got {system!r}"]
    out = []
    unknown = sorted(set(system) - set(_SYSTEM_KEYS))
    if unknown:
        out.append(f"[system]: unknown key(s) {unknown} (known: {', '.join(_SYSTEM_KEYS)})")
    charges = system.get("charges", {})
    if not isinstance(charges, dict):
        out.append(f"[system] charges must be a table {{ Z = charge }}, got {charges!r}")
    else:
        for key, q in charges.items():
            if not str(key).isdigit():
                out.append(f"[system] charges: key {key!r} is not an atomic number")
            elif isinstance(q, bool) or not isinstance(q, int | float) or q != q:
                out.append(f"[system] charges: {key} = {q!r} is not a number")
    if "structure" in system:
        from nvalchemi.distributed._structure import read_structure, structure_problems

        label = f"[system] structure = {str(system['structure'])!r}"
        try:
            atoms = read_structure(str(system["structure"]), label)
        except ValueError as exc:
            return [*out, str(exc)]
        out += structure_problems(label, atoms, periodic=periodic)
    else:
        builtin = system.get("builtin", "nacl")
        if builtin != "nacl":
            out.append(f"[system] builtin = {builtin!r}: unknown (nacl)")
        cells = system.get("cells", 3)
        if isinstance(cells, bool) or not isinstance(cells, int) or cells < 1:
            out.append(f"[system] cells must be an integer >= 1, got {cells!r}")
    return out


def _coverage(i: int, entry: dict[str, Any], part: Any, batch: Batch) -> list[str]:
    """Whether component ``part`` (``[[model]]`` number ``i``) can run on ``batch``:
    per-species parameters for every element, charges for electrostatics."""
    from nvdd.models import Ewald, ParticleMeshEwald

    what = f"[[model]] {i} (kind = {entry.get('kind')!r})"
    present = sorted({int(z) for z in batch.atomic_numbers.tolist()})
    rows = getattr(part, "species_rows", None)
    if isinstance(rows, torch.Tensor):
        table = rows.tolist()
        missing = [z for z in present if z >= len(table) or table[z] < 0]
        if missing:
            return [f"{what}: no parameters for atomic number(s) {missing} of the system"]
    if isinstance(part, Ewald | ParticleMeshEwald) and "charges" not in batch.atom_extras:
        return [f"{what} needs per-atom charges: add [system] charges = {{ Z = charge, ... }}"]
    return []


def _launcher_text(exc: BaseException) -> str:
    """An error's text as the launcher says it: the model layer names "rank 0",
    which before launch is no rank at all."""
    text = str(exc) if isinstance(exc, NvddError) else f"{type(exc).__name__}: {exc}"
    return text.replace("rank 0: ", "")


def run_file_problems(path: str | Path, *, periodic: bool = False) -> list[str]:
    """What is wrong with the run file ``path`` (empty: good to launch).

    Local, before any rank starts: the TOML, the ``[system]`` table (its structure
    file read and checked; ``periodic``: every axis periodic, for NPT), every
    ``[[model]]`` component and the system built as the ranks will build them
    (on the CPU, in float64), and each component's coverage of the system's
    elements (per-species parameters, charges for Ewald and PME).
    """
    try:
        data = load_run_file(path)
    except ConfigurationError as exc:
        return [str(exc)]
    out = []
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        out.append(f"unknown table(s) {unknown} (known: {', '.join(_TOP_KEYS)})")
    out += _system_problems(data.get("system", {}), periodic)
    entries = data["model"] if isinstance(data["model"], list) else [data["model"]]
    parts: list[tuple[int, dict[str, Any], Any]] = []
    for i, entry in enumerate(entries, start=1):
        if not isinstance(entry, dict):
            out.append(f"[[model]] {i} must be a table, got {entry!r}")
            continue
        try:
            parts.append((i, entry, _component(entry)))
        except Exception as exc:  # any constructor error is the user's input
            out.append(f"[[model]] {i}: {_launcher_text(exc)}")
    if out:
        return out
    try:
        batch = build_system(
            data, dtype=torch.float64, device=torch.device("cpu"), temperature_k=0.0, seed=0
        )
    except Exception as exc:  # (bad charges, a batch that does not validate)
        return [f"[system]: {_launcher_text(exc)}"]
    for i, entry, part in parts:
        out += _coverage(i, entry, part, batch)
    return out
