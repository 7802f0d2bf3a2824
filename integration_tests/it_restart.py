"""Rank bodies of the checkpoint / restart tests (kept free of pytest)."""

from __future__ import annotations

from typing import Any

from it_systems import LJ_CUTOFF, crystal, lj_model

from nvdd.core import Batch
from nvdd.dynamics import FIRE, DomainConfig, DomainParallel, Langevin, VelocityVerlet


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
