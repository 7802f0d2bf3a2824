"""`StepGraphs`: which steps are captured, what a replay reads, when a graph goes.

On CPU through ``nvdd.core.emulated_capture`` (a replay reruns the recorded
operations on the recorded tensors, as a CUDA graph does); the real model and
the GPU runs are in ``integration_tests/test_it_cuda_graphs.py``.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Hashable
from typing import Any

import pytest
import torch

import nvdd.dynamics
import nvdd.models
from nvdd.core import Batch, CaptureError, ModelOutputs, after_replay, capturing, emulated_capture
from nvdd.dynamics import (
    CUDA_GRAPHS_ENV,
    FIRE,
    WARMUP_STEPS,
    HookStage,
    Langevin,
    NoseHooverNVT,
    VelocityVerlet,
    atom_normal,
    cuda_graphs_default,
)


class Springs(torch.nn.Module):
    """F = -k (x - x0), with per-atom energies; capturable when ``capturable``."""

    def __init__(self, k: float = 0.7, capturable: bool = True, host_read: bool = False) -> None:
        super().__init__()
        self.k, self.capturable, self.host_read = k, capturable, host_read
        self.anchor: torch.Tensor | None = None
        self.calls = 0
        self.replayed = 0
        self.fits = True

    def graph_key(self, batch: Batch) -> Hashable | None:
        return ("springs", self.k) if self.capturable else None

    def forward(self, batch: Batch) -> ModelOutputs:
        if self.anchor is None:
            self.anchor = batch.positions.detach().clone()
        if capturing():
            after_replay(self._replayed)
        else:
            self.calls += 1
        d = batch.positions - self.anchor
        if self.host_read:
            float(d.sum())
        e_atom = 0.5 * self.k * (d * d).sum(dim=1)
        return {"forces": -self.k * d, "energy": e_atom.sum().reshape(1), "atom_energies": e_atom}

    def _replayed(self) -> bool:
        self.calls += 1
        self.replayed += 1
        return self.fits


def _batch(n: int = 12, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(
        positions=torch.rand(n, 3, generator=g, dtype=torch.float64) * 5.0,
        atomic_numbers=torch.full((n,), 18),
        velocities=torch.randn(n, 3, generator=g, dtype=torch.float64) * 0.05,
        cell=torch.eye(3, dtype=torch.float64) * 5.0,
        pbc=[False] * 3,
    )


def _run(graphs: bool, steps: int = 20, setup: Any = None, **model_kw: Any) -> tuple[Any, Springs]:
    model = Springs(**model_kw)
    dyn = VelocityVerlet(model, _batch(), dt_fs=1.5, cuda_graphs=graphs)
    if setup is not None:
        setup(dyn)
    with emulated_capture():
        dyn.run(steps)
    return dyn, model


def _assert_same(a: Any, b: Any) -> None:
    for name in ("positions", "velocities", "forces", "energy"):
        assert torch.equal(getattr(a.batch, name), getattr(b.batch, name)), name
    assert torch.equal(a.batch.atom_extras["atom_energies"], b.batch.atom_extras["atom_energies"])


def test_steady_steps_are_replayed_and_equal_eager_steps() -> None:
    eager, m0 = _run(False)
    graphed, m1 = _run(True)
    _assert_same(graphed, eager)
    assert eager.graphs.captures == 0 and graphed.graphs.captures == 1
    assert graphed.graphs.replays == 20 - WARMUP_STEPS and graphed.graphs.active
    assert m1.replayed == 20 - WARMUP_STEPS and m1.calls == m0.calls == 21
    # the integrator's outputs are those of the last replay, not of the capture
    for key in ("forces", "energy", "atom_energies"):
        assert torch.equal(graphed.outputs[key], eager.outputs[key]), key
    torch.testing.assert_close(graphed.outputs["forces"], graphed.batch.forces)


def test_nothing_is_captured_unless_every_part_opts_in() -> None:
    assert _run(True, capturable=False)[0].graphs.captures == 0  # the model
    dyn = _HostDecides(Springs(), _batch())  # the integrator
    with emulated_capture():
        dyn.run(6)
    assert dyn.graphs.captures == 0
    dyn = VelocityVerlet(Springs(), _batch())  # and the CPU without the emulation
    dyn.graphs.enabled = True
    dyn.run(6)
    assert dyn.graphs.captures == 0


class _HostDecides(VelocityVerlet):
    """An integrator that does not opt in (its steps would decide on the host)."""

    def graph_key(self) -> Hashable | None:
        return None


def _fire(graphs: bool, steps: int, device: str = "cpu") -> tuple[FIRE, list[tuple[float, int]]]:
    """FIRE in harmonic wells away from the start; at step 30 a hook reverses the
    velocities (uphill: the state resets inside a replayed run). Returns the
    integrator and its ``(dt_fs, n_positive)`` after every step. On the CPU the
    capture is emulated; on CUDA it is a CUDA graph."""
    b = _batch().to(device)
    model = Springs()  # minima away from the start, each atom its own well
    shift = torch.linspace(-0.4, 0.4, 3 * b.n_atoms, dtype=b.dtype, device=b.device)
    model.anchor = b.positions + shift.reshape(-1, 3)
    dyn = FIRE(model, b.replace(velocities=b.velocities * 0), dt_fs=0.5, fmax=1e-9,
               dt_max_fs=2.0, n_min=2, cuda_graphs=graphs)  # fmt: skip
    seen: list[tuple[float, int]] = []

    def reverse(ctx: Any) -> None:  # a new tensor: the replay copies it in
        if ctx.step == 30:
            dyn.batch = dyn.batch.replace(velocities=-dyn.batch.velocities)

    dyn.register_hook(HookStage.BEFORE_STEP, reverse)
    dyn.register_hook(HookStage.AFTER_STEP, lambda ctx: seen.append((dyn.dt_fs, dyn.n_positive)))
    if device == "cpu":
        with emulated_capture():
            dyn.run(steps)
    else:
        dyn.run(steps)
    return dyn, seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fire_steps_are_replayed_and_equal_eager_steps(device: str) -> None:
    """FIRE's adaptive state lives on the device: its steady steps replay, with
    the time step growing to its cap and an uphill step resetting it, bit for bit
    as eager steps."""
    (eager, e_seen), (graphed, g_seen) = _fire(False, 40, device), _fire(True, 40, device)
    assert graphed.graphs.captures == 1 and graphed.graphs.replays >= 35
    for name in ("positions", "velocities", "forces"):
        assert torch.equal(getattr(graphed.batch, name), getattr(eager.batch, name)), name
    assert g_seen == e_seen
    assert e_seen[0] == (0.25, 0)  # zero velocities: no power, the step halves
    assert (2.0, 25) in e_seen  # grown to dt_max_fs after n_min steps downhill
    assert e_seen[30] == (1.0, 0)  # the reversed velocities: uphill, halved, reset
    assert graphed.step_count == eager.step_count == 40
    state = torch.tensor(eager.state_arrays()["fire"])
    assert state.tolist() == [eager.dt_fs, eager.alpha, float(eager.n_positive)]


def test_fire_state_round_trips_through_state_arrays() -> None:
    a, _ = _fire(False, 12)
    b, _ = _fire(False, 0)
    b.load_state_arrays(a.state_arrays())
    assert (b.dt_fs, b.alpha, b.n_positive) == (a.dt_fs, a.alpha, a.n_positive)
    b.dt_fs, b.alpha, b.n_positive = 0.25, 0.05, 3  # (what an older checkpoint sets)
    assert (b.dt_fs, b.alpha, b.n_positive) == (0.25, 0.05, 3)


def test_the_environment_sets_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUDA_GRAPHS_ENV, "0")
    assert not cuda_graphs_default()
    assert not VelocityVerlet(Springs(), _batch()).graphs.enabled
    monkeypatch.setenv(CUDA_GRAPHS_ENV, "1")
    assert VelocityVerlet(Springs(), _batch()).graphs.enabled


def _kick(dyn: Any) -> None:
    def kick(ctx: Any) -> None:  # a new tensor (not in place), as a user may write
        if ctx.step % 5 == 0:
            dyn.batch = dyn.batch.replace(velocities=dyn.batch.velocities * 0.5)

    dyn.register_hook(HookStage.BEFORE_STEP, kick)


def _heavier(dyn: Any) -> None:
    def heavier(ctx: Any) -> None:  # structural: the graph read the old masses
        if ctx.step == 8:
            dyn.batch = dyn.batch.replace(masses=dyn.batch.masses * 2.0)

    dyn.register_hook(HookStage.BEFORE_STEP, heavier)


def _faster(dyn: Any) -> None:
    def faster(ctx: Any) -> None:  # the time step is baked into the graph
        if ctx.step == 9:
            dyn.dt_fs = 0.5

    dyn.register_hook(HookStage.AFTER_STEP, faster)


def _inside(dyn: Any) -> None:  # a hook inside the step: that step runs eagerly
    dyn.register_hook(HookStage.AFTER_COMPUTE, lambda ctx: None, every=6)


@pytest.mark.parametrize(
    ("setup", "captures", "drops"),
    [
        (_kick, 1, 0),  # values replaced between steps are copied in
        (_heavier, 2, 1),
        (_faster, 2, 1),
        (_inside, 3, 3),  # eager at 0, 6, 12, 18; a capture after each warm-up
    ],
    ids=["values-copied-in", "masses-drop", "time-step-drops", "hook-inside-eager"],
)
def test_changes_between_steps(setup: Any, captures: int, drops: int) -> None:
    eager, _ = _run(False, setup=setup)
    graphed, _ = _run(True, setup=setup)
    _assert_same(graphed, eager)
    assert (graphed.graphs.captures, graphed.graphs.drops) == (captures, drops)


def test_langevin_steps_are_replayed_with_each_steps_own_noise() -> None:
    """The noise is a function of (seed, step, atom id): a replay reads the step
    from a device counter that the captured step advances."""

    def run(graphs: bool) -> Any:
        dyn = Langevin(Springs(), _batch(), dt_fs=1.5, temperature_K=300.0, cuda_graphs=graphs)
        dyn.register_hook(HookStage.AFTER_COMPUTE, lambda ctx: None, every=9)  # eager steps too
        with emulated_capture():
            dyn.run(25)
        return dyn

    eager, graphed = run(False), run(True)
    _assert_same(graphed, eager)
    assert graphed.graphs.captures == 3 and graphed.graphs.replays > 10


def test_nose_hoover_steps_are_replayed_with_the_chain_on_the_device() -> None:
    """NVT-NH's chain (a Warp launch per half step), its reduction and the
    velocity scaling are captured: replays equal eager steps bit for bit, the
    conserved energy included, and a replayed step reads nothing on the host."""

    def run(graphs: bool) -> Any:
        dyn = NoseHooverNVT(
            Springs(), _batch(), dt_fs=1.5, temperature_K=300.0, tau_fs=15.0, cuda_graphs=graphs
        )
        dyn.register_hook(HookStage.AFTER_COMPUTE, lambda ctx: None, every=11)  # eager steps too
        with emulated_capture():
            dyn.run(30)
        return dyn

    eager, graphed = run(False), run(True)
    _assert_same(graphed, eager)
    assert torch.equal(graphed.conserved_energy(), eager.conserved_energy())
    assert graphed.graphs.captures == 3 and graphed.graphs.replays > 15
    assert eager.chain is not None and graphed.chain is not None
    assert torch.equal(graphed.chain.p_xi, eager.chain.p_xi)
    assert float(eager.chain.p_xi.abs().sum()) > 0  # the thermostat did work


def test_a_step_count_set_by_hand_drops_the_graph() -> None:
    """Langevin's replays read the step from the device: a host-side jump must
    not be missed (a restart, a user resetting the count)."""

    def run(graphs: bool) -> Any:
        dyn = Langevin(Springs(), _batch(), dt_fs=1.5, temperature_K=300.0, cuda_graphs=graphs)

        def jump(ctx: Any) -> None:
            if ctx.step == 10:
                dyn.step_count = 100

        dyn.register_hook(HookStage.AFTER_STEP, jump)
        with emulated_capture():
            dyn.run(20)
        return dyn

    eager, graphed = run(False), run(True)
    _assert_same(graphed, eager)
    assert graphed.graphs.drops == 1 and "step count" in (graphed.graphs.last_drop or "")


def test_the_noise_of_a_step_tensor_equals_the_noise_of_a_step_number() -> None:
    ids = torch.tensor([0, 1, 7, 2**40 + 3])
    for step in (0, 1, 12345, 2**31 + 7, 2**33 + 1):
        want = atom_normal(9, step, ids, dtype=torch.float64)
        got = atom_normal(9, torch.tensor(step), ids, dtype=torch.float64)
        assert torch.equal(got, want), step


def test_a_component_can_ask_for_an_eager_step() -> None:
    dyn = VelocityVerlet(Springs(), _batch(), cuda_graphs=True)
    with emulated_capture():
        dyn.run(5)
        assert dyn.graphs.active
        dyn.model.fits = False  # e.g. a neighbour list that must grow
        dyn.run(1)
        assert not dyn.graphs.active and dyn.graphs.drops == 1
        assert "eager" in (dyn.graphs.last_drop or "")


def test_a_capture_that_reads_the_host_raises_under_the_emulation() -> None:
    with pytest.raises(CaptureError, match="host"):
        _run(True, host_read=True)


class SplitProvider:
    """A force provider that decides on the host, per step, whether to "rebuild"
    (re-anchor a reference when an atom moved more than ``reach``), the way the
    halo path of ``DistributedModel`` decides migrations: ``splits_step`` with
    ``begin_step`` (the decision queued on the device) and ``take_verdict``."""

    splits_step = True

    def __init__(self, model: Springs, reach: float = 0.05, poison_at: int = -1) -> None:
        self.model, self.reach, self.poison_at = model, reach, poison_at
        self.ref: torch.Tensor | None = None
        self.version = 0
        self.code: torch.Tensor | None = None
        self.decided: bool | None = None
        self.rebuilds = 0
        self.verdicts = 0

    def graph_key(self, batch: Batch) -> Hashable | None:
        return None if self.ref is None else ("split", self.version)

    def _code(self, batch: Batch) -> torch.Tensor:
        if self.ref is None:
            return torch.ones((), dtype=torch.int32)
        moved = ((batch.positions - self.ref).abs().amax() > self.reach).to(torch.int32)
        bad = (~torch.isfinite(batch.positions).all()).to(torch.int32)
        return torch.where(bad == 0, moved, torch.full_like(moved, 2))

    def begin_step(self, batch: Batch) -> None:
        self.code = self._code(batch)

    def take_verdict(self, batch: Batch) -> bool:
        assert self.code is not None
        self.verdicts += 1
        code = int(self.code)
        if code == 2 or self.verdicts == self.poison_at:
            raise ValueError("non-finite positions")
        self.decided = code == 1
        return not self.decided

    def __call__(self, batch: Batch) -> tuple[Batch, ModelOutputs]:
        rebuild, self.decided = self.decided, None
        if rebuild is None:
            rebuild = bool(int(self._code(batch)))
        if rebuild:
            if capturing():
                raise CaptureError("a rebuild inside a capture")
            self.ref = batch.positions.detach().clone()
            self.version += 1
            self.rebuilds += 1
        if capturing():
            after_replay(self._replayed)
        return batch, self.model(batch)

    def _replayed(self) -> bool:
        self.decided = None
        return True


def _run_split(graphs: bool, steps: int = 60, **kw: Any) -> tuple[Any, SplitProvider]:
    dyn = VelocityVerlet(Springs(k=2.0), _batch(seed=3), dt_fs=1.5, cuda_graphs=graphs)
    provider = SplitProvider(dyn.model, **kw)
    dyn.force_provider = provider
    with emulated_capture():
        dyn.run(steps)
    return dyn, provider


def test_a_split_step_replays_head_and_tail_and_rebuilds_eagerly() -> None:
    """A provider with ``splits_step``: the head (pre_update, the decision) and
    the tail (compute, post_update) are two graphs; a decision that says
    "rebuild" after a replayed head runs the rest of the step eagerly and drops
    both graphs; the trajectory equals the eager one bit for bit."""
    eager, p0 = _run_split(False)
    graphed, p1 = _run_split(True)
    _assert_same(graphed, eager)
    assert p1.rebuilds == p0.rebuilds > 3  # rebuilt at the same steps
    assert graphed.graphs.captures >= 3 and graphed.graphs.replays > 10
    assert graphed.graphs.drops >= 2
    assert p0.verdicts == 0 and p1.verdicts > graphed.graphs.replays


def test_a_split_decision_that_raises_drops_the_graphs() -> None:
    """A decision that raises after a replayed head (e.g. non-finite values)
    propagates and drops both graphs."""
    dyn = VelocityVerlet(Springs(k=2.0), _batch(seed=3), dt_fs=1.5, cuda_graphs=True)
    dyn.force_provider = SplitProvider(dyn.model, poison_at=12)
    with emulated_capture(), pytest.raises(ValueError, match="non-finite"):
        dyn.run(60)
    assert dyn.graphs.replays > 0  # the 12th decision came after replays
    assert not dyn.graphs.active and "decision raised" in (dyn.graphs.last_drop or "")


def test_each_role_recaptures_into_its_own_kept_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every head (or whole step) is captured into one memory pool and every
    tail into another, both kept across rebuilds; a graph is captured into a
    pool only once the previous graph of that role is no longer held (so no two
    replayable graphs share memory)."""
    import sys

    import nvdd.dynamics._graph_step as graph_step

    made: list[tuple[str, Any]] = []
    holders: list[Any] = []
    real = graph_step.make_step_graph

    def recording(device: torch.device, pool: Any = None) -> Any:
        graphs = holders[0]
        caller = sys._getframe(1).f_code.co_name  # run_step: a head; _capture_split: a tail
        role = "tail" if caller == "_capture_split" else "head"
        held = graphs._tail if role == "tail" else graphs._graph
        assert held is None, f"a {role} graph was captured while the last one is held"
        made.append((role, pool))
        return real(device, pool)

    monkeypatch.setattr(graph_step, "make_step_graph", recording)
    dyn = VelocityVerlet(Springs(k=2.0), _batch(seed=3), dt_fs=1.5, cuda_graphs=True)
    holders.append(dyn.graphs)
    dyn.force_provider = SplitProvider(dyn.model)
    with emulated_capture():
        dyn.run(60)
    assert dyn.graphs.drops >= 2
    pools = {role: {id(p) for r, p in made if r == role} for role in ("head", "tail")}
    count = {role: sum(r == role for r, _ in made) for role in ("head", "tail")}
    assert count["head"] >= 3 and count["tail"] >= 2, made
    assert len(pools["head"]) == 1 and len(pools["tail"]) == 1
    assert pools["head"] != pools["tail"]
    assert all(p is not None and p.device == dyn.batch.device for _, p in made)
    # a drop that releases (DomainParallel.close) lets the pools go: the next
    # captures get new ones
    before = len(made)
    dyn.graphs.drop("the run is over", release=True)
    with emulated_capture():
        dyn.run(30)
    later = {id(p) for _, p in made[before:]}
    assert later and not later & (pools["head"] | pools["tail"])


#: What a provider declares of capture (``_step.CapturableSteps``).
_CAPTURE = frozenset({"graph_key", "splits_step", "begin_step", "take_verdict"})
#: The phases of a provider (generic names: checked in the runtime's modules only).
_PHASE_NAMES = frozenset({"open", "decide", "rebuild", "exchange", "forward", "fold", "close"})
#: nvdd-dynamics' validation tooling inspects models' modules on purpose.
_TOOLING = {"_validate.py", "_probe.py", "_diagnose.py", "_verify.py", "_spec_report.py"}


def _probes(path: pathlib.Path, names: frozenset[str]) -> list[str]:
    """``getattr`` / ``hasattr`` calls in ``path`` whose name is a literal of ``names``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) > 1
            and any(
                isinstance(c, ast.Constant) and c.value in names for c in ast.walk(node.args[1])
            )
        ):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_capture_reads_what_a_provider_declares_never_probes_it() -> None:
    """No ``getattr`` / ``hasattr`` of a capture capability by name in
    nvdd-dynamics or nvdd-models, nor of a phase in the runtime's modules: the
    step module calls what ``PhasedProvider`` and ``CapturableSteps`` declare
    (mypy checks the calls), and a one-call provider is asked once, when it is
    wrapped (``isinstance``)."""
    found = []
    runtime = pathlib.Path(nvdd.dynamics.__file__).parent
    for path in sorted(runtime.glob("*.py")):
        if path.name not in _TOOLING:
            found += _probes(path, _CAPTURE | _PHASE_NAMES)
    for path in sorted(pathlib.Path(nvdd.models.__file__).parent.glob("*.py")):
        found += _probes(path, _CAPTURE)
    assert found == []


def test_a_one_call_provider_is_captured_only_when_it_declares_capture() -> None:
    """A one-call provider without ``CapturableSteps`` runs every step eagerly;
    the same provider declaring it (``graph_key`` and the split) is captured."""

    class Plain:
        def __init__(self, model: Springs) -> None:
            self.model = model

        def __call__(self, batch: Batch) -> tuple[Batch, ModelOutputs]:
            return batch, self.model(batch)

    dyn = VelocityVerlet(Springs(), _batch(), cuda_graphs=True)
    dyn.force_provider = Plain(dyn.model)
    assert not dyn.force_provider.splits_step and dyn.force_provider.take_verdict(dyn.batch)
    with emulated_capture():
        dyn.run(8)
    assert dyn.graphs.captures == 0 and dyn.graphs.last_drop is None
    graphed, _ = _run_split(True, steps=8)
    assert graphed.force_provider.splits_step and graphed.graphs.captures >= 1


#: What a force provider does in a step: its phases and its declared decision.
_PHASES = frozenset(
    {"open", "decide", "rebuild", "exchange", "forward", "fold", "close"}
    | {"begin_step", "take_verdict"}
)


def _watched_run(halo: bool) -> tuple[Any, list[list[tuple[str, str, bool]]], set[str]]:
    """A DomainParallel LJ run on a world of one under the capture emulation.
    Returns its graph counters, the stack of every capture (module, function,
    whether the frame is a provider's method) and who called a provider's phases."""
    import sys

    import nvdd.dynamics._graph_step as graph_step
    from nvdd.core import shutdown_distributed
    from nvdd.dynamics import DomainConfig, DomainParallel, ModelForceProvider
    from nvdd.dynamics._provider import ProviderBase
    from nvdd.models import LennardJones, LJConfig

    providers = (ProviderBase, ModelForceProvider)
    stacks: list[list[tuple[str, str, bool]]] = []
    callers: set[str] = set()

    def stack() -> list[tuple[str, str, bool]]:
        out, f = [], sys._getframe(2)
        while f is not None:
            here = isinstance(f.f_locals.get("self"), providers)
            out.append((str(f.f_globals.get("__name__")), f.f_code.co_name, here))
            f = f.f_back
        return out

    class Watched:
        def __init__(self, graph: Any) -> None:
            self.graph, self.executes_on_capture = graph, graph.executes_on_capture

        def capture(self, body: Any) -> Any:
            stacks.append(stack())
            return self.graph.capture(body)

        def replay(self) -> None:
            self.graph.replay()

    real = graph_step.make_step_graph

    def make(device: torch.device, pool: Any = None) -> Any:
        graph = real(device, pool)
        return None if graph is None else Watched(graph)

    def profile(frame: Any, event: str, arg: Any) -> None:
        phase = event == "call" and frame.f_code.co_name in _PHASES
        if phase and isinstance(frame.f_locals.get("self"), providers):
            callers.add(str(frame.f_back.f_globals.get("__name__")))

    g = torch.Generator().manual_seed(0)
    axes = (torch.arange(5), torch.arange(4), torch.arange(4))
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3).double() * 1.4
    crystal = Batch(  # a cold LJ crystal: steady steps (one plan) from the start
        positions=grid + 0.02 * torch.randn(grid.shape, generator=g, dtype=torch.float64),
        atomic_numbers=torch.full((grid.shape[0],), 18),
        velocities=torch.randn(grid.shape, generator=g, dtype=torch.float64) * 0.002,
        cell=torch.diag(torch.tensor([7.0, 5.6, 5.6], dtype=torch.float64)),
        pbc=[True, True, True],
    )
    model = LennardJones(LJConfig(cutoff=2.5, epsilon=0.02, sigma=1.05))
    dyn = VelocityVerlet(model, crystal, dt_fs=1.0, cuda_graphs=True)
    config = DomainConfig(cutoff=2.5, skin=0.3, halo_on_one_rank=halo)
    dp = DomainParallel(dyn, config, watchdog_s=0)
    graph_step.make_step_graph = make  # type: ignore[assignment]
    try:
        dp.partition()
        with emulated_capture():
            sys.setprofile(profile)
            try:
                dp.run(12)
            finally:
                sys.setprofile(None)
        counters = (dyn.graphs.captures, dyn.graphs.replays, dp.model.splits_step)
    finally:
        graph_step.make_step_graph = real  # type: ignore[assignment]
        dp.close()
        shutdown_distributed()  # the world of one this process created
    return counters, stacks, callers


@pytest.mark.parametrize("halo", [False, True], ids=["whole-batch", "halo-split"])
def test_the_step_captures_the_provider_s_phases_from_outside(halo: bool) -> None:
    """Capture wraps a provider from outside (issue 35 item 3): every capture is
    entered from the step (``_step.step`` -> ``StepGraphs``) with no provider
    method and no model code on the stack, and every phase of the provider,
    its decision of a split step (``begin_step``, ``take_verdict``) included, is
    called by the step module, in replays and eager steps alike. Before, the
    split step's decision was called from ``_graph_step``."""
    (captures, replays, splits), stacks, callers = _watched_run(halo)
    assert captures >= 1 and replays >= 5 and len(stacks) >= captures
    assert splits is halo  # (the halo's steps are cut at its rebuild decision)
    for frames in stacks:
        modules = [m for m, _, _ in frames]
        assert modules[0] == "nvdd.dynamics._graph_step", frames[:3]
        assert ("nvdd.dynamics._step", "step") in [(m, f) for m, f, _ in frames]
        inside = [(m, f) for m, f, mine in frames if mine or m.startswith("nvdd.models")]
        assert inside == [], "a provider or a model captured a step"
    assert callers == {"nvdd.dynamics._step"}


def test_only_the_step_module_cuts_a_step_and_only_step_graphs_captures() -> None:
    """``_graph_step`` names none of the step's stages (a provider's phases or
    decision, the integrator's halves): it records the pieces the step module
    hands it. And nothing in nvdd-dynamics or nvdd-models but ``_graph_step``
    makes a step graph (``make_step_graph``) or runs one (``run_step``, called
    by ``_step`` alone)."""
    src = pathlib.Path(nvdd.dynamics.__file__).parent
    stages = _PHASES | {"splits_step", "pre_update", "post_update", "compute"}
    tree = ast.parse((src / "_graph_step.py").read_text())
    named = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} & stages)
    assert named == []
    users: dict[str, set[str]] = {"make_step_graph": set(), "run_step": set()}
    for package in (nvdd.dynamics, nvdd.models):
        for path in sorted(pathlib.Path(package.__file__).parent.glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
                if isinstance(node, ast.Attribute | ast.Name) and name in users:
                    users[name].add(path.name)
    assert users == {"make_step_graph": {"_graph_step.py"}, "run_step": {"_step.py"}}


class _FailingCudaGraph:
    """A stand-in for a CUDA graph whose capture fails (a CUDA capture records
    without executing: ``executes_on_capture`` is False)."""

    executes_on_capture = False

    def capture(self, body: Any) -> list[Any]:
        raise CaptureError("operation not permitted when stream is capturing")

    def replay(self) -> None:  # pragma: no cover - never captured
        raise AssertionError("replayed a graph that was never captured")


@pytest.mark.parametrize("role", ["head", "tail"])
def test_a_failed_cuda_capture_warns_and_the_step_runs_eagerly(
    role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA-only fallback, on the CPU: a capture of the head (or whole
    step) or of a split step's tail that fails turns capture off with a warning,
    and the step that tried (its verdict taken again after a failed tail) and
    every later one run eagerly: the trajectory equals the eager one."""
    import sys

    import nvdd.dynamics._graph_step as graph_step

    real = graph_step.make_step_graph

    def make(device: torch.device, pool: Any = None) -> Any:
        tail = sys._getframe(1).f_code.co_name == "_capture_split"
        return _FailingCudaGraph() if tail == (role == "tail") else real(device, pool)

    monkeypatch.setattr(graph_step, "make_step_graph", make)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    eager, p0 = _run_split(False)
    with pytest.warns(RuntimeWarning, match="step capture failed"):
        graphed, p1 = _run_split(True)
    _assert_same(graphed, eager)
    assert not graphed.graphs.enabled and graphed.graphs.captures == 0
    assert "capture failed" in (graphed.graphs.last_drop or "")
    assert p1.rebuilds == p0.rebuilds
    assert p1.verdicts == (2 if role == "tail" else 0)  # the failed tail's step: taken again
