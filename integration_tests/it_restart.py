"""Rank bodies of the checkpoint / restart tests (kept free of pytest)."""

from __future__ import annotations

import os
import signal
from typing import Any

from it_systems import LJ_CUTOFF, crystal, lj_model

from nvdd.core import Batch
from nvdd.dynamics import (
    FIRE,
    DomainConfig,
    DomainParallel,
    HookStage,
    Langevin,
    VelocityVerlet,
)


def _dynamics(integrator: str) -> Any:
    batch = crystal("periodic", temperature_k=60.0)
    model = lj_model()
    if integrator == "nve":
        return VelocityVerlet(model, batch, dt_fs=4.0)
    if integrator == "nvt":
        return Langevin(model, batch, dt_fs=4.0, temperature_K=80.0, friction_per_fs=0.05, seed=7)
    return FIRE(model, batch.replace(velocities=batch.velocities * 0), dt_fs=2.0, fmax=1e-4)


def _state(batch: Batch | None) -> dict[str, Any] | None:
    if batch is None:
        return None
    return {
        "ids": batch.atom_ids,
        "positions": batch.positions,
        "velocities": batch.velocities,
        "forces": batch.forces,
        "energy": batch.energy,
        "cell": batch.cell[0],
        "pbc": batch.pbc[0],
    }


def run_and_save(
    integrator: str, n_before: int, n_after: int, path: str, extra: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """``n_before`` steps, a checkpoint in ``path``, ``n_after`` more steps; the
    final state on rank 0 (and the integrator's scalar state)."""
    dyn = _dynamics(integrator)
    with DomainParallel(dyn, DomainConfig(cutoff=LJ_CUTOFF, skin=0.5)) as dp:
        dp.partition()
        dp.run(n_before)
        dp.save(path)
        dp.run(n_after)
        final = dp.gather(0)
    out = _state(final)
    if out is not None:
        out["step_count"] = dyn.step_count
    return out


def restart(integrator: str, n_after: int, path: str) -> dict[str, Any] | None:
    """Load ``path`` and run ``n_after`` steps; the final state on rank 0."""
    dyn = _dynamics(integrator)
    with DomainParallel(dyn, DomainConfig(cutoff=LJ_CUTOFF, skin=0.5)) as dp:
        manifest = dp.load(path)
        dp.run(n_after)
        final = dp.gather(0)
    out = _state(final)
    if out is not None:
        out["step_count"] = dyn.step_count
        out["manifest_world"] = manifest["world_size"]
    return out


def save_twice_second_fails(path: str, culprit: int) -> str:
    """A checkpoint, then a second one during which ``culprit``'s disk is full
    (simulated: its shard writer raises ENOSPC after half a file)."""
    import errno

    import torch.distributed as dist

    from nvdd.dynamics import CheckpointError, _checkpoint

    dyn = _dynamics("nve")
    with DomainParallel(dyn, DomainConfig(cutoff=LJ_CUTOFF, skin=0.5)) as dp:
        dp.partition()
        dp.run(2)
        dp.save(path)
        dp.run(1)
        if dist.get_rank() == culprit:

            def full(file: Any, **arrays: Any) -> None:
                file.write(b"PK\x03\x04 half a shard")
                raise OSError(errno.ENOSPC, "No space left on device")

            _checkpoint.np.savez = full  # type: ignore[assignment]
        try:
            dp.save(path)
        except CheckpointError as exc:
            dp.run(1)  # every rank is still in step with the others
            return str(exc)
    return "no error"


def _checkpoint_every(dp: DomainParallel, path: str, every: int) -> None:
    """Save ``path`` after every ``every``-th step (what ``nvdd run
    --checkpoint-every`` does); a restarted run registers it again, so both
    runs rebuild the halo after the same steps."""

    def save(ctx: Any) -> None:
        if ctx.step % every == 0:
            dp.save(path, metadata={"step": ctx.step})

    dp.register_hook(HookStage.AFTER_STEP, save)


def run_checkpointed(
    path: str, n_steps: int, every: int, kill_at: int | None = None
) -> dict[str, Any] | None:
    """NVE for ``n_steps`` with a checkpoint every ``every`` steps; with ``kill_at``,
    rank 1 SIGKILLs itself mid-step (in the hook before the force computation, at
    ``ctx.step == kill_at``): nothing runs on it after that, no handler, no
    ``finally``. The final state on rank 0."""
    import torch.distributed as dist

    dyn = _dynamics("nve")
    with DomainParallel(dyn, DomainConfig(cutoff=LJ_CUTOFF, skin=0.5)) as dp:
        _checkpoint_every(dp, path, every)
        if kill_at is not None:

            def kill(ctx: Any) -> None:
                if ctx.step == kill_at and dist.get_rank() == 1:
                    os.kill(os.getpid(), signal.SIGKILL)

            dp.register_hook(HookStage.BEFORE_COMPUTE, kill)
        dp.partition()
        dp.run(n_steps)
        final = dp.gather(0)
    return _state(final)


def resume_checkpointed(path: str, n_steps: int, every: int) -> dict[str, Any] | None:
    """Load the last checkpoint in ``path`` and run on to step ``n_steps`` with the
    same checkpoint cadence; the final state on rank 0 and the step restarted from."""
    dyn = _dynamics("nve")
    with DomainParallel(dyn, DomainConfig(cutoff=LJ_CUTOFF, skin=0.5)) as dp:
        _checkpoint_every(dp, path, every)
        dp.load(path)
        start = dyn.step_count
        dp.run(n_steps - start)
        final = dp.gather(0)
    out = _state(final)
    if out is not None:
        out["restarted_at"] = start
    return out
