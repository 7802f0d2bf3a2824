"""Rank bodies of the ensemble suite: Nose-Hoover NVT and MTK NPT under DD.

Kept free of pytest: the gloo tests call these through ``run_ranks`` and the
benchmark script (``benchmarks/bench_ensembles.py``) calls them for longer runs.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from it_systems import FCC, LJ_CUTOFF, crystal, lj_model

from nvdd.core import Batch, maxwell_boltzmann
from nvdd.dynamics import (
    MTKNPT,
    CellDOF,
    DomainConfig,
    DomainParallel,
    HookStage,
    NoseHooverNVT,
)

#: Target temperature and pressure of the suite (argon: LJ epsilon 0.0104 eV).
T_K = 100.0
P_BAR = 500.0


def liquid(seed: int = 0, cells: int = 3, a: float = 5.75) -> Batch:
    """A disordered argon-like system at liquid density: an expanded FCC lattice
    (``a`` = 5.75 A: 0.021 atoms/A**3) with 0.35 A random displacements and
    velocities at 2 T_K (it melts within a few hundred fs)."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.stack(
        torch.meshgrid(*[torch.arange(cells, dtype=torch.float64)] * 3, indexing="ij"), -1
    )
    frac = (grid.reshape(-1, 1, 3) + FCC).reshape(-1, 3)
    n = frac.shape[0]
    pos = frac * a + 0.35 * torch.randn(n, 3, generator=g, dtype=torch.float64)
    b = Batch(
        positions=pos,
        atomic_numbers=torch.full((n,), 18),
        cell=torch.eye(3, dtype=torch.float64) * cells * a,
        pbc=[True] * 3,
        atom_ids=torch.randperm(n, generator=g) * 5 + 2,
    )
    return b.replace(velocities=maxwell_boltzmann(b.masses, 2 * T_K, generator=g))


def system(name: str, cells: int = 3) -> Batch:
    """``liquid`` (``4 cells**3`` atoms, cubic), ``liquid-eq`` (the same near its
    equilibrium density at T_K and P_BAR) or ``triclinic`` (125 atoms, FCC
    primitive cell)."""
    if name == "liquid":
        return liquid(cells=cells)
    if name == "liquid-eq":
        return liquid(cells=cells, a=5.95)
    return crystal("triclinic", temperature_k=T_K)


def integrator(kind: str, batch: Batch, dt: float = 4.0, **kw: Any) -> Any:
    """``nvt-nh``, ``npt-iso`` or ``npt-full`` on LJ (cutoff 6 A, or ``model``),
    tau_t 100 fs, tau_p 400 fs unless given."""
    model = kw.get("model") or lj_model()
    if kind == "nvt-nh":
        return NoseHooverNVT(model, batch, dt_fs=dt, temperature_K=T_K, tau_fs=100.0)
    return MTKNPT(
        model,
        batch,
        dt_fs=dt,
        temperature_K=T_K,
        pressure_bar=kw.get("pressure_bar", P_BAR),
        tau_t_fs=100.0,
        tau_p_fs=kw.get("tau_p_fs", 400.0),
        cell_dof=CellDOF.ISOTROPIC if kind == "npt-iso" else CellDOF.FULL,
    )


def _observe(dyn: Any, out: dict[str, list[float]]) -> None:
    out["conserved"].append(float(dyn.conserved_energy()[0]))
    if isinstance(dyn, MTKNPT):
        out["volume"].append(float(dyn.volume()[0]))
        out["pressure"].append(float(dyn.pressure()[0]))


def run_dd(
    name: str,
    kind: str,
    steps: int,
    grid: tuple[int, int, int] | None,
    cells: int = 3,
    **kw: Any,
) -> dict[str, Any]:
    """The decomposed run; rank 0 returns the gathered final state and the series
    of the conserved energy (and volume, pressure under NPT) at every step."""
    dyn = integrator(kind, system(name, cells), **kw)
    series: dict[str, list[float]] = {"conserved": [], "volume": [], "pressure": []}
    config = DomainConfig(cutoff=LJ_CUTOFF, skin=0.5, grid_dims=grid)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small test systems are often degenerate
        with DomainParallel(dyn, config) as dp:
            dp.partition()
            dp.register_hook(HookStage.AFTER_STEP, lambda ctx: _observe(ctx.dynamics, series))
            dp.run(steps)
            cells = [torch.zeros(3, 3, dtype=torch.float64) for _ in range(dp.world_size)]
            dist.all_gather(cells, dyn.batch.cell[0].contiguous())
            final = dp.gather(0)
            stats = dp.stats
    if final is None:
        return {}
    return {
        "ids": final.atom_ids,
        "positions": final.positions,
        "velocities": final.velocities,
        "masses": final.masses,
        "forces": final.forces,
        "energy": final.energy,
        "stress": final.stress,
        "cell": final.cell[0],
        "cells_identical": all(torch.equal(c, cells[0]) for c in cells),
        "rebuilds": stats.rebuilds,
        "migrated": stats.migrated,
        **series,
    }


def single(name: str, kind: str, steps: int, cells: int = 3, **kw: Any) -> dict[str, Any]:
    """The single-process reference."""
    dyn = integrator(kind, system(name, cells), **kw)
    series: dict[str, list[float]] = {"conserved": [], "volume": [], "pressure": []}
    dyn.register_hook(HookStage.AFTER_STEP, lambda ctx: _observe(ctx.dynamics, series))
    dyn.run(steps)
    b = dyn.batch
    return {
        "ids": b.atom_ids,
        "positions": b.positions,
        "forces": b.forces,
        "energy": b.energy,
        "stress": b.stress,
        "cell": b.cell[0],
        **series,
    }


def drift(series: list[float]) -> float:
    """Slope of a least-squares line through the series (eV per step)."""
    n = len(series)
    x = torch.arange(n, dtype=torch.float64)
    y = torch.tensor(series, dtype=torch.float64)
    xm, ym = x.mean(), y.mean()
    return float(((x - xm) * (y - ym)).sum() / ((x - xm) ** 2).sum())


def block_mean(series: list[float], n_blocks: int = 8) -> tuple[float, float]:
    """Mean and its standard error from ``n_blocks`` block averages (blocks long
    enough to be nearly independent)."""
    y = torch.tensor(series, dtype=torch.float64)
    size = len(series) // n_blocks
    blocks = y[: size * n_blocks].reshape(n_blocks, size).mean(dim=1)
    return float(blocks.mean()), float(blocks.std() / math.sqrt(n_blocks))


def argon_npt(
    steps: int, equilibrate: int, grid: tuple[int, int, int] | None, cells: int = 3
) -> dict[str, Any]:
    """NPT argon liquid (``4 cells**3`` atoms); rank 0 returns the production series."""
    out = run_dd("liquid-eq", "npt-iso", steps, grid, cells, tau_p_fs=500.0)
    if not out:
        return {}
    return {
        "volume": out["volume"][equilibrate:],
        "pressure": out["pressure"][equilibrate:],
        "rebuilds": out["rebuilds"],
        "final": {k: out[k] for k in ("positions", "velocities", "masses", "cell")},
    }
