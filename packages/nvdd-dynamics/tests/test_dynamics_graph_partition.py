"""StrategyKind.GRAPH_PARTITION in the runtime: GraphPartitionModel against the
unsharded model by atom id, replicate_rows, and spec/strategy mismatches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dyn_models import SoftPair
from test_dynamics_domain_parallel import make_gas

from nvdd.core import ConfigurationError
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
