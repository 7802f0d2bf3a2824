"""Rank bodies of the device-placement guard of the whole DD path.

The same DomainParallel run (partition, steps with migration, hooks of every
scope, a rebalance, gather and to_global) runs on the CPU and on the fake
accelerator of ``nvdd.testing``; the two must agree bit for bit, and nothing on
the way may mix the atoms' device with the CPU.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from it_systems import crystal, model_for

from nvdd.core import Batch
from nvdd.dynamics import (
    FIRE,
    MTKNPT,
    CellDOF,
    DomainConfig,
    DomainParallel,
    HookScope,
    HookStage,
    Langevin,
    NoseHooverNVT,
    VelocityVerlet,
    kinetic_energy,
)
from nvdd.partition import ShardedBatch, SpatialPartitioner
from nvdd.spec import StrategyKind
from nvdd.testing import fake_accelerator, record_host_syncs


def _two_systems() -> Batch:
    a = crystal("periodic", temperature_k=300.0, seed=1)
    b = crystal("triclinic", temperature_k=300.0, seed=2)
    b = b.replace(atom_ids=b.atom_ids + 10_000)
    return Batch.concatenate([a, b])


def _run(kind: str, model_name: str, dev: torch.device, strategy: str) -> dict[str, Any]:
    model, cutoff = model_for(model_name)
    model = model.to(dev)
    batch = (_two_systems() if kind == "two" else crystal(kind, temperature_k=300.0)).to(dev)
    if model_name.startswith("lj"):
        dyn: Any = Langevin(
            model, batch, dt_fs=4.0, temperature_K=300.0, friction_per_fs=0.01, seed=5
        )
    else:
        dyn = VelocityVerlet(model, batch, dt_fs=1.0)
    seen: dict[str, list[Any]] = {"local": [], "global": [], "zero": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DomainConfig(cutoff=cutoff, skin=0.4, strategy=StrategyKind(strategy))
        with DomainParallel(dyn, config) as dp:
            dp.partition()
            dp.register_hook(
                HookStage.AFTER_STEP,
                lambda c: seen["local"].append(float(kinetic_energy(c.batch, dyn.reducer).sum())),
                every=2,
                needs=["energy"],
            )
            dp.register_hook(
                HookStage.AFTER_STEP,
                lambda c: seen["global"].append(float(c.batch.energy.sum())),
                every=3,
                scope=HookScope.GLOBAL,
                needs=["energy", "stress"],
            )
            dp.register_hook(
                HookStage.BEFORE_STEP,
                lambda c: seen["zero"].append(c.batch.positions.device.type),
                every=4,
                scope=HookScope.RANK_ZERO,
            )
            dp.run(8)
            if isinstance(dp.sharded, ShardedBatch):  # index blocks never rebalance
                dp.sharded.rebalance()
            dp.run(4)
            whole = dp.to_global()
            final = dp.gather(0)
            stats = dp.stats
    out: dict[str, Any] = {
        "hooks": seen,
        "whole_device": whole.positions.device.type,
        "rebuilds": stats.rebuilds,
    }
    if final is not None:
        out.update(
            ids=final.atom_ids.cpu(),
            positions=final.positions.cpu(),
            forces=final.forces.cpu(),
            energy=final.energy.cpu(),
            stress=final.stress.cpu(),
            device=final.positions.device.type,
            extras={k: v.cpu() for k, v in final.atom_extras.items()},
        )
    return out


def cpu_and_fake(
    kind: str, model_name: str, strategy: str = "halo"
) -> tuple[dict[str, Any], dict[str, Any]]:
    cpu = _run(kind, model_name, torch.device("cpu"), strategy)
    with fake_accelerator() as dev:
        fake = _run(kind, model_name, dev, strategy)
    return cpu, fake


def host_syncs_per_step(
    kind: str, model_name: str, steps: int = 6, integrator: str = "nve"
) -> dict[str, Any]:
    """Host synchronisations of DomainParallel steps on the fake accelerator.

    Runs a velocity-Verlet DD run on the fake device, then records (with
    ``nvdd.testing.record_host_syncs``) every operation that would make a CUDA
    device wait for the host during ``steps`` steps in one ``run`` call, and
    during one step after a forced rebuild. Returns the logs, the rebuild count
    and the ``SpatialPartitioner.domain_cell`` calls of the steady window, and
    the owned atoms after the rebuild.
    """
    model, cutoff = model_for(model_name)
    with fake_accelerator() as dev, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model.to(dev)
        batch = crystal(kind, temperature_k=30.0).to(dev)
        dyn: Any = VelocityVerlet(model, batch, dt_fs=1.0)
        if integrator == "nvt-nh":
            dyn = NoseHooverNVT(model, batch, dt_fs=1.0, temperature_K=30.0, tau_fs=50.0)
        elif integrator == "fire":  # (never converges: the convergence test runs every step)
            dyn = FIRE(model, batch, dt_fs=1.0, fmax=1e-30)
        elif integrator.startswith("npt-"):
            dof = CellDOF.FULL if integrator == "npt-full" else CellDOF.ISOTROPIC
            dyn = MTKNPT(model, batch, dt_fs=1.0, temperature_K=30.0, pressure_bar=1.0e4,
                         tau_t_fs=50.0, tau_p_fs=200.0, cell_dof=dof)  # fmt: skip
        with DomainParallel(dyn, DomainConfig(cutoff=cutoff, skin=1.0)) as dp:
            dp.partition()
            dp.run(3)
            before = dp.stats.rebuilds
            domain_calls = []
            original = SpatialPartitioner.domain_cell

            def counted(self: SpatialPartitioner, cell: Any = None) -> Any:
                domain_calls.append(1)
                return original(self, cell)

            SpatialPartitioner.domain_cell = counted  # type: ignore[method-assign]
            try:
                with record_host_syncs() as steady:
                    dp.run(steps)
            finally:
                SpatialPartitioner.domain_cell = original  # type: ignore[method-assign]
            steady_rebuilds = dp.stats.rebuilds - before
            dp.model.request_rebuild()
            dp.run(1)  # the first migration copies the cut table to the device once
            dp.model.request_rebuild()
            with record_host_syncs() as rebuild:
                dp.run(1)
            n_owned = dp.stats.n_owned
    return {
        "n_owned": n_owned,
        "steady": list(steady),
        "steady_rebuilds": steady_rebuilds,
        "steady_domain_calls": len(domain_calls),
        "rebuild": list(rebuild),
        "steps": steps,
    }
