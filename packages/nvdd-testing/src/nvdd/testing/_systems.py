"""The boundary variants the conformance kit derives from a model author's batch.

Each variant keeps the atoms, species and ids of the batch and changes only the
geometry class, so any model that accepts the batch accepts every variant:

==========  =================================================================
periodic    the batch's cell, periodic on all three axes, positions wrapped
triclinic   the same periodic crystal described by a skewed cell with lattice
            vectors a, a + b, b + c (non-orthogonal, off-diagonal cell terms;
            same volume), positions wrapped into it: the physics is that of
            ``periodic``, the geometry (partition, halo images) is not
mixed       periodic on x and y, open on z (a slab; boxes reach -inf / +inf)
open        open on all axes (a cluster in the shape of the cell)
given       the batch exactly as passed
==========  =================================================================
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nvdd.core import KB_EV_PER_K, Batch, ConfigurationError, maxwell_boltzmann

__all__ = [
    "KB_EV_PER_K",
    "SYSTEMS",
    "binary_lattice",
    "boundary_variant",
    "thermal_velocities",
    "variants",
]

#: The variants :func:`boundary_variant` knows, in the kit's default order.
SYSTEMS = ("periodic", "triclinic", "mixed", "open")
_KNOWN = (*SYSTEMS, "given")

#: Unimodular change of lattice basis of the triclinic variant: ``cell' = _BASIS @ cell``
#: (rows a, a + b, b + c): the same lattice, hence the same crystal, in a skewed cell.
_BASIS = ((1.0, 0.0, 0.0), (1.0, 1.0, 0.0), (0.0, 1.0, 1.0))
_PBC = {
    "periodic": (True, True, True),
    "triclinic": (True, True, True),
    "mixed": (True, True, False),
    "open": (False, False, False),
}


def _check_cells(batch: Batch, name: str) -> None:
    volume = torch.linalg.det(batch.cell.double()).abs()
    if bool((volume < 1e-6).any()):
        raise ConfigurationError(
            f"the {name!r} variant needs a cell with a positive volume for every system (cell "
            f"volumes {volume.tolist()}); give the batch a cell, or use systems=('given',) / "
            "('open',) for a molecule"
        )


def boundary_variant(batch: Batch, name: str) -> Batch:
    """``batch`` as the boundary variant ``name`` (see the module docstring).

    Raises
    ------
    ConfigurationError
        For an unknown name, or a variant that needs a cell the batch lacks.
    """
    if name not in _KNOWN:
        raise ConfigurationError(f"unknown system variant {name!r}; known: {list(_KNOWN)}")
    if name == "given":
        return batch.clone()
    _check_cells(batch, name)
    cell = batch.cell.double()
    if name == "triclinic":
        cell = torch.tensor(_BASIS, dtype=torch.float64) @ cell
    inv = torch.linalg.inv(cell).index_select(0, batch.system_index)
    frac = torch.bmm(batch.positions.double().unsqueeze(1), inv).squeeze(1)
    frac = frac - torch.floor(frac)  # wrapped on every axis: inside the cell
    per_atom = cell.index_select(0, batch.system_index)
    positions = torch.bmm(frac.unsqueeze(1), per_atom).squeeze(1)
    pbc = torch.tensor(_PBC[name]).expand(batch.n_systems, 3).clone()
    return batch.replace(
        positions=positions.to(batch.dtype), cell=cell.to(batch.dtype), pbc=pbc, validate=True
    )


def binary_lattice(
    cells: tuple[int, int, int],
    spacing: float = 2.2,
    *,
    seed: int = 0,
    jitter: float = 0.1,
    species: tuple[int, int] = (8, 14),
    fraction: float = 2 / 3,
    id_step: int = 3,
) -> Batch:
    """A small periodic test system of two elements on a jittered simple-cubic lattice.

    ``cells[0] x cells[1] x cells[2]`` sites ``spacing`` apart (Angstrom) in an
    orthorhombic periodic cell, each moved by a normal ``jitter`` (Angstrom),
    each of element ``species[0]`` with probability ``fraction`` and else
    ``species[1]`` (by default O and Si, 2:1: a silica-like system), with
    shuffled, non-contiguous ids (``k * id_step + id_step - 1``). float64;
    the same batch for the same arguments (drawn from ``seed``).

    Returns
    -------
    Batch
        One system of ``prod(cells)`` atoms.
    """
    g = torch.Generator().manual_seed(seed)
    axes = [torch.arange(k, dtype=torch.float64) for k in cells]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    m = grid.shape[0]
    noise = torch.randn(m, 3, generator=g, dtype=torch.float64)
    return Batch(
        positions=(grid + 0.5) * spacing + jitter * noise,
        atomic_numbers=torch.where(torch.rand(m, generator=g) < fraction, *species),
        cell=torch.diag(torch.tensor(cells, dtype=torch.float64) * spacing),
        pbc=[True, True, True],
        atom_ids=torch.randperm(m, generator=g) * id_step + id_step - 1,
    )


def thermal_velocities(batch: Batch, temperature_K: float, seed: int = 0) -> torch.Tensor:
    """Maxwell-Boltzmann velocities (ASE units), zero total momentum per system;
    drawn in float64 from ``seed`` (the same on every call): :func:`nvdd.core.maxwell_boltzmann`."""
    return maxwell_boltzmann(
        batch.masses, temperature_K, seed=seed, system_index=batch.system_index, dtype=batch.dtype
    ).to(batch.device)


def variants(batch: Batch, systems: Sequence[str], temperature_K: float) -> list[tuple[str, Batch]]:
    """Every requested variant, with thermal velocities when the batch has none."""
    out = []
    moving = bool(batch.velocities.abs().max() > 0) if batch.n_atoms else False
    for name in systems:
        b = boundary_variant(batch, name)
        if not moving and temperature_K > 0:
            b = b.replace(velocities=thermal_velocities(b, temperature_K))
        out.append((name, b))
    return out
