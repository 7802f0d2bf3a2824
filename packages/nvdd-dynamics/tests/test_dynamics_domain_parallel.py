"""DomainParallel over gloo: N ranks equal 1 rank by atom id."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dyn_models import PairSum, SoftPair, soft_pair_mpnn_spec

from nvdd.core import Batch, ConfigurationError
from nvdd.dynamics import (
    DomainConfig,
    DomainParallel,
    HookContext,
    HookScope,
    HookStage,
    VelocityVerlet,
)
from nvdd.testing import assert_close_by_id, assert_same_ids, gather_by_id, run_ranks

pytestmark = pytest.mark.gloo


def make_gas(
    n: int = 48,
    pbc: tuple[bool, bool, bool] = (True, True, True),
    triclinic: bool = False,
    seed: int = 0,
) -> Batch:
    g = torch.Generator().manual_seed(seed)
    cell = torch.diag(torch.tensor([7.0, 6.0, 6.5], dtype=torch.float64))
    if triclinic:
        cell[1, 0], cell[2, 0], cell[2, 1] = 1.5, -1.0, 0.8
    frac = torch.rand(n, 3, generator=g, dtype=torch.float64)
    return Batch(
        positions=frac @ cell,
        atomic_numbers=torch.full((n,), 18),
        velocities=torch.randn(n, 3, generator=g, dtype=torch.float64) * 0.02,
        cell=cell,
        pbc=list(pbc),
        atom_ids=torch.randperm(n, generator=g) * 7 + 3,
    )


def _reference(batch: Batch, n_steps: int, model: SoftPair) -> Batch:
    dyn = VelocityVerlet(model, batch.clone(), dt_fs=2.0)
    dyn.run(n_steps)
    return dyn.batch


def _dd_run(kw: dict, n_steps: int, grid: tuple[int, int, int] | None, mpnn: bool) -> dict:
    model = soft_pair_mpnn_spec() if mpnn else SoftPair()
    batch = make_gas(**kw)
    dyn = VelocityVerlet(model, batch, dt_fs=2.0)
    config = DomainConfig(cutoff=2.5, skin=0.4, grid_dims=grid)
    with DomainParallel(dyn, config) as dp:
        dp.partition()
        dp.run(n_steps)
        out = dp.gather(0)
        stats = dp.stats
    if out is None:
        return {}
    return {
        "ids": out.atom_ids,
        "pos": out.positions,
        "forces": out.forces,
        "energy": out.energy,
        "rebuilds": stats.rebuilds,
    }


def _wrapped_diff(
    a: torch.Tensor, b: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor
) -> torch.Tensor:
    frac = torch.linalg.solve(cell.T, (a - b).T).T
    frac = torch.where(pbc, frac - torch.round(frac), frac)
    return frac @ cell


CASES = [
    ("periodic-slab-2", 2, {}, (2, 1, 1), False),
    ("periodic-3d-auto-4", 4, {}, None, False),
    ("triclinic-2x2x1", 4, {"triclinic": True}, (2, 2, 1), False),
    ("mixed-pbc-3", 3, {"pbc": (True, False, True)}, None, False),
    ("open-2", 2, {"pbc": (False, False, False)}, None, False),
    ("mpnn-spec-3", 3, {"triclinic": True}, None, True),
]


@pytest.mark.parametrize(("name", "world", "kw", "grid", "mpnn"), CASES, ids=[c[0] for c in CASES])
def test_nve_trajectory_equals_single_process_by_id(
    name: str, world: int, kw: dict, grid: tuple[int, int, int] | None, mpnn: bool
) -> None:
    n_steps = 25
    got = run_ranks(_dd_run, world, kw, n_steps, grid, mpnn, timeout_s=300)[0]
    model = soft_pair_mpnn_spec() if mpnn else SoftPair()
    ref = _reference(make_gas(**kw), n_steps, model)
    assert_same_ids(got["ids"], ref.atom_ids)
    order = torch.argsort(ref.atom_ids)
    diff = _wrapped_diff(got["pos"], ref.positions[order], ref.cell[0], ref.pbc[0])
    assert float(diff.abs().max()) < 1e-8, float(diff.abs().max())
    assert_close_by_id(
        got["ids"], got["forces"], ref.atom_ids, ref.forces, atol=1e-10, what="forces"
    )
    torch.testing.assert_close(got["energy"], ref.energy, rtol=0, atol=1e-10)
    assert got["rebuilds"] >= 1


def _steady_state_counts() -> tuple[dict, dict, int]:
    batch = make_gas(n=40)
    dyn = VelocityVerlet(SoftPair(), batch, dt_fs=0.5)
    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=1.0), count_collectives=True) as dp:
        dp.partition()
        dp.run(2)
        rebuilds = dp.stats.rebuilds
        dp.step()
        quiet = dict(dp.stats.last_collectives)
        assert dp.stats.rebuilds == rebuilds, "this step should not rebuild"
        seen = []
        dp.register_hook(
            HookStage.AFTER_STEP,
            lambda ctx: seen.append(float(ctx.batch.energy[0])),
            needs=["energy"],
        )
        dp.step()
        return quiet, dict(dp.stats.last_collectives), len(seen)


def test_steady_state_step_costs_two_all_to_all_and_one_small_all_reduce() -> None:
    quiet, _, seen = run_ranks(_steady_state_counts, 2, timeout_s=120)[0]
    assert quiet == {"all_reduce": 1, "all_to_all_single": 2}
    assert seen == 1


def _uncounted() -> dict:
    dyn = VelocityVerlet(SoftPair(), make_gas(n=40), dt_fs=0.5)
    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=1.0)) as dp:
        dp.partition()
        dp.run(2)
        return dict(dp.stats.last_collectives)


def test_collectives_are_counted_only_when_asked() -> None:
    assert run_ranks(_uncounted, 2, timeout_s=120) == [{}, {}]


def _hooks_scopes() -> dict:
    batch = make_gas(n=30)
    dyn = VelocityVerlet(SoftPair(), batch, dt_fs=1.0)
    log: dict = {"local": [], "global": [], "zero": []}
    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=0.3)) as dp:
        dp.register_hook(HookStage.AFTER_STEP, lambda c: log["local"].append(c.batch.n_atoms))
        dp.register_hook(
            HookStage.BEFORE_STEP,
            lambda c: log.setdefault("where", []).append((c.rank, c.world_size)),
        )
        dp.register_hook(
            HookStage.AFTER_STEP,
            lambda c: log["global"].append((c.batch.n_atoms, float(c.batch.energy[0]))),
            scope=HookScope.GLOBAL,
            every=2,
        )
        dp.register_hook(
            HookStage.AFTER_STEP,
            lambda c: log["zero"].append(c.step),
            scope=HookScope.RANK_ZERO,
            every=3,
        )
        dp.partition()
        dp.run(6)
    log["rank"] = dist.get_rank()
    return log


def test_hook_scopes_local_global_rank_zero() -> None:
    logs = run_ranks(_hooks_scopes, 2, timeout_s=120)
    for rank, log in enumerate(logs):
        assert len(log["local"]) == 6
        assert [n for n, _ in log["global"]] == [30, 30, 30]
        # LOCAL hooks see this rank's place in the decomposition (issue 17 item 4)
        assert log["where"] == [(rank, 2)] * 6
    assert sum(a + b for a, b in zip(logs[0]["local"], logs[1]["local"], strict=True)) == 6 * 30
    assert logs[0]["global"] == logs[1]["global"]
    assert logs[0]["zero"] == [3, 6] and logs[1]["zero"] == []


def _pipeline_forces(world_kw: dict) -> dict:
    from nvdd.dynamics import DistributedPipelineModel
    from nvdd.partition import ShardedBatch, SpatialPartitioner

    batch = make_gas(**world_kw)
    models = [SoftPair(rc=2.5, eps=0.2), soft_pair_mpnn_spec()]
    models[1].eps = 0.05
    dm = DistributedPipelineModel(models, DomainConfig(cutoff=2.5, skin=0.3))
    world = dist.get_world_size()

    def factory(b: Batch) -> SpatialPartitioner:
        return SpatialPartitioner.from_batch(b, world, dm.ghost_width)

    sharded = ShardedBatch.from_batch(batch if dist.get_rank() == 0 else None, None, factory)
    dm.attach(sharded)
    try:
        local, out = dm(sharded.local_batch)
        totals = dm.materialize(["energy"])
        ids, forces = gather_by_id(local.atom_ids, out["forces"])
    finally:
        dm.detach()
    return {"ids": ids, "forces": forces, "energy": totals["energy"], "final": sorted(out)}


def test_pipeline_model_sums_components_with_different_specs() -> None:
    got = run_ranks(_pipeline_forces, 3, {"triclinic": True}, timeout_s=120)[0]
    batch = make_gas(triclinic=True)
    a, b = SoftPair(rc=2.5, eps=0.2), soft_pair_mpnn_spec()
    b.eps = 0.05
    oa, ob = a(batch), b(batch)
    assert_close_by_id(
        got["ids"],
        got["forces"],
        batch.atom_ids,
        oa["forces"] + ob["forces"],
        atol=1e-10,
        what="pipeline forces",
    )
    # LJ-spec energy is a partial (reduced on demand), MPNN-spec energy replicated: summed right
    torch.testing.assert_close(
        got["energy"], (oa["energy"] + ob["energy"]).detach(), rtol=0, atol=1e-10
    )
    assert "energy" not in got["final"]  # pending until materialized


def _compiled_run(backend: str) -> dict:
    from nvdd.spec import CompilePolicy, MLIPSpec

    model = SoftPair()
    spec = model.distribution_spec() | MLIPSpec(
        compile=CompilePolicy(enabled=True, backend=backend)
    )
    dyn = VelocityVerlet(model, make_gas(n=40), dt_fs=2.0)
    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=0.4, compile=True), spec=spec) as dp:
        dp.partition()
        compiled = dp.model.forward_fn is not model
        dp.run(8)
        out = dp.gather(0)
        stats = dp.stats
    if out is None:
        return {"cache": os.environ["TORCHINDUCTOR_CACHE_DIR"]}
    return {
        "ids": out.atom_ids,
        "forces": out.forces,
        "compiled": compiled,
        "mode": stats.compile_mode,
        "compiles": stats.compiles,
        "cache": os.environ["TORCHINDUCTOR_CACHE_DIR"],
    }


def test_compile_true_runs_a_compiled_forward_with_the_same_result() -> None:
    out = run_ranks(_compiled_run, 2, "aot_eager", timeout_s=300)
    got = out[0]
    assert got["compiled"] and got["mode"] == "whole"  # SoftPair has no compiled core
    assert got["compiles"] >= 1
    assert out[0]["cache"].endswith("rank0") and out[1]["cache"].endswith("rank1")
    ref = _reference(make_gas(n=40), 8, SoftPair())
    assert_close_by_id(
        got["ids"], got["forces"], ref.atom_ids, ref.forces, atol=1e-10, what="compiled forces"
    )


class _Uncompilable(SoftPair):
    compile_unsupported = "Dynamo fails inside its kernels (a stand-in)"


def test_a_model_that_declares_compile_unsupported_is_refused_when_built() -> None:
    """At construction, with no process group (so before any collective) and
    before any compile: by ``DomainConfig(compile=True)`` or an enabled policy;
    eager it is accepted, and a model that declares nothing compiles as before."""
    from nvdd.dynamics import DistributedModel
    from nvdd.spec import CompilePolicy, MLIPSpec

    assert not dist.is_initialized()
    model = _Uncompilable()
    config = DomainConfig(cutoff=2.5, skin=0.4, compile=True)
    with pytest.raises(ConfigurationError) as err:
        DistributedModel(model, config)
    text = str(err.value)
    assert "_Uncompilable cannot run with DomainConfig(compile=True)" in text
    assert "Dynamo fails inside its kernels (a stand-in)" in text
    assert "Run it eager: DomainConfig(compile=False)" in text
    policy = model.distribution_spec() | MLIPSpec(compile=CompilePolicy(enabled=True))
    with pytest.raises(ConfigurationError, match="with an enabled CompilePolicy in its spec"):
        DistributedModel(model, DomainConfig(cutoff=2.5, skin=0.4), spec=policy)
    eager = DistributedModel(model, DomainConfig(cutoff=2.5, skin=0.4))
    assert eager.forward_fn is model
    assert SoftPair().compile_unsupported is None  # the contract's default
    assert DistributedModel(SoftPair(), config).forward_fn is not None


def _one_rank(halo: bool) -> dict:
    batch = make_gas(n=40)
    dyn = VelocityVerlet(SoftPair(), batch, dt_fs=2.0)
    config = DomainConfig(cutoff=2.5, skin=0.3, halo_on_one_rank=halo)
    with DomainParallel(dyn, config) as dp:
        dp.partition()
        dp.run(20)
        final = dp.gather(0)
        assert final is not None
        try:
            plan = dp.model.plan.n_ghost
        except ConfigurationError as exc:
            plan = str(exc)
        pbcs = []
        if halo:  # the padded batch's open pbc: one tensor across rebuilds (a model
            # reads a pbc tensor it has not seen on the host)
            for _ in range(2):
                dp.model.request_rebuild()
                dp.run(1)
                pbcs.append(dp.model._static.pbc)
        return {
            "ids": final.atom_ids,
            "positions": final.positions,
            "forces": final.forces,
            "energy": final.energy,
            "n_ghost": dp.stats.n_ghost,
            "plan": plan,
            "same_pbc": [p is pbcs[0] and not bool(p.any()) for p in pbcs],
        }


@pytest.mark.parametrize("halo", [False, True])
def test_one_rank_runs_the_whole_batch_unless_asked_for_the_halo(halo: bool) -> None:
    got = run_ranks(_one_rank, 1, halo, timeout_s=120)[0]
    ref = _reference(make_gas(n=40), 20, SoftPair())
    order = torch.argsort(ref.atom_ids)
    assert torch.equal(got["ids"], ref.atom_ids[order])
    dx = _wrapped_diff(got["positions"], ref.positions[order], ref.cell[0], ref.pbc[0])
    assert float(dx.abs().max()) < 1e-10
    torch.testing.assert_close(got["forces"], ref.forces[order], rtol=0, atol=1e-10)
    torch.testing.assert_close(got["energy"], ref.energy, rtol=0, atol=1e-10)
    if halo:  # periodic images as ghost rows
        assert got["n_ghost"] > 0 and isinstance(got["plan"], int)
        assert got["same_pbc"] == [True, True]
    else:  # no ghosts, no plan: DomainParallel on one device costs what the model costs
        assert got["n_ghost"] == 0
        assert "no halo plan" in got["plan"]


class _Pipeline(PairSum):
    """Two soft pair potentials, the second with the MPNN preset's spec."""

    def __init__(self) -> None:
        second = soft_pair_mpnn_spec()
        second.eps = 0.05
        super().__init__([SoftPair(rc=2.5, eps=0.2), second], cutoff=2.5)


def _pipeline_in_domain_parallel(n_steps: int) -> dict:
    from nvdd.dynamics import DistributedPipelineModel

    dyn = VelocityVerlet(_Pipeline(), make_gas(triclinic=True), dt_fs=2.0)
    config = DomainConfig(cutoff=2.5, skin=0.4)
    with DomainParallel(dyn, config, count_collectives=True) as dp:
        assert isinstance(dp.model, DistributedPipelineModel)
        dp.partition()
        dp.run(n_steps)
        counts = dict(dp.stats.last_collectives)
        out = dp.gather(0)
    if out is None:
        return {}
    return {"ids": out.atom_ids, "forces": out.forces, "energy": out.energy, "counts": counts}


def test_domain_parallel_runs_a_pipeline_model() -> None:
    got = run_ranks(_pipeline_in_domain_parallel, 2, 6, timeout_s=120)[0]
    ref = VelocityVerlet(_Pipeline(), make_gas(triclinic=True), dt_fs=2.0)
    ref.run(6)
    assert_close_by_id(
        got["ids"], got["forces"], ref.batch.atom_ids, ref.batch.forces, atol=1e-10, what="forces"
    )
    out = _Pipeline()(ref.batch)
    torch.testing.assert_close(got["energy"], out["energy"], rtol=0, atol=1e-10)
    # One forward and ONE reverse exchange for both components, plus the component
    # with a replicated energy's all-reduce and the rebuild flag.
    assert got["counts"]["all_to_all_single"] == 2, got["counts"]


def test_a_pipeline_spec_cannot_be_overridden() -> None:
    from nvdd.core import ConfigurationError, shutdown_distributed
    from nvdd.dynamics import distributed_model_for  # noqa: F401 - the factory is public

    dyn = VelocityVerlet(_Pipeline(), make_gas(), dt_fs=2.0)
    try:
        with pytest.raises(ConfigurationError, match="cannot override a pipeline's spec"):
            DomainParallel(dyn, DomainConfig(cutoff=2.5), spec=SoftPair().distribution_spec())
    finally:
        shutdown_distributed()  # DomainParallel made a world of one in this process


def _rebalanced_twice() -> dict:
    dyn = VelocityVerlet(SoftPair(), make_gas(n=64), dt_fs=2.0)
    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=0.4)) as dp:
        dp.partition()
        dp.run(3)
        dp.sharded.rebalance()  # re-cut at the quantiles: atoms move, counts change
        dp.run(1)
        moved = dp.sharded.rebalance()  # the same quantiles again: a new partitioner
        before = dp.stats.rebuilds
        dp.run(1)
        after_second = dp.stats.rebuilds - before
        dp.run(4)
        out = dp.gather(0)
    return {
        "sent": int(moved.n_sent),
        "rebuilt": after_second,
        "ids": None if out is None else out.atom_ids,
        "forces": None if out is None else out.forces,
    }


def test_a_rebalance_rebuilds_the_plan_even_when_no_atom_moved() -> None:
    """A halo plan belongs to the boxes it was built for: after
    ``ShardedBatch.rebalance`` the next step rebuilds it (one shared decision),
    even when the new cuts moved no atom and the counts are unchanged."""
    got = run_ranks(_rebalanced_twice, 2, timeout_s=120)
    ref = _reference(make_gas(n=64), 9, SoftPair())
    for rank, g in enumerate(got):
        assert g["sent"] == 0, rank  # (the scenario: a second rebalance moves nothing)
        assert g["rebuilt"] == 1, rank
    assert_close_by_id(got[0]["ids"], got[0]["forces"], ref.atom_ids, ref.forces, atol=1e-10)


def _hook_raises_every_way() -> dict:
    return {where: _hook_raises(where) for where in ("every", "one", "local")}


def _hook_raises(where: str) -> dict:
    """A hook raises at step 3 on every rank (before the forces: mid-step) or on
    rank 1 only (after the step: a hook with needs, or a plain LOCAL hook every
    rank registered); then the save-on-error pattern gathers. Rank 0 alone has a
    progress hook (LOCAL, no needs), registered before the failing one."""
    dyn = VelocityVerlet(SoftPair(), make_gas(n=40), dt_fs=0.5)
    stage = HookStage.BEFORE_COMPUTE if where == "every" else HookStage.AFTER_STEP
    later: list[int] = []

    def full_disk(ctx: HookContext) -> None:
        if ctx.step == 3 and (where == "every" or ctx.rank == 1):
            raise OSError(f"disk full on rank {ctx.rank}")

    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=1.0), watchdog_s=40) as dp:
        dp.partition()
        if dp.rank == 0:
            dp.register_hook(HookStage.AFTER_STEP, lambda c: None)  # not agreed on
        dp.register_hook(stage, full_disk, needs=["energy"] if where == "one" else [])
        dp.register_hook(stage, lambda c: later.append(c.step), scope=HookScope.RANK_ZERO)
        try:
            dp.run(6)
            error = "none"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        final = dp.gather(0)  # every rank, at once: no watchdog
    got = {"error": error, "later": later, "steps": dyn.step_count}
    if final is not None:
        got.update(ids=final.atom_ids, pos=final.positions, forces=final.forces)
        got["forces_here"] = SoftPair()(final)["forces"].detach()
    return got


def test_after_a_hook_raised_every_rank_stops_there_and_gather_works() -> None:
    """Issue 39 item 6: a hook raising on one rank left the others in the next
    collective, so `except: dp.gather(0)` hung until the watchdog; one raising
    before the forces left gather returning forces of the previous positions."""
    ranks = run_ranks(_hook_raises_every_way, 2, timeout_s=120)
    for where in ("every", "one", "local"):
        got = [r[where] for r in ranks]
        assert [g["steps"] for g in got] == [3, 3]
        assert max(got[0]["later"]) < 3  # the hook after the failing one ran on no rank
    got = [r["every"] for r in ranks]
    for rank, g in enumerate(got):
        assert g["error"] == f"OSError: disk full on rank {rank}"
    # mid-step: the gathered forces belong to the gathered positions
    torch.testing.assert_close(got[0]["forces"], got[0]["forces_here"], rtol=0, atol=1e-12)
    ref = VelocityVerlet(SoftPair(), make_gas(n=40), dt_fs=0.5)
    ref.run(3)
    b = ref.batch
    order = b.atom_ids.argsort()
    for where in ("one", "local"):  # raised on rank 1 only
        got = [r[where] for r in ranks]
        assert got[1]["error"] == "OSError: disk full on rank 1"
        head = "CommunicationError: rank 0: stopped at step 3 (after_step"
        assert got[0]["error"].startswith(head), where
        assert "rank 1: OSError: disk full on rank 1" in got[0]["error"]
        assert_close_by_id(got[0]["ids"], got[0]["forces"], b.atom_ids, b.forces, atol=1e-10)
        diff = _wrapped_diff(got[0]["pos"], b.positions[order], b.cell[0], b.pbc[0])
        assert float(diff.abs().max()) < 1e-10
