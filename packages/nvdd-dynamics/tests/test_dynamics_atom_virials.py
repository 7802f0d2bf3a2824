"""Per-atom virials under DomainParallel: N gloo ranks equal one process by atom id,
hooks see them (and are refused them when the model has none), and the extxyz
frame of a decomposed run carries them as ASE's per-atom ``stresses``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dyn_models import SoftPair
from test_dynamics_domain_parallel import make_gas

from nvdd.core import Batch, ConfigurationError
from nvdd.dynamics import (
    PER_ATOM_OUTPUTS,
    DomainConfig,
    DomainParallel,
    HookScope,
    HookStage,
    VelocityVerlet,
)
from nvdd.models import LennardJones, LJConfig
from nvdd.spec import StrategyKind
from nvdd.testing import assert_close_by_id, assert_same_ids, run_ranks

_STEPS = 8


def _crystal(seed: int = 0) -> Batch:
    """A jittered triclinic lattice of 324 atoms (spacing about 1.2 sigma), long
    enough in x that two or three boxes do not all hold every atom."""
    g = torch.Generator().manual_seed(seed)
    cell = torch.tensor([[10.5, 0.0, 0.0], [1.5, 7.0, 0.0], [-1.0, 0.8, 7.5]], dtype=torch.float64)
    grid = torch.stack(
        torch.meshgrid(*(torch.arange(k, dtype=torch.float64) for k in (9, 6, 6)), indexing="ij"),
        -1,
    ).reshape(-1, 3)
    frac = (grid + 0.5) / torch.tensor([9.0, 6.0, 6.0], dtype=torch.float64)
    n = frac.shape[0]
    pos = frac @ cell + 0.05 * torch.randn(n, 3, generator=g, dtype=torch.float64)
    return Batch(
        positions=pos,
        atomic_numbers=torch.full((n,), 18),
        velocities=torch.randn(n, 3, generator=g, dtype=torch.float64) * 0.2,
        cell=cell,
        pbc=[True, True, True],
        atom_ids=torch.randperm(n, generator=g) * 5 + 2,
    )


def _lj() -> LennardJones:
    return LennardJones(LJConfig(cutoff=2.5, epsilon=0.02, sigma=1.05, atom_virials=True))


def _reference(steps: int) -> Batch:
    dyn = VelocityVerlet(_lj(), _crystal(), dt_fs=2.0)
    dyn.run(steps)
    return dyn.batch


def _dd_rank(steps: int, strategy: str, frame: str) -> dict[str, Any]:
    dyn = VelocityVerlet(_lj(), _crystal(), dt_fs=2.0)
    config = DomainConfig(cutoff=2.5, skin=0.3, strategy=StrategyKind(strategy))
    local_sums: list[torch.Tensor] = []
    with DomainParallel(dyn, config) as dp:
        dp.partition()
        dp.register_hook(  # every rank, its owned atoms
            HookStage.AFTER_STEP,
            lambda ctx: local_sums.append(ctx.batch.atom_extras["atom_virials"].sum(0)),
            needs=("atom_virials",),
        )

        def write(ctx: Any) -> None:  # the trajectory writer's view: the whole system
            ctx.batch.to_ase()[0].write(frame, format="extxyz")

        dp.register_hook(HookStage.AFTER_STEP, write, scope=HookScope.RANK_ZERO, every=steps)
        dp.run(steps)
        out = dp.gather(0)
        rebuilds = dp.stats.rebuilds
    if out is None:
        return {"local_sums": local_sums}
    return {
        "ids": out.atom_ids,
        "virials": out.atom_extras["atom_virials"],
        "stress": out.stress,
        "cell": out.cell,
        "local_sums": local_sums,
        "rebuilds": rebuilds,
    }


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("world", "strategy"),
    [(2, "halo"), (3, "halo"), (2, "graph_partition")],
    ids=["2-halo", "3-halo", "2-graph"],
)
def test_n_ranks_equal_one_process_by_atom_id(world: int, strategy: str, tmp_path: Path) -> None:
    ase_io = pytest.importorskip("ase.io")
    frame = str(tmp_path / "frame.extxyz")
    results = run_ranks(_dd_rank, world, _STEPS, strategy, frame)
    got = results[0]
    ref = _reference(_STEPS)
    w_ref = ref.atom_extras["atom_virials"]
    assert_same_ids(got["ids"], ref.atom_ids)
    assert_close_by_id(got["ids"], got["virials"], ref.atom_ids, w_ref, atol=1e-10)
    # each step's owned shares add up to the whole system's virial
    volume = abs(float(torch.linalg.det(ref.cell[0])))
    total = sum(r["local_sums"][-1] for r in results)
    torch.testing.assert_close(total, w_ref.sum(0), rtol=0, atol=1e-10)
    torch.testing.assert_close(-total / volume, got["stress"][0], rtol=0, atol=1e-12)
    assert all(len(r["local_sums"]) == _STEPS for r in results)
    assert float(w_ref.abs().max()) > 0.01  # the atoms interact
    assert strategy != "halo" or got["rebuilds"] >= 2, got["rebuilds"]  # atoms migrated
    # the extxyz frame written by rank 0: -W_i / V per atom, Voigt xx yy zz yz xz xy
    # (extxyz keeps 8 decimals: 5e-9 absolute)
    back = ase_io.read(frame, format="extxyz")
    ids = torch.as_tensor(back.arrays["atom_ids"])
    order = ref.atom_ids.argsort()
    w = w_ref[order][torch.searchsorted(ref.atom_ids[order], ids)].numpy()
    voigt = np.stack([w[:, 0, 0], w[:, 1, 1], w[:, 2, 2], w[:, 1, 2], w[:, 0, 2], w[:, 0, 1]], 1)
    np.testing.assert_allclose(back.get_stresses(), -voigt / volume, rtol=0, atol=6e-9)


def test_one_process_keeps_them_and_a_hook_that_needs_them_sees_them() -> None:
    assert "atom_virials" in PER_ATOM_OUTPUTS
    dyn = VelocityVerlet(_lj(), _crystal(seed=1), dt_fs=2.0)
    seen: list[torch.Tensor] = []
    dyn.register_hook(
        HookStage.AFTER_COMPUTE,
        lambda ctx: seen.append(ctx.batch.atom_extras["atom_virials"].clone()),
        needs=("atom_virials",),
    )
    dyn.run(2)
    assert len(seen) == 2
    torch.testing.assert_close(seen[-1].sum(0), dyn.outputs["virial"][0], rtol=0, atol=1e-12)
    assert torch.equal(seen[-1], dyn.batch.atom_extras["atom_virials"])


def test_a_hook_that_needs_atom_virials_of_a_model_without_them_is_refused() -> None:
    dyn = VelocityVerlet(SoftPair(), make_gas(n=20), dt_fs=2.0)

    def thermo(ctx: Any) -> None:
        raise AssertionError("must not run")

    dyn.register_hook(HookStage.AFTER_STEP, thermo, needs=("atom_virials",))
    with pytest.raises(ConfigurationError, match=r"rank 0: a after_step hook \('thermo'\) needs"):
        dyn.run(1)
    dyn.hooks.clear()
    dyn.register_hook(HookStage.AFTER_STEP, lambda ctx: None, needs=("atom_energies",))
    dyn.run(1)  # SoftPair returns atom energies
    with pytest.raises(ConfigurationError, match="needs accepts"):
        dyn.register_hook(HookStage.AFTER_STEP, lambda ctx: None, needs=("atom_stress",))
    # GLOBAL hooks keep their declared per-atom needs next to the totals
    h = dyn.register_hook(
        HookStage.AFTER_STEP, lambda ctx: None, scope=HookScope.GLOBAL, needs=("atom_virials",)
    )
    assert h.needs == {"energy", "stress", "atom_virials"}


def test_replayed_steps_keep_the_atom_virials_of_eager_steps() -> None:
    """Steady steps captured (here: emulated on the CPU) and replayed write the
    per-atom kernel's output into the kept tensor, as an eager step does."""
    from nvdd.core import emulated_capture

    runs = []
    for graphs in (False, True):
        dyn = VelocityVerlet(_lj(), _crystal(seed=2), dt_fs=2.0, cuda_graphs=graphs)
        with emulated_capture():
            dyn.run(8)
        runs.append(dyn)
    eager, graphed = runs
    assert eager.graphs.replays == 0 and graphed.graphs.replays > 0
    for name in ("positions", "forces"):
        assert torch.equal(getattr(graphed.batch, name), getattr(eager.batch, name)), name
    w = graphed.batch.atom_extras["atom_virials"]
    assert torch.equal(w, eager.batch.atom_extras["atom_virials"])
    assert torch.equal(graphed.outputs["atom_virials"], w)
