"""Each preset's options select behaviour the models show (not only stored values).

The long-range presets (Ewald's structure-factor all-reduce, PME's mesh
all-reduce, DFT-D3's coordination-number refresh or wide halo) are shown in
``test_models_longrange.py``; here the short-range ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from models_ddcases import CASES, _model_and_rows, global_batch, make_model

from nvdd.core import ConfigurationError
from nvdd.models import MPNNConfig, ReferenceMPNN
from nvdd.shardtensor import DDContext, dd_scope
from nvdd.spec import (
    SPEC_LJ_HALO,
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    SPEC_UMA_HALO,
    AdapterRegistry,
    ScatterMode,
    StrategyKind,
    StrategyOptions,
)
from nvdd.testing import assert_close_by_id, run_ranks


def _mpnn(spec: Any) -> ReferenceMPNN:
    config = MPNNConfig(cutoff=2.6, species=(1, 6, 8), hidden=8, n_basis=6, n_layers=2, seed=7)
    return ReferenceMPNN(config, spec=spec)


def _counted_forward(kind: str, case: str, preset: str) -> dict[str, Any]:
    """Rank function: one decomposed forward (forces folded), with its collectives counted."""
    fold = SPEC_MPNN_HALO.replace(options=StrategyOptions(scatter=ScatterMode.FOLD))
    spec = {"fold": fold, "local": SPEC_MPNN_HALO, "uma": SPEC_UMA_HALO, "lj": SPEC_LJ_HALO}[preset]
    _, plan, padded = _model_and_rows(kind, case)
    model = _mpnn(spec) if kind == "mpnn" else make_model("lj")
    calls = {"all_to_all_single": 0, "all_reduce": 0}
    originals = {name: getattr(dist, name) for name in calls}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    leaf = padded.positions.detach().requires_grad_(kind == "mpnn")
    with dd_scope(DDContext(layout=plan, positions=leaf, topology_version=0)):
        model(padded.replace(positions=leaf))  # the input check of the new topology
        for name in calls:
            setattr(dist, name, counting(name))
        try:
            out = model(padded.replace(positions=leaf))
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
    n = plan.n_owned
    f = out["forces"].detach()
    return {"ids": padded.atom_ids[:n], "forces": f[:n] + plan.reverse(f[n:]), "calls": calls}


@pytest.mark.gloo
def test_mpnn_scatter_mode_selects_fold_or_refresh_per_layer() -> None:
    case = "triclinic-3"
    fold = run_ranks(_counted_forward, CASES[case][0], "mpnn", case, "fold", timeout_s=120)
    local = run_ranks(_counted_forward, CASES[case][0], "mpnn", case, "local", timeout_s=120)
    ref = _mpnn(SPEC_MPNN_HALO)(global_batch(case, "mpnn"))
    ids = global_batch(case, "mpnn").atom_ids
    for got in (fold, local):
        assert_close_by_id(
            torch.cat([g["ids"] for g in got]),
            torch.cat([g["forces"] for g in got]),
            ids,
            ref["forces"],
            atol=1e-10,
            what="forces",
        )
    # 2 layers, forward and backward: FOLD = 2 exchanges per layer each way (8);
    # LOCAL (the preset) = a refresh after every layer but the last, each way (2);
    # the energy's one all-reduce either way.
    assert {g["calls"]["all_to_all_single"] for g in fold} == {8}
    assert {g["calls"]["all_to_all_single"] for g in local} == {2}
    assert {g["calls"]["all_reduce"] for g in fold + local} == {1}


@pytest.mark.gloo
def test_uma_preset_refreshes_per_layer_and_its_adapter_is_optional() -> None:
    """SPEC_UMA_HALO drives the MPNN like SPEC_MPNN_HALO (owned receivers, one
    refresh per layer but the last, each way: 2 exchanges, not FOLD's 8), and its
    one addition, the fairchem graph-parallel switch, is optional: without fairchem
    it is reported as not applied and nothing fails (that it switches fairchem's
    mode off under DomainParallel: integration_tests/test_it_conformance.py)."""
    case = "triclinic-3"
    uma = run_ranks(_counted_forward, CASES[case][0], "mpnn", case, "uma", timeout_s=120)
    ref = _mpnn(SPEC_UMA_HALO)(global_batch(case, "mpnn"))
    assert_close_by_id(
        torch.cat([g["ids"] for g in uma]),
        torch.cat([g["forces"] for g in uma]),
        global_batch(case, "mpnn").atom_ids,
        ref["forces"],
        atol=1e-10,
        what="forces",
    )
    assert {g["calls"]["all_to_all_single"] for g in uma} == {2}
    (adapter,) = SPEC_UMA_HALO.adapters()
    assert adapter.optional and adapter.target == "fairchem.core.common.gp_utils:initialized"
    registry = AdapterRegistry(SPEC_UMA_HALO.adapters())
    with registry:
        (status,) = registry.statuses
        assert not status.applied and "fairchem" in str(status.error)


@pytest.mark.gloo
def test_lj_preset_keeps_the_energy_partial_without_a_collective() -> None:
    got = run_ranks(_counted_forward, 2, "lj", "periodic-2", "lj", timeout_s=120)
    assert [g["calls"] for g in got] == [{"all_to_all_single": 0, "all_reduce": 0}] * 2


def test_scatter_none_is_refused_where_layers_need_an_exchange() -> None:
    none = SPEC_MPNN_HALO.replace(options=StrategyOptions(scatter=ScatterMode.NONE))
    with pytest.raises(ConfigurationError, match="2 layers needs a per-layer exchange"):
        _mpnn(none)
    one = ReferenceMPNN(MPNNConfig(cutoff=2.6, species=(1, 6, 8), n_layers=1), spec=none)
    assert one.distribution_spec() is none


def test_graph_partition_preset_is_what_the_mpnn_returns_for_it() -> None:
    assert SPEC_MPNN_GP.strategy is StrategyKind.GRAPH_PARTITION
    assert make_model("mpnn").distribution_spec(StrategyKind.GRAPH_PARTITION) is SPEC_MPNN_GP
