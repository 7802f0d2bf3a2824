"""Captured steps (CUDA graphs) on the CPU, through ``nvdd.core.emulated_capture``.

The emulation replays exactly the recorded device work on the recorded tensors
(see ``nvdd.core._capture``), so these tests see what a CUDA graph replays: a
host decision baked into the capture, a tensor rebound after it, a stale input.
Every run is compared with the same run stepped eagerly.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from it_systems import crystal, lj_model

from nvdd.core import Batch, ValidationError, emulated_capture
from nvdd.dynamics import (
    MTKNPT,
    WARMUP_STEPS,
    CellDOF,
    DomainConfig,
    DomainParallel,
    HookStage,
    Langevin,
    NoseHooverNVT,
    VelocityVerlet,
)
from nvdd.testing import run_ranks

# single-process DomainParallel runs here make a world of one in the test process
pytestmark = [pytest.mark.gloo, pytest.mark.leaves_process_group]


def _hot(kind: str = "periodic") -> Batch:
    return crystal(kind, temperature_k=2500.0, seed=4)


def _trajectory(
    batch: Batch,
    steps: int,
    *,
    graphs: bool,
    hooks: bool = False,
    squeeze_at: int | None = None,
    dp: bool = False,
    device: str = "cpu",
    dtype: torch.dtype = torch.float64,
    integrator: str = "nve",
    halo_on_one_rank: bool = False,
) -> dict[str, Any]:
    model = lj_model(dtype).to(device)
    batch = batch.clone().to(device=device, dtype=dtype)  # a hook below changes the cell in place
    if integrator == "langevin":
        dyn: Any = Langevin(model, batch, dt_fs=2.0, temperature_K=300.0, cuda_graphs=graphs)
    elif integrator == "nvt-nh":  # (the chain on the device: a Warp launch per half step)
        dyn = NoseHooverNVT(
            model, batch, dt_fs=2.0, temperature_K=300.0, tau_fs=40.0, cuda_graphs=graphs
        )
    elif integrator == "npt":  # (chains, cell momentum and cell on the device)
        dyn = MTKNPT(model, batch, dt_fs=2.0, temperature_K=300.0, pressure_bar=1.0e4,
                     tau_t_fs=40.0, tau_p_fs=200.0, cell_dof=CellDOF.FULL, cuda_graphs=graphs)  # fmt: skip
    else:
        dyn = VelocityVerlet(model, batch, dt_fs=2.0, cuda_graphs=graphs)
    seen: list[tuple[int, float]] = []
    if hooks:  # a hook after the step (replays go on) and one inside it (an eager step)
        dyn.register_hook(
            HookStage.AFTER_STEP,
            lambda ctx: seen.append((ctx.step, float(ctx.batch.energy.sum()))),
            every=7,
            needs=("energy",),
        )
        dyn.register_hook(HookStage.BEFORE_COMPUTE, lambda ctx: None, every=25)
    if squeeze_at is not None:

        def squeeze(ctx: Any) -> None:  # in place: the same tensors, denser values
            if ctx.step == squeeze_at:
                ctx.batch.positions.mul_(0.8)
                ctx.batch.cell.mul_(0.8)

        dyn.register_hook(HookStage.BEFORE_STEP, squeeze)
    if device == "cuda":  # the host waits for each step: flags land at the same step each run
        dyn.register_hook(HookStage.AFTER_STEP, lambda ctx: torch.cuda.synchronize())
    runner: Any = dyn
    counters: list[tuple[int, int, int, int]] = []  # (step, rebuilds, captures, replays)
    if dp:
        dyn.register_hook(
            HookStage.AFTER_STEP,
            lambda ctx: counters.append(
                (ctx.step, runner.stats.rebuilds, dyn.graphs.captures, dyn.graphs.replays)
            ),
        )
        config = DomainConfig(cutoff=model.cutoff, skin=0.5, halo_on_one_rank=halo_on_one_rank)
        runner = DomainParallel(dyn, config)
        runner.partition(batch)
    # on CPU the emulation; on CUDA real graphs
    with emulated_capture() if device == "cpu" else nullcontext():
        runner.run(steps)
    final = runner.to_global() if dp else dyn.batch
    order = torch.argsort(final.atom_ids)
    out = {
        "positions": final.positions[order].clone(),
        "velocities": final.velocities[order].clone(),
        "forces": final.forces[order].clone(),
        "energy": final.energy.clone(),
        "cell": final.cell.clone(),
        "seen": seen,
        "captures": dyn.graphs.captures,
        "replays": dyn.graphs.replays,
        "drops": dyn.graphs.drops,
        "host_rebuilds": model.device_neighbors.host_rebuilds,
        "device_builds": model.device_neighbors.n_builds,
    }
    if dp:
        out["calls"] = runner.stats.calls
        out["rebuilds"] = runner.stats.rebuilds
        out["last_drop"] = dyn.graphs.last_drop
        out["tags"] = _tags(counters)
        runner.close()
    return out


def _tags(counters: list[tuple[int, int, int, int]]) -> list[tuple[int, str]]:
    """Each step's kind from the counters after it: ``R`` rebuilt the halo, ``C``
    captured, ``G`` replayed, ``E`` eager."""
    tags, before = [], (0, 0, 0)
    for step, *after in counters:
        r, c, g = (a != b for a, b in zip(after, before, strict=True))
        tags.append((step, "R" if r else "C" if c else "G" if g else "E"))
        before = tuple(after)  # type: ignore[assignment]
    return tags


def _assert_same(a: dict[str, Any], b: dict[str, Any], *, exact: bool = False) -> None:
    for key in ("positions", "velocities", "forces", "energy", "cell"):
        if exact:  # a replay reruns the eager step's operations in the same order
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-13, atol=1e-13, msg=key)


@pytest.mark.parametrize("kind", ["periodic", "triclinic", "cluster"])
def test_replayed_steps_equal_eager_steps(kind: str) -> None:
    batch = _hot(kind)
    eager = _trajectory(batch, 60, graphs=False)
    graphed = _trajectory(batch, 60, graphs=True)
    _assert_same(graphed, eager)
    assert eager["captures"] == 0
    assert graphed["captures"] == 1 and graphed["replays"] == 60 - WARMUP_STEPS
    # the list was rebuilt on the device during replays, never on the host after the first
    assert graphed["device_builds"] == eager["device_builds"] > 1
    assert graphed["host_rebuilds"] == 1


def test_replayed_langevin_steps_equal_eager_steps() -> None:
    batch = _hot()
    eager = _trajectory(batch, 40, graphs=False, hooks=True, integrator="langevin")
    graphed = _trajectory(batch, 40, graphs=True, hooks=True, integrator="langevin")
    _assert_same(graphed, eager)
    assert graphed["seen"] == eager["seen"] != [] and graphed["replays"] > 25


def test_hooks_around_replays_and_eager_steps_inside() -> None:
    batch = _hot()
    eager = _trajectory(batch, 60, graphs=False, hooks=True)
    graphed = _trajectory(batch, 60, graphs=True, hooks=True)
    _assert_same(graphed, eager)
    assert graphed["seen"] == eager["seen"] != []
    # steps 25 and 50 ran eagerly (a hook inside the step), then the run captured again
    assert graphed["captures"] == 3 and graphed["drops"] == 2


def test_a_list_that_must_grow_drops_the_graph_and_grows_on_the_host() -> None:
    batch = _hot()
    eager = _trajectory(batch, 40, graphs=False, squeeze_at=20)
    graphed = _trajectory(batch, 40, graphs=True, squeeze_at=20)
    _assert_same(graphed, eager)
    assert graphed["host_rebuilds"] == eager["host_rebuilds"] == 2
    assert graphed["drops"] == 1 and graphed["captures"] == 2


def test_non_finite_values_in_a_replayed_step_raise() -> None:
    dyn = VelocityVerlet(lj_model(), _hot(), dt_fs=2.0, cuda_graphs=True)

    def poison(ctx: Any) -> None:
        if ctx.step == 10:
            ctx.batch.velocities[3, 0] = float("nan")

    dyn.register_hook(HookStage.BEFORE_STEP, poison)
    with emulated_capture(), pytest.raises(ValidationError, match="NaN or infinite"):
        dyn.run(30)
    assert dyn.graphs.captures == 1 and not dyn.graphs.active


def _dp_case(graphs: bool, integrator: str = "nve") -> dict[str, Any]:
    return _trajectory(_hot(), 50, graphs=graphs, dp=True, hooks=True, integrator=integrator)


@pytest.mark.parametrize("integrator", ["nve", "nvt-nh", "npt"])
def test_domain_parallel_on_one_rank_replays_the_whole_batch_step(integrator: str) -> None:
    """A world of one runs the model on the whole batch: its steps are captured
    with the integrator's reduction (an all-reduce of one rank) inside, for
    NVT-NH's chain and NPT's chains and cell too."""
    (eager,) = run_ranks(_dp_case, 1, False, integrator)
    (graphed,) = run_ranks(_dp_case, 1, True, integrator)
    _assert_same(graphed, eager)
    assert graphed["seen"] == eager["seen"] != []
    assert graphed["captures"] >= 1 and graphed["replays"] > 30
    assert graphed["calls"] == eager["calls"]  # replays count their force calls


def _dp_halo(
    graphs: bool, halo_on_one_rank: bool = False, integrator: str = "nve"
) -> dict[str, Any]:
    return _trajectory(
        _hot(), 60, graphs=graphs, dp=True, hooks=True, halo_on_one_rank=halo_on_one_rank,
        integrator=integrator,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("ranks", "one", "integrator"),
    [
        (2, False, "nve"),
        (3, False, "nve"),
        (1, True, "nve"),
        (2, False, "langevin"),
        (2, False, "nvt-nh"),
        (2, False, "npt"),
    ],
    ids=[
        "2-ranks",
        "3-ranks",
        "halo-on-1-rank",
        "2-ranks-langevin",
        "2-ranks-nvt-nh",
        "2-ranks-npt",
    ],
)
def test_domain_parallel_halo_steps_are_replayed_and_equal_eager_steps(
    ranks: int, one: bool, integrator: str
) -> None:
    """The halo path of several ranks captures a steady step as two graphs
    around its rebuild decision (``StepGraphs``: head, decision, tail); a
    decision that says "rebuild" runs the rest of the step eagerly. On CPU the
    emulation replays exactly what a CUDA graph would: the same trajectory as
    eager steps bit for bit, the same rebuilds at the same steps, hooks seen
    alike."""
    eager = run_ranks(_dp_halo, ranks, False, one, integrator)
    graphed = run_ranks(_dp_halo, ranks, True, one, integrator)
    for rank, (g, e) in enumerate(zip(graphed, eager, strict=True)):
        _assert_same(g, e, exact=True)
        assert g["seen"] == e["seen"] != [], rank
        assert g["calls"] == e["calls"], rank  # replays count their force calls
        assert g["rebuilds"] == e["rebuilds"] > 2, rank  # rebuilds happened between captures
        assert e["captures"] == 0 and g["captures"] >= 2, rank
        assert g["replays"] > 15, (rank, g["replays"])
        assert g["drops"] >= 1, rank
        # Eager steps only where a step cannot be captured: the first steps, and
        # the hook inside the step (every 25) with the warm-up after it (and after
        # an eager step that rebuilt in that warm-up). Not
        # after a rebuild decided by a replay (its step ran the new plan once:
        # the next step is captured at once), nor after the energy hook (every
        # 7: it totals the energy into the batch, whose values a replay takes).
        eager = [step for step, tag in g["tags"] if tag == "E"]
        near_hook = [s for s in eager if s <= 1 + WARMUP_STEPS or 0 < s % 25 <= 3 + WARMUP_STEPS]
        assert eager == near_hook, (rank, eager, "".join(tag for _, tag in g["tags"]))
        assert "RC" in "".join(tag for _, tag in g["tags"]), rank


def _poisoned_halo_run() -> dict[str, Any]:
    """Two ranks replaying halo steps; rank 1 alone gets a NaN velocity at step
    20 (between replays). Returns what each rank raised."""
    model = lj_model()
    batch = _hot()
    dyn = VelocityVerlet(model, batch.clone(), dt_fs=2.0, cuda_graphs=True)

    def poison(ctx: Any) -> None:
        if ctx.step == 20 and ctx.rank == 1:
            ctx.batch.velocities[0, 0] = float("nan")

    dyn.register_hook(HookStage.BEFORE_STEP, poison)
    runner = DomainParallel(dyn, DomainConfig(cutoff=model.cutoff, skin=0.5))
    runner.partition(batch)
    replays = 0
    try:
        with emulated_capture():
            runner.run(10)
            replays = dyn.graphs.replays
            runner.run(30)
    except ValidationError as exc:
        return {"raised": str(exc), "replays_before": replays, "active": dyn.graphs.active}
    finally:
        runner.close()
    return {"raised": None, "replays_before": replays, "active": dyn.graphs.active}


def test_a_non_finite_value_on_one_rank_raises_on_every_rank_from_a_replay() -> None:
    """The decision read between the head and the tail carries the non-finite
    flag of every rank: both ranks raise at the same step, none is left waiting
    in a collective, and the graphs are dropped."""
    for rank, out in enumerate(run_ranks(_poisoned_halo_run, 2, timeout_s=300)):
        assert out["replays_before"] > 0, rank  # the poison lands between replays
        assert out["raised"] is not None and "non-finite" in out["raised"], (rank, out)
        assert "rank 1" in out["raised"], (rank, out["raised"])
        assert not out["active"], rank


# ------------------------------------------------------------- on a GPU
#: Differences a replayed run may show beyond those between two eager runs.
_FLOOR = {torch.float64: 1e-9, torch.float32: 1e-4}


def _within_eager_noise(kw: dict[str, Any], device: str, dtype: torch.dtype) -> dict[str, Any]:
    """A replayed run against an eager one, within 10x the difference between two
    eager runs plus a floor: on a GPU the half list's atomics sum in a varying
    order, so even eager runs differ, and a hot system amplifies that."""
    batch = _hot()
    eager = _trajectory(batch, 60, graphs=False, device=device, dtype=dtype, **kw)
    again = _trajectory(batch, 60, graphs=False, device=device, dtype=dtype, **kw)
    graphed = _trajectory(batch, 60, graphs=True, device=device, dtype=dtype, **kw)
    for key in ("positions", "velocities", "forces", "energy", "cell"):
        noise = float((again[key] - eager[key]).abs().max())
        diff = float((graphed[key] - eager[key]).abs().max())
        assert diff <= 10.0 * noise + _FLOOR[dtype], (kw, key, diff, noise)
    assert graphed["replays"] > 30, kw
    assert graphed["host_rebuilds"] == eager["host_rebuilds"], kw
    assert graphed["device_builds"] > 1, kw
    return graphed


_GPU_CASES: list[dict[str, Any]] = [
    {},
    {"hooks": True},
    {"squeeze_at": 20},
    {"integrator": "langevin"},
    {"integrator": "nvt-nh", "hooks": True},
    {"integrator": "npt", "hooks": True},
]


@pytest.mark.parametrize("integrator", ["langevin", "nvt-nh", "npt"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_the_gpu_comparison_runs_on_the_cpu_emulation(dtype: torch.dtype, integrator: str) -> None:
    """The check the GPU test makes, on CPU (where eager runs agree exactly), in
    both dtypes (a float32 model and batch through the captured step)."""
    out = _within_eager_noise({"integrator": integrator, "hooks": True}, "cpu", dtype)
    assert out["positions"].dtype == dtype


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_cuda_graph_replays_equal_eager_steps_on_a_gpu(dtype: torch.dtype) -> None:
    for kw in _GPU_CASES:
        _within_eager_noise(kw, "cuda", dtype)


def _close(dtype: torch.dtype) -> dict[str, float]:
    # eager runs differ from each other by the atomics' summation order too
    return {"rtol": 1e-9, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 2e-4, "atol": 2e-4}


@pytest.mark.gpu
def test_non_finite_values_in_a_cuda_graph_replay_raise() -> None:
    dyn = VelocityVerlet(lj_model().to("cuda"), _hot().to("cuda"), dt_fs=2.0, cuda_graphs=True)

    def poison(ctx: Any) -> None:
        if ctx.step == 10:
            ctx.batch.velocities[3, 0] = float("nan")

    dyn.register_hook(HookStage.BEFORE_STEP, poison)
    with pytest.raises(ValidationError, match="NaN or infinite"):
        dyn.run(200)
    assert dyn.graphs.captures == 1


def _dp_cuda(
    graphs: bool, halo_on_one_rank: bool = False, integrator: str = "nve"
) -> dict[str, Any]:
    out = _trajectory(
        _hot(), 50, graphs=graphs, dp=True, hooks=True, device="cuda",
        halo_on_one_rank=halo_on_one_rank, integrator=integrator,
    )  # fmt: skip
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("integrator", ["nve", "npt"])
def test_domain_parallel_on_one_gpu_replays_the_whole_batch_step(integrator: str) -> None:
    args = (False, integrator)
    (eager,) = run_ranks(_dp_cuda, 1, False, *args, backend="nccl", start_method="spawn")
    (graphed,) = run_ranks(_dp_cuda, 1, True, *args, backend="nccl", start_method="spawn")
    for key in ("positions", "velocities", "forces", "energy", "cell"):
        torch.testing.assert_close(graphed[key], eager[key], **_close(torch.float64), msg=key)
    assert graphed["replays"] > 30 and graphed["calls"] == eager["calls"]


@pytest.mark.gpu
@pytest.mark.parametrize("integrator", ["nve", "nvt-nh", "npt"])
def test_domain_parallel_halo_steps_on_one_gpu_are_replayed(integrator: str) -> None:
    """The split capture (head, decision, tail) as real CUDA graphs: the halo path
    forced on one GPU (NCCL world of one: the exchanges are local copies; the
    collectives of two GPUs are left to the NCCL suite). NVT-NH: its reduction
    and chain kernel inside the graphs."""
    args = (True, integrator)
    (eager,) = run_ranks(_dp_cuda, 1, False, *args, backend="nccl", start_method="spawn")
    (graphed,) = run_ranks(_dp_cuda, 1, True, *args, backend="nccl", start_method="spawn")
    for key in ("positions", "velocities", "forces", "energy", "cell"):
        torch.testing.assert_close(graphed[key], eager[key], **_close(torch.float64), msg=key)
    assert graphed["calls"] == eager["calls"] and graphed["rebuilds"] == eager["rebuilds"] > 2
    assert graphed["replays"] > 10 and graphed["captures"] >= 2


@pytest.mark.multigpu
def test_domain_parallel_halo_steps_on_two_gpus_are_replayed() -> None:
    """The split capture on two GPUs: the exchange and fold are NCCL collectives
    recorded inside the tail graph, the decision's all-reduce inside the head."""
    eager = run_ranks(_dp_cuda, 2, False, backend="nccl", start_method="spawn")
    graphed = run_ranks(_dp_cuda, 2, True, backend="nccl", start_method="spawn")
    for rank, (g, e) in enumerate(zip(graphed, eager, strict=True)):
        for key in ("positions", "velocities", "forces", "energy"):
            torch.testing.assert_close(g[key], e[key], **_close(torch.float64), msg=(rank, key))
        assert g["calls"] == e["calls"] and g["rebuilds"] == e["rebuilds"] > 2, rank
        assert g["replays"] > 10 and g["captures"] >= 2, rank
