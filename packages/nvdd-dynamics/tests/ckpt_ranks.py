"""Rank bodies of the checkpoint and watchdog tests (kept free of pytest)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dyn_models import SoftPair

from nvdd.core import Batch, Watchdog
from nvdd.dynamics import (
    FIRE,
    MTKNPT,
    BaseDynamics,
    CellDOF,
    DomainConfig,
    DomainParallel,
    HookStage,
    Langevin,
    NoseHooverNVT,
    VelocityVerlet,
)

CONFIG = DomainConfig(cutoff=2.5, skin=0.4)


def gas(n: int = 64, seed: int = 0) -> Batch:
    """A periodic gas wide enough for 2-3 non-degenerate boxes along x."""
    g = torch.Generator().manual_seed(seed)
    cell = torch.diag(torch.tensor([12.0, 6.0, 6.5], dtype=torch.float64))
    cell[1, 0] = 0.7
    frac = torch.rand(n, 3, generator=g, dtype=torch.float64)
    return Batch(
        positions=frac @ cell,
        atomic_numbers=torch.full((n,), 18),
        velocities=torch.randn(n, 3, generator=g, dtype=torch.float64) * 0.03,
        cell=cell,
        pbc=[True, True, True],
        atom_ids=torch.randperm(n, generator=g) * 5 + 2,
        atom_extras={"tag": torch.arange(n, dtype=torch.float64)},
    )


def dynamics(kind: str) -> BaseDynamics:
    model, batch = SoftPair(), gas()
    if kind == "nve":
        return VelocityVerlet(model, batch, dt_fs=3.0)
    if kind == "nvt":
        return Langevin(model, batch, dt_fs=3.0, temperature_K=300.0, friction_per_fs=0.05, seed=5)
    if kind == "nvt-nh":
        return NoseHooverNVT(model, batch, dt_fs=3.0, temperature_K=300.0, tau_fs=30.0)
    if kind.startswith("npt"):
        dof = CellDOF.ISOTROPIC if kind == "npt-iso" else CellDOF.FULL
        return MTKNPT(
            model,
            batch,
            dt_fs=3.0,
            temperature_K=300.0,
            pressure_bar=2000.0,
            tau_t_fs=30.0,
            tau_p_fs=60.0,
            cell_dof=dof,
        )
    return FIRE(model, batch.replace(velocities=torch.zeros_like(batch.velocities)), dt_fs=1.0)


def state(batch: Batch | None, dyn: BaseDynamics) -> dict[str, Any] | None:
    if batch is None:
        return None
    out: dict[str, Any] = dict(batch.atom_fields().items())
    out.update(energy=batch.energy, cell=batch.cell[0], pbc=batch.pbc[0])
    out["scalars"] = {k: getattr(dyn, k) for k in ("step_count", "dt_fs", "converged")}
    if isinstance(dyn, FIRE):
        out["scalars"].update(alpha=dyn.alpha, n_positive=dyn.n_positive)
    if isinstance(dyn, NoseHooverNVT | MTKNPT):  # (the extended energy holds the chains)
        out["conserved"] = dyn.conserved_energy()
    return out


def run_and_save(kind: str, n_before: int, n_after: int, path: str) -> Any:
    """Run, checkpoint at step ``n_before``, keep running: the uninterrupted run.
    Returns (state at the checkpoint, final state) on rank 0."""
    dyn = dynamics(kind)
    with DomainParallel(dyn, CONFIG) as dp:
        dp.partition()
        dp.run(n_before)
        dp.save(path, metadata={"note": "test"})
        at_save = state(dp.gather(0), dyn)
        dp.run(n_after)
        final = state(dp.gather(0), dyn)
    return at_save, final


def restart(kind: str, n_after: int, path: str) -> Any:
    """Load the checkpoint (any world size) and run ``n_after`` steps."""
    dyn = dynamics(kind)
    with DomainParallel(dyn, CONFIG) as dp:
        manifest = dp.load(path)
        dp.run(n_after)
        final = state(dp.gather(0), dyn)
    return final, manifest["metadata"], manifest["world_size"]


def save_twice_second_fails(path: str, culprit: int) -> str:
    """A first checkpoint, then a second one during which ``culprit``'s disk is full."""
    import errno

    from nvdd.dynamics import CheckpointError, _checkpoint

    dyn = dynamics("nve")
    with DomainParallel(dyn, CONFIG) as dp:
        dp.partition()
        dp.run(2)
        dp.save(path)
        dp.run(2)
        if dist.get_rank() == culprit:

            def full(file: Any, **arrays: Any) -> None:
                file.write(b"PK\x03\x04 half a shard")
                raise OSError(errno.ENOSPC, "No space left on device")

            _checkpoint.np.savez = full  # type: ignore[assignment]
        try:
            dp.save(path)
        except CheckpointError as exc:
            dp.run(1)  # nobody hangs: the ranks still run collectives together
            return str(exc)
    return "no error"


def load_problem(path: str, kind: str) -> str:
    dyn = dynamics(kind)
    try:
        with DomainParallel(dyn, CONFIG) as dp:
            dp.load(path)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def sleepy_hook(folder: str, timeout_s: float) -> None:
    """Rank 1 stops responding in a hook at step 3; the DomainParallel watchdog names it."""
    rank = dist.get_rank()
    dyn = dynamics("nve")
    with DomainParallel(dyn, CONFIG) as dp:
        dp.watchdog = Watchdog(
            timeout_s,
            on_timeout=lambda m: Path(folder, f"rank{rank}.txt").write_text(m),
        )

        def hook(ctx: Any) -> None:
            if ctx.step == 3 and rank == 1:
                time.sleep(120)

        dp.register_hook(HookStage.AFTER_STEP, hook)
        dp.partition()
        dp.run(8)


def run_plain(kind: str, n_steps: int) -> Any:
    """``n_steps`` without any checkpoint: the run a restart is compared with."""
    dyn = dynamics(kind)
    with DomainParallel(dyn, CONFIG) as dp:
        dp.partition()
        dp.run(n_steps)
        return state(dp.gather(0), dyn)
