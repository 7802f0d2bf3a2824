"""Rank bodies of test_it_faces (kept free of pytest)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from it_systems import AR_A, FCC

from nvdd.core import Batch
from nvdd.dynamics import ASE_TIME_PER_FS, DomainConfig, DomainParallel, VelocityVerlet
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


#: The skin-0 case of issue 17: cell length along the cut axis, and the LJ cutoff.
JUMP_L, JUMP_RC = 29.1, 8.5
#: Atom masses that keep an atom in place to the last bit over a few steps (the
#: model reads only atomic numbers; 0.5 F/m dt^2 is ~1e-37 A here).
PINNED_AMU = 1.0e30


def _ulps(x: float, k: int) -> float:
    for _ in range(abs(k)):
        x = math.nextafter(x, math.inf if k > 0 else -math.inf)
    return x


def faces_and_a_jumper(jump: float = 36.0) -> Batch:
    """Issue 17's skin-0 case: periodic argon, ``29.1 x 17 x 17`` A, cut into 2
    boxes along x (``grid (2, 1, 1)``, boxes 14.55 A long), LJ cutoff 8.5 A.

    Rows 0-5 are three pairs across the periodic face ``x = 0``, pinned (huge
    masses) so their geometry holds bit for bit: a face atom at ``x = -ulp(L)``,
    ``0`` or ``-2 ulp(L)`` (a position within rounding below the face stays there,
    owned by box 0) and a partner owned by box 1 a few units in the last place
    inside the cutoff, i.e. a ghost of box 0 exactly at the edge of its ghost
    width. Row 6 moves ``jump`` A along x in each step (36 A from x = 14: across
    the cut at 14.55, the face at 29.1 and the cut again at 43.65, three
    sub-domains in one step). Rows 7-9 are a sparse background.
    """
    length, rc = JUMP_L, JUMP_RC
    rows = [
        [-math.ulp(length), 4.0, 4.0],
        [20.6, 4.0, 4.0],  # |x - (L - ulp)| = rc - 2 ulp
        [0.0, 12.5, 4.0],
        [_ulps(length - rc, 1), 12.5, 4.0],
        [-2 * math.ulp(length), 4.0, 12.5],
        [20.599999999999998, 4.0, 12.5],
        [14.0, 12.5, 12.5],  # the jumper
        [7.0, 8.0, 8.0],
        [25.0, 8.5, 8.5],
        [12.0, 0.5, 8.5],
    ]
    n = len(rows)
    masses = torch.full((n,), 39.948, dtype=torch.float64)
    masses[:6] = PINNED_AMU
    velocities = torch.zeros(n, 3, dtype=torch.float64)
    velocities[6, 0] = jump / ASE_TIME_PER_FS  # dt = 1 fs
    return Batch(
        positions=torch.tensor(rows, dtype=torch.float64),
        atomic_numbers=torch.full((n,), 18),
        cell=torch.diag(torch.tensor([length, 17.0, 17.0], dtype=torch.float64)),
        pbc=[True] * 3,
        masses=masses,
        velocities=velocities,
        atom_ids=torch.arange(n, dtype=torch.int64),
    )


def skin_zero_steps(batch: Batch, n_steps: int) -> list[tuple[torch.Tensor, ...]] | None:
    """``n_steps`` velocity-Verlet steps at skin 0 on grid ``(2, 1, 1)``; rank 0:
    ``(atom_ids, positions, forces, energy)`` after the partition and each step."""
    dyn = VelocityVerlet(lj(JUMP_RC), batch, dt_fs=1.0)
    config = DomainConfig(cutoff=JUMP_RC, skin=0.0, grid_dims=(2, 1, 1))
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a sparse test system)
        with DomainParallel(dyn, config) as dp:
            dp.partition()
            for step in range(n_steps + 1):
                if step:
                    dp.run(1)
                g = dp.gather(0)
                if g is not None:
                    out.append((g.atom_ids, g.positions, g.forces, g.energy))
    return out or None


def pair_at_the_ghost_width() -> Batch:
    """One pair across the periodic face of a 2-box cut along x: B at
    ``x = L - ulp(L)`` (box 1), A at ``x = B - L + rc - 2 ulp`` (box 0), so A's image
    is a ghost of box 1 exactly at the ghost width at skin 0; two far atoms give
    every box an owned atom."""
    xb = _ulps(JUMP_L, -1)
    rows = [[xb, 3.0, 3.0], [_ulps(xb - JUMP_L + JUMP_RC, -2), 3.0, 3.0]]
    rows += [[7.0, 13.0, 13.0], [22.0, 13.0, 13.0]]
    n = len(rows)
    return Batch(
        positions=torch.tensor(rows, dtype=torch.float64),
        atomic_numbers=torch.full((n,), 18),
        cell=torch.diag(torch.tensor([JUMP_L, 20.0, 20.0], dtype=torch.float64)),
        pbc=[True] * 3,
        velocities=torch.zeros(n, 3, dtype=torch.float64),
        atom_ids=torch.arange(n, dtype=torch.int64),
    )


def pair_forces(skin: float) -> tuple[torch.Tensor, ...] | None:
    """Rank body: the decomposed forces of :func:`pair_at_the_ghost_width` (grid
    (2, 1, 1)); rank 0 returns ``(ids, positions, forces)``.

    **Collective** over the default group.
    """
    dyn = VelocityVerlet(lj(JUMP_RC), pair_at_the_ghost_width(), dt_fs=1.0)
    config = DomainConfig(cutoff=JUMP_RC, skin=skin, grid_dims=(2, 1, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a four-atom system is degenerate
        with DomainParallel(dyn, config) as dp:
            dp.partition()
            dyn.ensure_forces()
            g = dp.gather(0)
    return None if g is None else (g.atom_ids, g.positions, g.forces)
