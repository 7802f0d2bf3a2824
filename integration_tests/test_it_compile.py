"""compile=True: the models' padded, collective-free compiled regions compile once.

Backend ``aot_eager`` (AOTAutograd traces forward and backward, no code
generation: the same graphs inductor would compile, at a fraction of the cost on
2 CPU cores). Hot systems make the per-rank atom and edge counts drift; after a
warm-up no graph may be compiled again, and the run must equal one process by
atom id.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from it_systems import LJ_CUTOFF, crystal, lj_model, model_for

from nvdd.dynamics import DomainConfig, DomainParallel, HookStage, VelocityVerlet
from nvdd.spec import CompilePolicy, MLIPSpec, StrategyKind
from nvdd.testing import assert_close_by_id, run_ranks

pytestmark = pytest.mark.gloo

HOT_K = 2500.0


def _run(
    model_name: str, strategy: str, n_steps: int, warmup: int, compile: bool = True
) -> dict[str, Any]:
    """Rank body: a hot crystal through ``DomainParallel`` (compiled core, backend
    aot_eager); every rank returns its own compile stats, rank 0 also the final
    state."""
    model, cutoff = model_for(model_name)
    if model_name == "lj":  # compile=True compiles LJ's torch path (Warp is native code)
        model, cutoff = lj_model(backend="torch"), LJ_CUTOFF
    kind = StrategyKind(strategy)
    spec = model.distribution_spec(kind) | MLIPSpec(
        compile=CompilePolicy(enabled=compile, backend="aot_eager")
    )
    dyn = VelocityVerlet(model, crystal("periodic", temperature_k=HOT_K), dt_fs=2.0)
    config = DomainConfig(cutoff=cutoff, skin=0.5, strategy=kind, compile=compile)
    shapes: set[tuple[int, int]] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with DomainParallel(dyn, config, spec=spec) as dp:
            dp.partition()
            dp.run(warmup)
            compiles, rebuilds = dp.stats.compiles, dp.stats.rebuilds
            caps = dict(model._core.capacities) if compile else {}

            def shape(ctx: Any) -> None:
                shapes.add((dp.stats.n_owned, dp.stats.n_ghost))

            dp.register_hook(HookStage.AFTER_STEP, shape)
            dp.run(n_steps - warmup)
            out = dp.gather(0)
            stats = dp.stats
            caps_at_end = dict(model._core.capacities) if compile else {}
    this_rank = {
        "mode": stats.compile_mode,
        "warm_compiles": compiles,
        "compiles": stats.compiles,
        "rebuilds_after_warmup": stats.rebuilds - rebuilds,
        "shapes_after_warmup": shapes,
        "caps_at_warmup": caps,
        "caps": caps_at_end,
    }
    if out is None:  # (not rank 0: its own compile stats only)
        return this_rank
    return {"ids": out.atom_ids, "forces": out.forces, **this_rank}


def _reference(model_name: str, n_steps: int) -> Any:
    model, _ = model_for(model_name)
    dyn = VelocityVerlet(model, crystal("periodic", temperature_k=HOT_K), dt_fs=2.0)
    dyn.run(n_steps)
    return dyn.batch


@pytest.mark.parametrize("strategy", ["halo", "graph_partition"])
def test_compiled_mpnn_on_two_ranks_never_recompiles_while_counts_drift(strategy: str) -> None:
    """No rank compiles a graph after the warm-up while its counts drift (each
    rank's own compile counter: a rank that recompiled alone would show only
    there), and the run equals one process."""
    steps, warmup = 80, 10
    ranks = run_ranks(_run, 2, "mpnn2", strategy, steps, warmup, timeout_s=900)
    for rank, got in enumerate(ranks):
        assert got["mode"] == "core", (rank, got["mode"])
        assert got["warm_compiles"] >= 2, (rank, got)  # embed + first layer, last + readout
        assert got["compiles"] == got["warm_compiles"], (
            f"rank {rank}: {got['compiles'] - got['warm_compiles']} graph(s) compiled after "
            f"the warm-up (capacities {got['caps_at_warmup']} -> {got['caps']})"
        )
        assert got["rebuilds_after_warmup"] >= 3, (rank, got["rebuilds_after_warmup"])
        # the counts drifted: new row counts (halo) or ghost sets (graph partition)
        assert len(got["shapes_after_warmup"]) >= 3, (rank, got["shapes_after_warmup"])
    assert ranks[0]["caps"] == ranks[1]["caps"]  # agreed at every rebuild
    ref = _reference("mpnn2", steps)
    assert_close_by_id(
        ranks[0]["ids"], ranks[0]["forces"], ref.atom_ids, ref.forces, atol=1e-10, what="forces"
    )


@pytest.mark.parametrize(
    ("model", "strategy", "world"),
    [
        ("lj", "graph_partition", 3),
        ("mpnn2", "graph_partition", 2),
        ("lj", "halo", 1),
        ("mpnn3", "halo", 2),  # the compiled regions around two refreshes (a middle layer)
    ],
)
def test_compiled_forward_equals_one_rank(model: str, strategy: str, world: int) -> None:
    steps = 20
    got = run_ranks(_run, world, model, strategy, steps, 5, timeout_s=900)[0]
    assert got["mode"] == "core" and got["compiles"] == got["warm_compiles"] >= 1
    ref = _reference(model, steps)
    assert_close_by_id(
        got["ids"], got["forces"], ref.atom_ids, ref.forces, atol=1e-10, what="forces"
    )


@pytest.mark.parametrize("strategy", ["halo", "graph_partition"])
def test_mace_with_compile_is_refused_when_the_distributed_model_is_built(strategy: str) -> None:
    """Compiled whole, MACE fails inside e3nn on every rank after about 100 s
    (issue 37): the distributed model refuses it when built, in-process (no
    process group, no compile), naming the model, why and what to do instead."""
    from nvdd.core import ConfigurationError
    from nvdd.dynamics import DistributedModel, GraphPartitionModel

    model, cutoff = model_for("mace")
    kind = StrategyKind(strategy)
    built = GraphPartitionModel if kind is StrategyKind.GRAPH_PARTITION else DistributedModel
    with pytest.raises(ConfigurationError) as err:
        built(model, DomainConfig(cutoff=cutoff, skin=0.5, strategy=kind, compile=True))
    text = str(err.value)
    assert text.startswith("MACEModel cannot run with DomainConfig(compile=True): ")
    assert "Dynamo fails inside e3nn" in text and "Irreps.__len__" in text
    assert "Run it eager: DomainConfig(compile=False)" in text
    eager = built(model, DomainConfig(cutoff=cutoff, skin=0.5, strategy=kind))
    assert eager.forward_fn is model
