"""Rank bodies of test_it_faces (kept free of pytest)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from it_systems import AR_A, FCC

from nvdd.core import Batch
from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet
from nvdd.models import LennardJones, LJConfig
from nvdd.spec import StrategyKind


def fcc_with_atom_at(y0: float, a: float = AR_A) -> Batch:
    """108-atom FCC argon (3x3x3 cubic cells, periodic) with atom 0 moved to
    ``y = y0`` (it sits at y = 0 on the lattice)."""
    g = torch.stack(torch.meshgrid(*[torch.arange(3, dtype=torch.float64)] * 3, indexing="ij"), -1)
    pos = (g.reshape(-1, 1, 3) + FCC).reshape(-1, 3) * a
    pos[0, 1] = y0
    z = torch.full((108,), 18)
    return Batch(
        positions=pos,
        atomic_numbers=z,
        cell=torch.eye(3, dtype=torch.float64) * 3 * a,
        pbc=[True] * 3,
    )


def two_atoms_across_a_cut(dtype: torch.dtype) -> Batch:
    """Two atoms 3 A apart on either side of the cut x = 5 of an open 10 A box:
    each rank receives exactly one ghost row."""
    pos = torch.tensor([[3.5, 5.0, 5.0], [6.5, 5.0, 5.0]], dtype=torch.float64)
    b = Batch(
        positions=pos,
        atomic_numbers=torch.full((2,), 18),
        cell=torch.eye(3, dtype=torch.float64) * 10.0,
        pbc=[False] * 3,
    )
    return b.to(dtype=dtype)


def lj(cutoff: float, dtype: torch.dtype = torch.float64) -> LennardJones:
    return LennardJones(LJConfig(cutoff=cutoff, epsilon=0.0104, sigma=3.40)).to(dtype)


def single_point(batch: Batch, cutoff: float, grid: Any, strategy: str = "halo") -> Any:
    """The decomposed forces and energy of ``batch`` (rank 0: the gathered batch)."""
    dyn = VelocityVerlet(lj(cutoff, batch.dtype), batch, dt_fs=1.0)
    config = DomainConfig(cutoff=cutoff, skin=0.5, grid_dims=grid, strategy=StrategyKind(strategy))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small test systems are degenerate
        with DomainParallel(dyn, config) as dp:
            dp.partition()
            return dp.single_point(dst=0)
