"""Bodies every rank runs in the integration suite (kept free of pytest)."""

from __future__ import annotations

import warnings
from typing import Any

from it_systems import crystal, model_for

from nvdd.core import Batch
from nvdd.dynamics import (
    FIRE,
    DomainConfig,
    DomainParallel,
    HookScope,
    HookStage,
    VelocityVerlet,
    kinetic_energy,
)
from nvdd.spec import CompilePolicy, MLIPSpec, StrategyKind
from nvdd.testing import assert_same_ids


def _start(
    kind: str,
    model_name: str,
    dt: float,
    species: tuple[int, ...],
    integrator: str,
    temperature_k: float,
) -> tuple[Any, Batch, float]:
    """The integrator under test (FIRE for ``"fire"``, else velocity Verlet) on the
    starting crystal, that crystal, and the model's cutoff."""
    model, cutoff = model_for(model_name)
    batch = crystal(kind, species=species, temperature_k=temperature_k)
    if integrator == "fire":
        dyn: Any = FIRE(model, batch, dt_fs=dt, fmax=1e-3)
    else:
        dyn = VelocityVerlet(model, batch, dt_fs=dt)
    return dyn, batch, cutoff


def _state(batch: Batch) -> dict[str, Any]:
    """The compared per-atom and per-system fields of a final batch."""
    return {
        "ids": batch.atom_ids,
        "positions": batch.positions,
        "forces": batch.forces,
        "energy": batch.energy,
    }


def run_dd(
    kind: str,
    model_name: str,
    n_steps: int,
    dt: float,
    grid: tuple[int, int, int] | None,
    skin: float = 0.5,
    species: tuple[int, ...] = (18,),
    every: int = 0,
    integrator: str = "nve",
    temperature_k: float = 60.0,
    strategy: str = "halo",
) -> dict[str, Any]:
    """Run the decomposed dynamics; rank 0 returns the gathered final state."""
    dyn, batch, cutoff = _start(kind, model_name, dt, species, integrator, temperature_k)
    # halo_on_one_rank: a 1-rank case exercises the halo path (periodic images)
    config = DomainConfig(
        cutoff=cutoff,
        skin=skin,
        grid_dims=grid,
        strategy=StrategyKind(strategy),
        halo_on_one_rank=True,
    )
    energies: list[float] = []
    ids_ok: list[bool] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small test systems are often degenerate
        dp = DomainParallel(dyn, config)
        with dp:
            if every:

                def thermo(ctx: Any) -> None:
                    ke = float(kinetic_energy(ctx.batch, dyn.reducer).sum())
                    energies.append(float(ctx.batch.energy.sum()) + ke)

                dp.register_hook(HookStage.AFTER_STEP, thermo, every=every, needs=["energy"])

                def conserved(ctx: Any) -> None:
                    assert_same_ids(ctx.batch.atom_ids, batch.atom_ids, "atom set")
                    ids_ok.append(True)

                dp.register_hook(
                    HookStage.AFTER_STEP, conserved, every=every, scope=HookScope.GLOBAL
                )
            dp.partition()
            converged = dp.run(n_steps)
            final = dp.gather(0)
            stats = dp.stats
    if final is None:
        return {}
    return {
        **_state(final),
        "energies": energies,
        "rebuilds": stats.rebuilds,
        "migrated_total": stats.migrated,
        "ids_checks": len(ids_ok),
        "n_ghost": stats.n_ghost,
        "converged": converged,
        "steps": dyn.step_count,
    }


def single(
    kind: str,
    model_name: str,
    n_steps: int,
    dt: float,
    species: tuple[int, ...] = (18,),
    every: int = 0,
    integrator: str = "nve",
    temperature_k: float = 60.0,
) -> dict[str, Any]:
    """The single-process reference (no DD wrapper)."""
    dyn, _, _ = _start(kind, model_name, dt, species, integrator, temperature_k)
    energies: list[float] = []
    if every:
        dyn.register_hook(
            HookStage.AFTER_STEP,
            lambda ctx: energies.append(
                float(ctx.batch.energy.sum() + kinetic_energy(ctx.batch).sum())
            ),
            every=every,
        )
    converged = dyn.run(n_steps)
    b = dyn.batch
    return {
        **_state(b),
        "cell": b.cell[0],
        "pbc": b.pbc[0],
        "energies": energies,
        "converged": converged,
        "steps": dyn.step_count,
    }


def lj_steady_state(strategy: str = "halo", compiled: bool = False) -> dict[str, Any]:
    """Collectives of LJ steps that rebuild nothing (after a warm-up); ``compiled``:
    the model's compiled core (backend aot_eager)."""
    model, cutoff = model_for("lj")
    kind = StrategyKind(strategy)
    spec = model.distribution_spec(kind) | MLIPSpec(
        compile=CompilePolicy(enabled=compiled, backend="aot_eager")
    )
    dyn = VelocityVerlet(model, crystal("periodic", temperature_k=20.0), dt_fs=1.0)
    config = DomainConfig(cutoff=cutoff, skin=1.0, strategy=kind, compile=compiled)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with DomainParallel(dyn, config, spec=spec, count_collectives=True) as dp:
            dp.partition()
            dp.run(3)
            seen = steady_collectives(dp, 5)
    return {"quiet_steps": seen}


def steady_collectives(dp: Any, steps: int) -> list[dict[str, int]]:
    """Collectives of each of the next ``steps`` steps of ``dp`` (built with
    ``count_collectives=True``) that rebuilt nothing."""
    seen = []
    for _ in range(steps):
        before = dp.stats.rebuilds
        dp.step()
        if dp.stats.rebuilds == before:
            seen.append(dict(dp.stats.last_collectives))
    return seen
