"""StrategyKind.GRAPH_PARTITION in the runtime: GraphPartitionModel against the
unsharded model by atom id, replicate_rows, and spec/strategy mismatches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dyn_models import PairSum, SoftPair
from test_dynamics_domain_parallel import make_gas

from nvdd.core import Batch, ConfigurationError
from nvdd.dynamics import (
    DistributedModel,
    DistributedPipelineModel,
    DomainConfig,
    DomainParallel,
    GraphPartitionModel,
    VelocityVerlet,
)
from nvdd.dynamics._graph_partition import replicate_rows
from nvdd.spec import (
    SPEC_LJ_HALO,
    SPEC_MPNN_GP,
    DistributionSpec,
    MLIPSpec,
    StrategyKind,
)
from nvdd.testing import assert_close_by_id, run_ranks

GP = StrategyKind.GRAPH_PARTITION
SPEC_PAIR_GP = SPEC_LJ_HALO | MLIPSpec(distribution=DistributionSpec(storage=GP))


def test_a_spec_for_one_strategy_never_runs_under_the_other() -> None:
    model = SoftPair()
    with pytest.raises(
        ConfigurationError, match=r"SPEC_MPNN_GP declares storage .*GRAPH_PARTITION"
    ):
        DistributedModel(model, DomainConfig(cutoff=2.5), spec=SPEC_MPNN_GP)
    with pytest.raises(ConfigurationError, match=r"storage StrategyKind.HALO .* is .*GRAPH"):
        GraphPartitionModel(model, DomainConfig(cutoff=2.5, strategy=GP))  # SoftPair: HALO spec
    with pytest.raises(ConfigurationError, match="use GraphPartitionModel"):
        DistributedModel(model, DomainConfig(cutoff=2.5, strategy=GP), spec=SPEC_PAIR_GP)
    with pytest.raises(ConfigurationError, match="use DistributedModel"):
        GraphPartitionModel(model, DomainConfig(cutoff=2.5), spec=SPEC_PAIR_GP)
    with pytest.raises(ConfigurationError, match=r"runs StrategyKind\.HALO"):
        DistributedPipelineModel(
            [SoftPair(spec=SPEC_PAIR_GP)], DomainConfig(cutoff=2.5, strategy=GP)
        )
    ok = GraphPartitionModel(
        model, DomainConfig(cutoff=2.5, skin=0.5, strategy=GP), spec=SPEC_PAIR_GP
    )
    assert ok.ghost_width == 3.0  # cutoff + skin, no migration hysteresis


def _replicate_body() -> torch.Tensor:
    rank = dist.get_rank()
    counts = (3, 2, 2)
    rows = torch.arange(counts[rank] * 2, dtype=torch.float64).reshape(-1, 2) + 100 * rank
    return replicate_rows(rows, counts, None)


@pytest.mark.gloo
def test_replicate_rows_concatenates_every_block_in_rank_order() -> None:
    out = run_ranks(_replicate_body, 3, timeout_s=60)
    want = torch.cat(
        [
            torch.arange(n * 2, dtype=torch.float64).reshape(-1, 2) + 100 * r
            for r, n in enumerate((3, 2, 2))
        ]
    )
    assert all(torch.equal(o, want) for o in out)


def _gp_run(kw: dict, n_steps: int) -> dict:
    dyn = VelocityVerlet(SoftPair(spec=SPEC_PAIR_GP), make_gas(**kw), dt_fs=2.0)
    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=0.4, strategy=GP)) as dp:
        sharded = dp.partition()
        dp.run(n_steps)
        out = dp.gather(0)
        stats = dp.stats
        kind = type(sharded).__name__
    if out is None:
        return {}
    return {"ids": out.atom_ids, "forces": out.forces, "rebuilds": stats.rebuilds, "kind": kind}


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("world", "kw"),
    [(2, {"triclinic": True}), (3, {"pbc": (False, False, False)})],
    ids=["triclinic-2", "open-3"],
)
def test_graph_partition_equals_the_unsharded_model_by_id(world: int, kw: dict) -> None:
    got = run_ranks(_gp_run, world, kw, 12, timeout_s=120)[0]
    assert got["kind"] == "IndexShardedBatch" and got["rebuilds"] >= 1
    dyn = VelocityVerlet(SoftPair(), make_gas(**kw), dt_fs=2.0)
    dyn.run(12)
    ref = dyn.batch
    assert float(ref.forces.abs().max()) > 1e-3
    assert_close_by_id(
        got["ids"], got["forces"], ref.atom_ids, ref.forces, atol=1e-10, what="forces"
    )


def test_each_rank_compiles_into_its_own_cache_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    from nvdd.dynamics._compile import use_rank_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/nvdd-cache-test")
    assert use_rank_cache_dir(3) == "/tmp/nvdd-cache-test/rank3"
    assert use_rank_cache_dir(3) == "/tmp/nvdd-cache-test/rank3"  # idempotent
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert use_rank_cache_dir(0).endswith("rank0")


# ------------------------------------------- pipelines and checkpoints (issue 40)
class _PairPipeline(PairSum):
    """A composed model of two soft pair potentials, each with the spec of
    ``strategy``; its forward (the sum) is the 1-process oracle."""

    def __init__(self, strategy: StrategyKind) -> None:
        spec = SPEC_PAIR_GP if strategy is GP else SPEC_LJ_HALO
        parts = [SoftPair(rc=2.5, eps=0.2, spec=spec), SoftPair(rc=2.0, eps=0.05, spec=spec)]
        super().__init__(parts, cutoff=2.5)


def _dp(strategy: StrategyKind) -> DomainParallel:
    dyn = VelocityVerlet(_PairPipeline(strategy), make_gas(triclinic=True), dt_fs=2.0)
    return DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=0.4, strategy=strategy))


def _state(b: Batch) -> dict:
    return {"ids": b.atom_ids, "positions": b.positions, "forces": b.forces}


def _pipeline_checkpoint_restarts(path: str, n: int) -> dict:
    """A GP pipeline run of 2n steps with a checkpoint at n; restarts from it
    under GRAPH_PARTITION (the same world: exact) and under HALO (by id)."""
    with _dp(GP) as dp:
        kind = type(dp.model).__name__
        dp.partition()
        dp.run(n)
        dp.save(path)
        dp.run(n)
        full = dp.gather(0)
    with _dp(GP) as dp:
        manifest = dp.load(path)
        dp.run(n)
        same = dp.gather(0)
    with _dp(StrategyKind.HALO) as dp:
        dp.load(path)
        dp.run(n)
        halo = dp.gather(0)
    if full is None or same is None or halo is None:
        return {}
    out = {"kind": kind, "domain": manifest["domain"], "partitioner": manifest["partitioner"]}
    return out | {k: _state(b) for k, b in (("full", full), ("same", same), ("halo", halo))}


@pytest.mark.gloo
def test_a_pipeline_runs_and_restarts_under_graph_partition(tmp_path: Path) -> None:
    got = run_ranks(_pipeline_checkpoint_restarts, 2, str(tmp_path / "ckpt"), 4, timeout_s=120)[0]
    assert got["kind"] == "GraphPartitionPipelineModel"
    assert got["domain"]["strategy"] == "graph_partition" and got["partitioner"] is None
    dyn = VelocityVerlet(_PairPipeline(GP), make_gas(triclinic=True), dt_fs=2.0)
    dyn.run(8)
    ref = dyn.batch
    assert float(ref.forces.abs().max()) > 1e-3
    full = got["full"]
    assert_close_by_id(full["ids"], full["forces"], ref.atom_ids, ref.forces, atol=1e-10)
    assert_close_by_id(full["ids"], full["positions"], ref.atom_ids, ref.positions, atol=1e-10)
    # the same world under the same strategy continues bit for bit
    for key in ("ids", "positions", "forces"):
        assert torch.equal(got["same"][key], full[key]), key
    # the other strategy reads it by atom id (positions wrapped into the cell)
    halo = got["halo"]
    assert_close_by_id(halo["ids"], halo["forces"], full["ids"], full["forces"], atol=1e-10)


def test_pipelines_pick_the_runtime_of_the_strategy_and_need_its_specs() -> None:
    from nvdd.dynamics import distributed_model_for

    gp = DomainConfig(cutoff=2.5, skin=0.4, strategy=GP)
    assert type(distributed_model_for(_PairPipeline(GP), gp)).__name__ == (
        "GraphPartitionPipelineModel"
    )
    assert isinstance(distributed_model_for(SoftPair(spec=SPEC_PAIR_GP), gp), GraphPartitionModel)
    halo_only = _PairPipeline(StrategyKind.HALO)  # its parts have HALO specs only
    with pytest.raises(ConfigurationError, match=r"declares storage StrategyKind\.HALO"):
        distributed_model_for(halo_only, gp)
