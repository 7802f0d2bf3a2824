"""The MPNN's device edges: steady steps captured (split at the edge buffers'
verdict) equal eager steps, in one process and under DomainParallel on one rank.

On CPU through ``nvdd.core.emulated_capture`` (a host read inside a captured
step raises there); the CUDA runs are the ``gpu`` tests at the end.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from it_ranks import steady_collectives
from it_systems import MPNN_CUTOFF, crystal, mpnn_model

from nvdd.core import ValidationError, emulated_capture
from nvdd.dynamics import DomainConfig, DomainParallel, HookStage, VelocityVerlet
from nvdd.testing import run_ranks

# single-process DomainParallel runs here make a world of one in the test process
pytestmark = [pytest.mark.gloo, pytest.mark.leaves_process_group]

_FIELDS = ("positions", "velocities", "forces", "energy")


def _run(
    graphs: bool,
    steps: int = 40,
    *,
    dp: bool = False,
    squeeze_at: int | None = None,
    device: str = "cpu",
    compiled: bool = False,
    neighbors: str = "device",
    halo: bool = False,
    headroom: float | None = None,
    layers: int = 2,
    stretch: float = 1.0,
) -> dict[str, Any]:
    model = mpnn_model(layers, neighbors=neighbors).to(device)
    model.device_edges.headroom = headroom
    batch = crystal("periodic", temperature_k=900.0, seed=2)
    batch = batch.replace(positions=batch.positions * stretch, cell=batch.cell * stretch)
    batch = batch.to(device=device)
    dyn = VelocityVerlet(model, batch, dt_fs=2.0, cuda_graphs=graphs)
    if squeeze_at is not None:

        def squeeze(ctx: Any) -> None:  # in place: denser, so more edges than the buffers hold
            if ctx.step == squeeze_at:
                ctx.batch.positions.mul_(0.72)
                ctx.batch.cell.mul_(0.72)

        dyn.register_hook(HookStage.BEFORE_STEP, squeeze)
    runner: Any = dyn
    if dp:
        config = DomainConfig(cutoff=MPNN_CUTOFF, skin=0.5, compile=compiled, halo_on_one_rank=halo)
        runner = DomainParallel(dyn, config)
        runner.partition(batch)
    with emulated_capture() if device == "cpu" else nullcontext():
        runner.run(steps)
    final = runner.to_global() if dp else dyn.batch
    order = torch.argsort(final.atom_ids)
    out: dict[str, Any] = {k: getattr(final, k)[order].cpu() for k in _FIELDS[:3]}
    out["energy"] = final.energy.cpu()
    out.update(
        captures=dyn.graphs.captures,
        replays=dyn.graphs.replays,
        drops=dyn.graphs.drops,
        builds=model.device_edges.candidates.n_builds,
        regrows=model.device_edges.regrows,
        capacity=model.device_edges.capacity,
    )
    if dp:
        out["rebuilds"] = runner.stats.rebuilds
        runner.close()
    return out


def _same(a: dict[str, Any], b: dict[str, Any], **tol: float) -> None:
    for key in _FIELDS:
        if tol:
            torch.testing.assert_close(a[key], b[key], msg=key, **tol)
        else:  # a replay reruns the eager step's operations in the same order
            assert torch.equal(a[key], b[key]), key


def test_replayed_mpnn_steps_equal_eager_steps_and_rebuild_on_the_device() -> None:
    eager, graphed = _run(False), _run(True)
    _same(graphed, eager)
    assert eager["captures"] == 0 and graphed["captures"] >= 1
    assert graphed["replays"] >= 30
    # neighbour lists rebuilt inside replays, decided on the device
    assert graphed["builds"] == eager["builds"] > 2


def test_edges_that_outgrow_their_buffers_drop_the_graph_and_stay_exact() -> None:
    eager, graphed = _run(False, squeeze_at=20), _run(True, squeeze_at=20)
    _same(graphed, eager)
    assert graphed["regrows"] >= 1 and graphed["drops"] >= 1
    assert graphed["captures"] >= 2 and graphed["replays"] >= 25
    # the Verlet path on the same trajectory: the same physics to rounding
    verlet = _run(False, squeeze_at=20, neighbors="verlet")
    _same(graphed, verlet, rtol=1e-10, atol=1e-10)


def _dp_case(graphs: bool) -> dict[str, Any]:
    return _run(graphs, dp=True)


@functools.cache
def _eager_dp() -> dict[str, Any]:
    """The eager 40-step run on one rank (cached: the compiled test compares with it too)."""
    (eager,) = run_ranks(_dp_case, 1, False)
    return eager


def test_domain_parallel_on_one_rank_replays_the_mpnn_step() -> None:
    eager = _eager_dp()
    (graphed,) = run_ranks(_dp_case, 1, True)
    _same(graphed, eager)
    assert graphed["captures"] >= 1 and graphed["replays"] >= 30


def _cuda(graphs: bool, compiled: bool, halo: bool = False) -> dict[str, Any]:
    if halo:  # the halo path forced on one GPU (NCCL world of one); eager: overflowing
        # edges (compiled: default headroom, each regrow would recompile)
        kw: dict[str, Any] = {"halo": True, "layers": 3, "stretch": 1.075}
        kw["headroom"] = None if compiled else 1.0
        return _run(graphs, 60, dp=True, device="cuda", compiled=compiled, **kw)
    return _run(graphs, 60, dp=True, device="cuda", compiled=compiled, squeeze_at=30)


@pytest.mark.gpu
@pytest.mark.parametrize("halo", [False, True], ids=["whole", "halo"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_mpnn_cuda_graph_replays_equal_eager_steps_on_a_gpu(compiled: bool, halo: bool) -> None:
    spawn: dict[str, Any] = {"backend": "nccl", "start_method": "spawn"}
    (eager,) = run_ranks(_cuda, 1, False, compiled, halo, **spawn)
    (graphed,) = run_ranks(_cuda, 1, True, compiled, halo, **spawn)
    # eager CUDA runs differ by the order of atomic additions
    _same(graphed, eager, rtol=1e-9, atol=1e-9)
    assert graphed["captures"] >= 2 and graphed["replays"] >= 30
    assert graphed["regrows"] >= 1 or (halo and compiled)


def _compiled_case(graphs: bool, compiled: bool) -> dict[str, Any]:
    return _run(graphs, 40, dp=True, compiled=compiled)


def test_a_compiled_mpnn_step_is_captured_and_equals_the_eager_step() -> None:
    eager = _eager_dp()  # = _compiled_case(False, False)
    (graphed,) = run_ranks(_compiled_case, 1, True, True)
    _same(graphed, eager, rtol=1e-12, atol=1e-12)
    assert graphed["captures"] >= 1 and graphed["replays"] >= 20


def _halo_case(graphs: bool, kw: dict[str, Any]) -> dict[str, Any]:
    return _run(graphs, 40, dp=True, **kw)


@functools.cache
def _eager_halo(ranks: int, kw_items: tuple[tuple[str, Any], ...]) -> list[dict[str, Any]]:
    """Every rank's eager run of :func:`_halo_case` (cached: the compiled test
    compares with the 3-layer case's eager run too)."""
    return run_ranks(_halo_case, ranks, False, dict(kw_items))


@pytest.mark.parametrize(
    ("ranks", "kw"),
    [
        (2, {}),
        (1, {"halo": True}),
        (2, {"layers": 3}),  # a middle layer between two refreshes
        # exact capacities, nearest neighbours at the cutoff: edges overflow in replays
        (2, {"headroom": 1.0, "stretch": 1.075}),
    ],
    ids=["2-ranks", "halo-on-1-rank", "2-ranks-3-layers", "2-ranks-overflowing"],
)
def test_mpnn_halo_steps_are_replayed_and_equal_eager_steps(ranks: int, kw: dict[str, Any]) -> None:
    eager = _eager_halo(ranks, tuple(sorted(kw.items())))[0]
    graphed_all = run_ranks(_halo_case, ranks, True, kw)
    graphed = graphed_all[0]
    _same(graphed, eager)
    assert graphed["captures"] >= 1 and graphed["replays"] >= 15
    assert graphed["rebuilds"] == eager["rebuilds"]  # an overflow is not a halo rebuild
    if "headroom" in kw:
        assert sum(r["regrows"] for r in graphed_all) >= 1 and graphed["drops"] >= 1
    verlet = run_ranks(_halo_case, ranks, False, {**kw, "neighbors": "verlet"})[0]
    _same(graphed, verlet, rtol=1e-10, atol=1e-10)


def test_a_compiled_mpnn_halo_step_is_captured_and_equals_the_eager_step() -> None:
    kw: dict[str, Any] = {"layers": 3}
    eager = _eager_halo(2, tuple(sorted(kw.items())))[0]  # the 2-ranks-3-layers case's
    graphed = run_ranks(_halo_case, 2, True, {**kw, "compiled": True})[0]
    _same(graphed, eager, rtol=1e-12, atol=1e-12)
    assert graphed["captures"] >= 1 and graphed["replays"] >= 15


def _poisoned(graphs: bool) -> dict[str, Any]:
    """Two ranks on the device edges; rank 1 alone gets a NaN velocity at step 20
    (its search then flags an error). Returns what each rank raised."""
    model = mpnn_model(2, neighbors="device")
    batch = crystal("periodic", temperature_k=900.0, seed=2)
    dyn = VelocityVerlet(model, batch.clone(), dt_fs=2.0, cuda_graphs=graphs)

    def poison(ctx: Any) -> None:
        if ctx.step == 20 and ctx.rank == 1:
            ctx.batch.velocities[0, 0] = float("nan")

    dyn.register_hook(HookStage.BEFORE_STEP, poison)
    runner = DomainParallel(dyn, DomainConfig(cutoff=MPNN_CUTOFF, skin=0.5))
    runner.partition(batch)
    try:
        with emulated_capture():
            runner.run(40)
    except ValidationError as exc:
        return {"raised": str(exc), "replays": dyn.graphs.replays}
    finally:
        runner.close()
    return {"raised": None, "replays": dyn.graphs.replays}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "replayed"])
def test_a_non_finite_value_on_one_rank_raises_on_every_rank(graphs: bool) -> None:
    """The search of the poisoned rank records its error instead of raising
    alone (the other rank would wait in a collective); the shared decision of
    the step raises on both, naming rank 1."""
    for rank, out in enumerate(run_ranks(_poisoned, 2, graphs, timeout_s=300)):
        assert out["raised"] is not None and "non-finite" in out["raised"], (rank, out)
        assert "rank 1" in out["raised"], (rank, out["raised"])
        assert (out["replays"] > 0) == graphs, (rank, out)


def _quiet_counts(neighbors: str) -> list[dict[str, int]]:
    """Collectives of the steady (non-rebuilding) steps of a 2-rank MPNN run."""
    model = mpnn_model(2, neighbors=neighbors)
    batch = crystal("periodic", temperature_k=20.0, seed=2)
    dyn = VelocityVerlet(model, batch, dt_fs=1.0, cuda_graphs=False)
    config = DomainConfig(cutoff=MPNN_CUTOFF, skin=1.0)
    with DomainParallel(dyn, config, count_collectives=True) as dp:
        dp.partition(batch)
        dp.run(3)
        return steady_collectives(dp, 4)


def test_the_device_edges_cost_no_extra_collective() -> None:
    """The head's search exchanges the ghost positions before the step's
    decision and the forward reuses them: a steady step on the device edges
    issues exactly the collectives of one on the Verlet list (the default under
    the halo, where no head search runs)."""
    counts = {nb: run_ranks(_quiet_counts, 2, nb)[0] for nb in ("auto", "verlet", "device")}
    assert counts["auto"] == counts["verlet"] == counts["device"] != []
    assert all(c.get("all_to_all_single", 0) > 0 for c in counts["device"])
