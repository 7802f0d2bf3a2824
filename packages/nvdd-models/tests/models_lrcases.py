"""Systems and a decomposed runner for the long-range and dispersion models (gloo tests).

Like ``models_ddcases.py``, the runner does what the runtime
(``nvdd.dynamics.DistributedModel``) does, with nvdd-halo directly: own the
atoms of a box, build the halo plan, lay out ``[owned | ghost]`` rows (open
boundaries, real cell, charges copied to ghosts), run the model inside the DD
context, fold forces into owners and sum the per-rank partials the spec
declares partial. Everything is deterministic in its arguments, so every rank
and the single-process oracle build the same systems.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from models_ddcases import owned_rows

from nvdd.core import Batch
from nvdd.halo import ParticleHaloConfig, build_halo_plan
from nvdd.models import (
    CHARGES,
    DFTD3,
    D3Config,
    Ewald,
    EwaldConfig,
    ParticleMeshEwald,
    PMEConfig,
    assign_charges,
)
from nvdd.shardtensor import DDContext, dd_scope
from nvdd.spec import MLIPSpec

#: Halo width beyond the model's cutoff (the runtime's skin).
HALO_MARGIN = 0.3
NACL_A = 5.64

#: name -> (world, rank grid, system). Systems: ``nacl`` (64 ions of rock salt),
#: ``liquid`` (64 ions, random neutral charges), their 512-ion versions (``nacl512``,
#: ``liquid512``: issue 15's 500 to 4,000 atoms) and ``carbon`` (125 C / H atoms,
#: random neutral charges: carbon's D3 coordination numbers lie between its
#: reference values, so a stale ghost CN changes C6; in Na / Cl systems it cannot);
#: a ``-tri`` suffix gives the same system in a triclinic cell.
LR_CASES: dict[str, tuple[int, tuple[int, int, int], str]] = {
    "nacl-2": (2, (2, 1, 1), "nacl"),
    "liquid-tri-3": (3, (3, 1, 1), "liquid-tri"),
    "nacl-tri-4": (4, (2, 2, 1), "nacl-tri"),
    "liquid-4": (4, (1, 2, 2), "liquid"),
    "nacl512-2": (2, (2, 1, 1), "nacl512"),
    "nacl512-tri-3": (3, (3, 1, 1), "nacl512-tri"),
    "liquid512-tri-4": (4, (2, 2, 1), "liquid512-tri"),
    "carbon-2": (2, (2, 1, 1), "carbon"),
    "carbon-tri-3": (3, (3, 1, 1), "carbon-tri"),
}

_TRI = ((2.0, 0.0, 0.0), (0.25, 2.0, 0.0), (-0.2, 0.3, 2.0))  # in lattice constants


def _rocksalt(cells: int) -> tuple[np.ndarray, np.ndarray]:
    """Fractional positions (of the ``cells**3`` supercell) and atomic numbers."""
    fcc = np.array([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]])
    frac, z = [], []
    for ijk in itertools.product(range(cells), repeat=3):
        for b in fcc:
            frac += [(b + ijk) / cells, (b + np.array([0.5, 0.0, 0.0]) + ijk) / cells]
            z += [11, 17]
    return np.array(frac) % 1.0, np.array(z)


def _liquid(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Fractional positions on a jittered grid (no close contacts) and alternating Na / Cl."""
    side = math.ceil(n ** (1 / 3))
    grid = np.array(list(itertools.product(range(side), repeat=3)))[:n] / side
    rng = np.random.default_rng(seed)
    frac = (grid + rng.uniform(-0.25, 0.25, size=grid.shape) / side) % 1.0
    z = np.where(np.arange(n) % 2 == 0, 11, 17)
    return frac, z[rng.permutation(n)]


def _carbon(side: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Fractional positions of a ``side**3`` grid and C / H (3:1) at random."""
    grid = (np.array(list(itertools.product(range(side), repeat=3))) + 0.5) / side
    z = np.where(np.random.default_rng(seed).uniform(size=len(grid)) < 0.75, 6, 1)
    return grid, z


def lr_batch(system: str, shift: float = 0.0) -> Batch:
    """The whole system ``system`` (charge neutral), moved by ``shift`` times a fixed field."""
    base = system.removesuffix("-tri")
    # scale: the edge of the cubic cell, in NaCl lattice constants
    if base in ("nacl", "nacl512"):
        scale = 2.0 if base == "nacl" else 4.0
        frac, z = _rocksalt(int(scale))
        jitter = 0.12
    elif base in ("liquid", "liquid512"):
        scale = 2.0 if base == "liquid" else 4.0
        frac, z = _liquid(64 if base == "liquid" else 512, seed=3)
        jitter = 0.0
    elif base == "carbon":
        scale = 10.0 / NACL_A  # 5 x 5 x 5 sites 2 A apart
        frac, z = _carbon(5, seed=5)
        jitter = 0.1
    else:
        raise ValueError(f"unknown system {system!r}")
    tri = system.endswith("tri")
    cell = NACL_A * (np.array(_TRI) * (scale / 2.0) if tri else scale * np.eye(3))
    rng = np.random.default_rng(7)
    pos = frac @ cell + jitter * rng.standard_normal(frac.shape)
    pos = (pos @ np.linalg.inv(cell) % 1.0) @ cell  # wrapped, as the runtime keeps them
    n = len(pos)
    g = torch.Generator().manual_seed(11)
    direction = torch.randn(n, 3, generator=g, dtype=torch.float64)
    ids = torch.randperm(n, generator=g) * 2 + 3
    batch = Batch(
        torch.tensor(pos) + shift * direction,
        torch.tensor(z),
        cell=torch.tensor(cell).unsqueeze(0),
        pbc=[True, True, True],
        atom_ids=ids,
    )
    if system.startswith("nacl"):
        return assign_charges(batch, {11: 1.0, 17: -1.0})
    # A random neutral liquid (or carbon): charges drawn per atom, shifted to sum to zero.
    q = torch.tensor(rng.uniform(-1.0, 1.0, size=n))
    return batch.replace(atom_extras={CHARGES: q - q.mean()})


def make_lr_model(kind: str, spec: MLIPSpec | None = None) -> Any:
    """The models under test (identical on every rank and in the oracle)."""
    if kind == "ewald":
        return Ewald(EwaldConfig(cutoff=5.0, accuracy=1e-8), spec=spec)
    if kind == "pme":
        return ParticleMeshEwald(PMEConfig(cutoff=5.0, accuracy=1e-6, mesh=(20, 20, 20)), spec=spec)
    if kind == "d3":
        return DFTD3(D3Config.from_functional("pbe", cutoff=6.0, cn_cutoff=7.0), spec=spec)
    raise ValueError(kind)


def boxes(world: int, grid: tuple[int, int, int]) -> torch.Tensor:
    """Uniform fractional rank boxes ``(1, world, 2, 3)``, rank order x-major."""
    assert math.prod(grid) == world
    out = []
    for ijk in itertools.product(*(range(g) for g in grid)):
        lo = [ijk[a] / grid[a] for a in range(3)]
        hi = [(ijk[a] + 1) / grid[a] for a in range(3)]
        out.append([lo, hi])
    return torch.tensor([out], dtype=torch.float64)


def _count_collectives() -> tuple[list[int], list[int]]:
    return [], [0]


@contextlib.contextmanager
def _counting(sizes: list[int], a2a: list[int]) -> Iterator[None]:
    """Record all_reduce payload sizes and count all_to_all_single calls."""
    orig_ar, orig_a2a = dist.all_reduce, dist.all_to_all_single

    def ar(t: torch.Tensor, *a: Any, **k: Any) -> Any:
        sizes.append(t.numel())
        return orig_ar(t, *a, **k)

    def a2(*a: Any, **k: Any) -> Any:
        a2a[0] += 1
        return orig_a2a(*a, **k)

    dist.all_reduce, dist.all_to_all_single = ar, a2  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.all_reduce, dist.all_to_all_single = orig_ar, orig_a2a  # type: ignore[assignment]


def run_lr(
    kind: str,
    case: str,
    shifts: tuple[float, ...] = (0.0,),
    spec: MLIPSpec | None = None,
    extra_halo: float = 0.0,
) -> list[dict[str, Any]]:
    """Rank function: the decomposed model at each shift (a new halo plan each time).

    Returns per shift: owned ids, folded forces, the energy / virial / stress
    summed over ranks where the spec declares them partial, the raw per-rank
    energy, the all-reduce payload sizes and the all_to_all count of the forward.
    """
    world, grid, system = LR_CASES[case]
    rank = dist.get_rank()
    model = make_lr_model(kind, spec)
    spec_used = model.distribution_spec()
    bx = boxes(world, grid)
    owned = owned_rows(lr_batch(system), bx, rank)
    results = []
    for version, shift in enumerate(shifts):
        batch = lr_batch(system, shift)
        width = model.cutoff + HALO_MARGIN + spec_used.options.extra_ghost_width + extra_halo
        config = ParticleHaloConfig(boxes=bx, pbc=batch.pbc, ghost_width=width)
        pos = batch.positions[owned]
        plan = build_halo_plan(
            config, pos, batch.atom_ids[owned], batch.system_index[owned], batch.cell
        )
        q = batch.atom_extras[CHARGES][owned]
        z = batch.atomic_numbers[owned]
        padded = Batch(
            torch.cat([pos, plan.ghost_positions(pos, batch.cell)]),
            torch.cat([z, plan.forward(z)]),
            cell=batch.cell,
            pbc=torch.zeros_like(batch.pbc),
            system_index=torch.cat([batch.system_index[owned], plan.ghost_system_index]),
            atom_ids=torch.cat([batch.atom_ids[owned], plan.ghost_atom_ids]),
            atom_extras={CHARGES: torch.cat([q, plan.forward(q)])},
            validate=False,
        )
        sizes, a2a = _count_collectives()
        ctx = DDContext(layout=plan, positions=padded.positions, topology_version=version)
        with dd_scope(ctx), _counting(sizes, a2a):
            out = model(padded)
        n = plan.n_owned
        f = out["forces"].detach()
        totals = {}
        for key in ("energy", "virial", "stress"):
            value = out[key].detach().clone()
            if spec_used.output(key).effective_reduce().value == "all_reduce":
                dist.all_reduce(value)
            totals[key] = value
        results.append(
            {
                "ids": padded.atom_ids[:n],
                "forces": f[:n] + plan.reverse(f[n:]),
                "atom_energies": out["atom_energies"][:n],
                "energy_rank": out["energy"].detach().clone(),
                "all_reduce_sizes": sizes,
                "all_to_all": a2a[0],
                "n_ghost": plan.n_ghost,
                **totals,
            }
        )
    return results
