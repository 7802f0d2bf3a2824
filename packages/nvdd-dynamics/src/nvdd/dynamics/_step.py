"""The MD step, in one place: named phases over one :class:`StepState`.

:func:`step` is the whole step, single-process and decomposed alike::

    hooks                        BEFORE_STEP
    dyn.pre_update()             integrate, first half (drift)
    provider.decide(st)          one all-reduce of a flag: skin used up, or non-finite values
    provider.rebuild(st)         if so: migrate atoms, plan the halo, build the padded rows
    provider.exchange(st)        forward exchange: ghost positions -> st.padded
    provider.forward(st)         the model on [owned | ghost] rows -> st.raw
    provider.fold(st)            reverse fold of ghost forces, consolidation by the spec
    dyn.post_update()            integrate, second half (kick)
    hooks                        AFTER_STEP (and those of every stage in between)

Once a run is steady, the middle (``pre_update`` to ``post_update``) is a
replay of CUDA graphs (``dyn.graphs``, :class:`~nvdd.dynamics.StepGraphs`) of
the pieces :func:`steady_segments` cuts it into: whole, or, when the provider
decides on the host every step (``splits_step``: the halo's rebuild flag), a
head (``pre_update``, the decision queued on the device), the verdict read
between, and a tail (the force phases, ``post_update``). The provider declares
what may be captured (:class:`CapturableSteps`); capture wraps its phases from
here, never from inside it.

The :class:`StepState` carries who does what (provider, reducer, hook runner,
heartbeat, the owner of the atoms) and what the phases hand each other. One
process steps through the integrator's own state, whose provider runs the model
on the whole batch (``decide`` is False, ``exchange`` and ``fold`` are no-ops);
``DomainParallel`` binds its own state (:meth:`BaseDynamics.bind`) from
``partition`` to ``close``: the integrator's ``batch`` and ``reducer`` read
the state it is bound to, and nothing of the integrator is swapped
(``docs/decisions/0062-step-state.md``).

The step's one shared decision (:func:`decision_code`, :func:`read_decision`,
the ``decide`` phase of a decomposed step) carries a non-finite check
(:func:`nonfinite_flag`): every rank computes a small integer on its atoms'
device and the ranks take the maximum (one all-reduce), so every rank reads the
same verdict and takes the same branch; the codes are ordered by priority:

- :data:`STEADY` (0): the halo plan holds;
- :data:`MODEL_GROWS` (1): some rank's model buffers overflowed (the MPNN's
  device edges): the step runs eagerly and that rank grows; nothing migrates;
- :data:`REBUILD` (2): some owned atom used up its skin: migrate, new plan;
- :data:`NONFINITE` (3): some rank holds a non-finite value: every rank raises.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from time import monotonic
from typing import Any, Protocol, runtime_checkable

import torch

from nvdd.core import (
    Batch,
    ConfigurationError,
    ModelOutputs,
    ValidationError,
    all_reduce,
    can_capture,
    comm_device,
    get_rank,
    get_world_size,
    raise_if_any_rank,
)
from nvdd.dynamics._hooks import PER_ATOM_OUTPUTS, Hook, HookStage

__all__ = [
    "MAX_COORDINATE",
    "MODEL_GROWS",
    "NONFINITE",
    "REBUILD",
    "STEADY",
    "CapturableSteps",
    "ForceProvider",
    "HookRunner",
    "Integrator",
    "PhasedProvider",
    "Reducer",
    "Segments",
    "StateOwner",
    "StepProgress",
    "StepState",
    "compute",
    "compute_forces",
    "decision_code",
    "ensure_forces",
    "fire",
    "nonfinite_flag",
    "nonfinite_message",
    "read_decision",
    "reduce_device",
    "run",
    "steady_segments",
    "step",
]

_ENERGY_KEYS = ("energy", "stress")


class Reducer:
    """Sums and maxima of small tensors over every atom of the system.

    The single-process reducer is the identity; the distributed one (bound by
    DomainParallel) all-reduces over the mesh, so integrators that need global
    quantities (FIRE's power, a thermostat's temperature) work unchanged.
    """

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over all ranks (identity here)."""
        return t

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise max of ``t`` over all ranks (identity here)."""
        return t

    def sum_with_totals(
        self, t: torch.Tensor, names: Iterable[str], known: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``t`` summed over ranks and the model's per-system totals ``names``, in
        one reduction (an integrator's declared once-per-step reduction).

        Parameters
        ----------
        t:
            This process's share of the integrator's sums (any shape).
        names:
            Per-system model outputs wanted (e.g. ``"energy"``, ``"stress"``).
        known:
            Outputs of the last force computation that are already whole (in a
            single process: all of them).

        Returns
        -------
        (torch.Tensor, dict)
            The summed ``t`` and the totals of ``names`` that exist (a name the
            model does not return is left out). Here: ``t`` and ``known``.
        """
        return t, {n: known[n] for n in names if n in known}


class ForceProvider(Protocol):
    """Computes model outputs for the integrator's batch in one call.

    Returns the batch to continue with (a distributed provider may migrate atoms
    and return different owned rows) and the outputs for its rows. Forces are
    always returned; a distributed provider may leave out per-system totals that
    need a reduction (they are reduced on demand, when a hook needs them). The
    step runs such a provider as the ``forward`` phase of :class:`PhasedProvider`.
    """

    def __call__(self, batch: Batch) -> tuple[Batch, ModelOutputs]: ...


@runtime_checkable
class CapturableSteps(Protocol):
    """What a force provider declares about capturing its steady steps in a CUDA
    graph (``StepGraphs``); the step module reads it, the provider never captures.

    ``graph_key(batch)``
        What a capture of a step through this provider bakes in; None: not
        capturable now.
    ``splits_step``
        Whether a steady step must be cut at a host decision the provider makes
        every step: captured as a head (``pre_update``, then :meth:`begin_step`,
        the decision queued on the device) and a tail (the force phases,
        ``post_update``), with :meth:`take_verdict` (one host read) between.
    ``begin_step(batch)``
        Queue this step's decision on the device, unread (capturable).
    ``take_verdict(batch)``
        Read it: True when the captured tail may run, False when the step must
        run its force phases eagerly (a rebuild).
    """

    def graph_key(self, batch: Batch) -> Hashable | None: ...

    @property
    def splits_step(self) -> bool: ...

    def begin_step(self, batch: Batch) -> None: ...

    def take_verdict(self, batch: Batch) -> bool: ...


@runtime_checkable
class PhasedProvider(CapturableSteps, Protocol):
    """A force provider that exposes the phases of a force computation
    (:func:`compute_forces`), each reading and writing the :class:`StepState`,
    and declares what of its steps may be captured (:class:`CapturableSteps`)."""

    def open(self, st: StepState) -> None: ...

    def decide(self, st: StepState) -> bool: ...

    def rebuild(self, st: StepState) -> None: ...

    def exchange(self, st: StepState) -> None: ...

    def forward(self, st: StepState) -> None: ...

    def fold(self, st: StepState) -> ModelOutputs: ...

    def close(self, st: StepState) -> None: ...


class StepProgress(Protocol):
    """Where a step writes its progress for a watchdog (``nvdd.core``'s
    ``StepBeat``): the step and stage it reached, a count, and when."""

    step: int
    stage: str
    count: int
    at: float


class StateOwner(Protocol):
    """Holds an integrator's atom state (``local_batch``, read and written).

    On one process the integrator owns it; under ``DomainParallel`` the
    :class:`~nvdd.partition.ShardedBatch` does, so migration and the integrator
    never hold two copies that must be re-synced.
    """

    local_batch: Batch


#: Runs the due hooks of a stage: ``run_hooks(dyn, stage, due)``.
HookRunner = Callable[[Any, HookStage, list[Hook]], None]


@dataclass(eq=False, slots=True)
class StepState:
    """Who does what in an integrator's step, and what the phases hand each other.

    Attributes
    ----------
    owner:
        Holds this rank's owned atoms (``owner.local_batch``; a migration
        replaces them).
    provider:
        The force phases (:class:`PhasedProvider`).
    reducer:
        Global sums for the integrator (identity on one process).
    run_hooks:
        Runs the due hooks of a stage (scopes, gathers and agreement under DD).
    heartbeat:
        Called with ``(step_count, phase)`` at every hook stage, and again after
        due hooks ran (``"<stage> hooks done"``): progress beats for the caller.
    progress:
        A watchdog's :class:`~nvdd.core._watchdog.StepBeat` (``DomainParallel``'s):
        the same beats, written into its fields (no call).
    forces_ready:
        Forces at the current positions are in the batch (the first step does
        not compute them again).
    padded:
        Positions of the ``[owned | ghost]`` rows after the exchange, shape
        ``(n_owned + n_ghost, 3)`` (the owned positions on one process).
    raw:
        The model's outputs on those rows, before the fold.
    t0:
        Start of the phase being timed (``time.perf_counter``).
    """

    owner: StateOwner
    provider: PhasedProvider
    reducer: Reducer
    run_hooks: HookRunner
    heartbeat: Callable[[int, str], None] | None = None
    progress: StepProgress | None = None
    forces_ready: bool = False
    padded: Any = None
    raw: Any = None
    t0: float = 0.0

    @property
    def batch(self) -> Batch:
        """This rank's owned atoms."""
        return self.owner.local_batch


class _Graphs(Protocol):
    def run_step(self, st: StepState, cut: Callable[[StepState], Segments]) -> bool: ...


class Integrator(Protocol):
    """What the step needs of an integrator (``BaseDynamics``)."""

    model: Any
    step_count: int
    converged: bool
    hooks: list[Hook]
    outputs: dict[str, torch.Tensor]

    @property
    def graphs(self) -> _Graphs: ...

    @property
    def batch(self) -> Batch: ...

    @batch.setter
    def batch(self, batch: Batch) -> None: ...

    def pre_update(self) -> None: ...

    def post_update(self) -> None: ...

    def is_converged(self) -> bool: ...


# ----------------------------------------------------------------- the step
def step(dyn: Integrator, st: StepState) -> None:
    """One step of ``dyn`` through ``st``, every hook stage included (module notes).

    **Collective** under domain decomposition (every rank steps together).
    """
    ensure_forces(dyn, st)
    fire(dyn, st, HookStage.BEFORE_STEP)
    # steady: the segments below, replayed (a device that cannot capture never asks)
    if not (can_capture(st.batch.device) and dyn.graphs.run_step(st, steady_segments)):
        fire(dyn, st, HookStage.BEFORE_PRE_UPDATE)
        dyn.pre_update()  # integrate, first half
        fire(dyn, st, HookStage.AFTER_PRE_UPDATE)
        fire(dyn, st, HookStage.BEFORE_COMPUTE)
        p = st.provider
        p.open(st)
        if p.decide(st):  # skin used up somewhere (one all-reduce of a flag)
            p.rebuild(st)  # migrate, plan, build
        p.exchange(st)  # forward exchange of ghost positions
        p.forward(st)  # forces on [owned | ghost]
        outputs = p.fold(st)  # reverse fold, consolidation
        p.close(st)
        _store(dyn, st, outputs)
        fire(dyn, st, HookStage.AFTER_COMPUTE)
        fire(dyn, st, HookStage.BEFORE_POST_UPDATE)
        dyn.post_update()  # integrate, second half
        fire(dyn, st, HookStage.AFTER_POST_UPDATE)
    dyn.step_count += 1
    fire(dyn, st, HookStage.AFTER_STEP)
    if dyn.is_converged():
        dyn.converged = True
        fire(dyn, st, HookStage.ON_CONVERGE)


# ------------------------------------------- a steady step, cut for capture
@dataclass(frozen=True, slots=True)
class Segments:
    """The middle of a steady step (``pre_update`` to ``post_update``, no hook
    due in between) as the pieces a capture records: :func:`steady_segments`
    cuts it, ``StepGraphs`` captures and replays the pieces it is handed.

    Attributes
    ----------
    head:
        Captured first; alone, the whole middle.
    verdict:
        A host decision read after the head (None: there is none): True when the
        captured ``tail`` may run; False when ``tail`` runs eagerly instead and
        the graphs are dropped.
    tail:
        The rest of the middle, after ``verdict``.
    """

    head: Callable[[Integrator, StepState], None]
    verdict: Callable[[Integrator, StepState], bool] | None = None
    tail: Callable[[Integrator, StepState], None] | None = None


def _middle(dyn: Integrator, st: StepState) -> None:
    """Integrate, the force phases (:func:`compute`), integrate."""
    dyn.pre_update()
    compute(dyn, st)
    dyn.post_update()


def _head(dyn: Integrator, st: StepState) -> None:
    """Integrate, then the provider's decision queued on the device (its
    ``begin_step``: e.g. the all-reduced rebuild flag of the halo), unread."""
    dyn.pre_update()
    st.provider.begin_step(st.batch)


def _verdict(dyn: Integrator, st: StepState) -> bool:
    """The provider reads its decision (one host read): True when nothing is rebuilt."""
    return st.provider.take_verdict(st.batch)


def _tail(dyn: Integrator, st: StepState) -> None:
    """The force phases (:func:`compute`; ``decide`` reuses the verdict), integrate."""
    compute(dyn, st)
    dyn.post_update()


#: A steady step in one piece.
WHOLE_STEP = Segments(_middle)
#: A steady step cut at the provider's host decision (``splits_step``).
SPLIT_STEP = Segments(_head, _verdict, _tail)


def steady_segments(st: StepState) -> Segments:
    """How a steady step through ``st`` is captured: in one piece, or cut at the
    host decision its provider makes every step (``st.provider.splits_step``: the
    halo's rebuild flag, a model's buffer overflow) into a head, the verdict and
    a tail. Asked when a step is captured; the pieces are the step's own phases."""
    return SPLIT_STEP if st.provider.splits_step else WHOLE_STEP


def run(dyn: Integrator, st: StepState, n_steps: int) -> bool:
    """Up to ``n_steps`` steps, stopping early at convergence; returns ``converged``.

    Convergence is tested first (as ASE's optimisers do): a minimiser whose
    structure already meets its criterion takes no step (it fires
    ``ON_CONVERGE`` and returns True). Stepping anyway moved such a
    structure along the direction of forces at the rounding level (FIRE's
    velocity mixing divides by ``|F|``), i.e. along noise, and a decomposed
    run and one process moved it differently.
    """
    if n_steps < 0:
        raise ConfigurationError(f"n_steps must be >= 0, got {n_steps}")
    if n_steps:
        ensure_forces(dyn, st)
        if dyn.is_converged():
            dyn.converged = True
            fire(dyn, st, HookStage.ON_CONVERGE)
            return True
    for _ in range(n_steps):
        step(dyn, st)
        if dyn.converged:
            break
    return dyn.converged


def compute_forces(provider: PhasedProvider, st: StepState) -> ModelOutputs:
    """Outputs for the owned atoms at their current positions: the force phases
    of :func:`step` in order. **Collective** under domain decomposition;
    ``st.batch`` afterwards holds the rows they belong to."""
    provider.open(st)
    if provider.decide(st):
        provider.rebuild(st)
    provider.exchange(st)
    provider.forward(st)
    outputs = provider.fold(st)
    provider.close(st)
    return outputs


def compute(dyn: Integrator, st: StepState) -> None:
    """Forces (and every other output) at the current positions, stored in the
    batch and ``dyn.outputs`` (:func:`compute_forces`, then the store of :func:`step`)."""
    _store(dyn, st, compute_forces(st.provider, st))


def ensure_forces(dyn: Integrator, st: StepState) -> None:
    """Compute forces at the current positions if not done yet (t = 0)."""
    if not st.forces_ready:
        compute(dyn, st)


def _store(dyn: Integrator, st: StepState, out: ModelOutputs) -> None:
    """Forces, energy and stress into the batch, the per-atom outputs of
    :data:`PER_ATOM_OUTPUTS` the model returned into ``batch.atom_extras``;
    every whole output kept in ``dyn.outputs``."""
    if "forces" not in out:
        raise ValidationError(
            f"{type(dyn.model).__name__} returned no 'forces' (got {sorted(out)})"
        )
    batch = st.batch
    outputs = {k: v.detach() for k, v in out.items() if isinstance(v, torch.Tensor)}
    fields: dict[str, Any] = {"forces": outputs["forces"]}
    fields.update({k: outputs[k] for k in _ENERGY_KEYS if k in outputs})
    kept = {
        k: outputs[k]
        for k in PER_ATOM_OUTPUTS
        if k in outputs and outputs[k].shape[:1] == (batch.n_atoms,)
    }
    if kept:
        fields["atom_extras"] = {**batch.atom_extras, **kept}
    st.owner.local_batch = batch.replace(**fields)
    dyn.outputs = outputs
    st.forces_ready = True


def fire(dyn: Integrator, st: StepState, stage: HookStage) -> None:
    """Beat (the watchdog's progress, the heartbeat) and run the hooks of
    ``stage`` that are due."""
    progress, beat = st.progress, st.heartbeat
    if progress is not None:  # (fields, not a call: the watchdog reads them)
        progress.step, progress.stage = dyn.step_count, stage.value
        progress.count += 1
        progress.at = monotonic()
    if beat is not None:
        beat(dyn.step_count, stage.value)
    due = [h for h in dyn.hooks if h.stage is stage and h.due(dyn.step_count)]
    if due:
        _check_per_atom_needs(dyn, st, stage, due)
        st.run_hooks(dyn, stage, due)
        if progress is not None:
            progress.step, progress.stage = dyn.step_count, f"{stage.value} hooks done"
            progress.count += 1
            progress.at = monotonic()
        if beat is not None:
            beat(dyn.step_count, f"{stage.value} hooks done")


def _check_per_atom_needs(
    dyn: Integrator, st: StepState, stage: HookStage, hooks: list[Hook]
) -> None:
    """Raise if a due hook needs a per-atom output the model did not return.

    Local: every rank holds the same model, so every rank raises together.
    """
    kept = st.batch.atom_extras
    for hook in hooks:
        missing = sorted(n for n in hook.needs if n in PER_ATOM_OUTPUTS and n not in kept)
        if missing:
            name = getattr(hook.fn, "__name__", hook.fn)
            raise ConfigurationError(
                f"rank {get_rank()}: a {stage.value} hook ({name!r}) "
                f"needs {missing}, which {type(dyn.model).__name__} does not return (its "
                f"outputs: {sorted(dyn.outputs)}); per-atom virials come from models that "
                "say so, e.g. LennardJones(LJConfig(..., atom_virials=True))"
            )


# ------------------------------------------------------ non-finite values
#: The codes of the step's one shared decision, by priority (module notes).
STEADY, MODEL_GROWS, REBUILD, NONFINITE = 0, 1, 2, 3

#: Positions beyond this many Angstrom from the origin count as a blown-up run:
#: neighbour searches misbehave there (vesin 0.6 dies with SIGFPE on an open
#: system with an atom 1e6 A away), so they are reported like NaN, by atom id.
MAX_COORDINATE = 1.0e6


def nonfinite_flag(batch: Batch) -> torch.Tensor:
    """int32 0-dim tensor on the atoms' device: 1 if any position, velocity or
    force is not finite (or a position lies beyond :data:`MAX_COORDINATE`),
    else 0 (no host synchronisation; :func:`local_code`)."""
    return local_code(batch, bad=1).reshape(())


#: Device types on which the decision is the Warp kernel: CPU, CUDA and ``meta``,
#: the tests' fake accelerator (``nvdd.testing.fake_accelerator``: Warp runs there
#: on the CPU and refuses arguments from another device, as CUDA would).
DECIDE_WITH_WARP = ("cpu", "cuda", "meta")
#: The decision kernel's launcher (``nvdd.core.RecordedKernel``), made at first use.
_DECISION: list[Any] = []


def decision_launcher() -> Any:
    """The decision kernel's launcher (a ``RecordedKernel``), its float32 and
    float64 overloads declared (as ``tools/warp_prefill.py`` declares them)."""
    from nvdd.core import RecordedKernel
    from nvdd.dynamics._decision_kernels import decision_kernel

    kernel = RecordedKernel(decision_kernel, doubles=(5, 6))  # (limit2, max_coordinate)
    kernel.declare_overloads()
    return kernel


def local_code(
    batch: Batch,
    *,
    moved: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
    limit2: float = 0.0,
    bad: int = NONFINITE,
) -> torch.Tensor:
    """This rank's code before any reduction: int32 ``(1,)`` on the atoms'
    device, no host synchronisation.

    The larger of ``bad`` (default :data:`NONFINITE`), when a position,
    velocity or force is not finite or a position lies beyond
    :data:`MAX_COORDINATE`, and :data:`REBUILD`, when ``moved`` is nonzero or
    some row moved from ``reference`` (same shape and dtype as the positions)
    by more than ``sqrt(limit2)`` (differences in float64); :data:`STEADY`
    when neither holds.

    One Warp kernel on the device types of :data:`DECIDE_WITH_WARP` (each row
    read once; ``_decision_kernels``); torch operations on any other device,
    with mixed float types or shapes, or without rows (the same codes).
    """
    pos = batch.positions.detach()
    vel, forces = batch.velocities.detach(), batch.forces.detach()
    dev, dtype = pos.device, pos.dtype
    n = int(pos.shape[0])
    fused = (
        n > 0
        and dev.type in DECIDE_WITH_WARP
        and dtype in (torch.float32, torch.float64)
        and all(
            t.dtype == dtype and t.shape == pos.shape and t.device == dev for t in (vel, forces)
        )
        and pos.dim() == 2
        and pos.shape[1] == 3
        and (reference is None or (reference.dtype == dtype and reference.shape == pos.shape))
    )
    if not fused:
        finite = (pos.abs() < MAX_COORDINATE).all()
        for t in (vel, forces):
            finite = finite & torch.isfinite(t).all()
        hit = torch.zeros((), dtype=torch.bool, device=dev)
        if moved is not None:
            hit = hit | (moved.reshape(()) != 0)
        if reference is not None and n:
            u = pos.to(torch.float64) - reference.detach().to(torch.float64)
            hit = hit | ((u * u).sum(dim=1) > limit2).any()
        code = torch.maximum(torch.where(hit, REBUILD, STEADY), torch.where(finite, STEADY, bad))
        return code.to(torch.int32).reshape(1)
    if not _DECISION:
        _DECISION.append(decision_launcher())
    code = torch.zeros(1, dtype=torch.int32, device=dev)
    ref = pos if reference is None else reference.detach()
    flag = code if moved is None else moved.reshape(1).to(torch.int32)  # (code: never read)
    _DECISION[0](
        n,
        [pos, ref, vel, forces, n if reference is not None else 0, float(limit2),
         MAX_COORDINATE, int(moved is not None), flag, REBUILD, bad, code],
        dev, dtype,
    )  # fmt: skip
    return code


def nonfinite_message(batch: Batch) -> str | None:
    """What is not finite on this rank (field, first atom id, value), or None
    (host reads: for the error path, after :func:`nonfinite_flag` was set)."""
    far = ~(batch.positions.detach().abs() < MAX_COORDINATE).all(dim=1) & torch.isfinite(
        batch.positions
    ).all(dim=1)
    if bool(far.any()):
        row = int(far.nonzero()[0, 0])
        return (
            f"{int(far.sum())} of {batch.n_atoms} owned atoms lie beyond {MAX_COORDINATE:g} A "
            f"from the origin (first: atom id {int(batch.atom_ids[row])}, position "
            f"{batch.positions[row].tolist()}): the run blew up"
        )
    for name in ("positions", "velocities", "forces"):
        t = getattr(batch, name)
        bad = ~torch.isfinite(t).all(dim=1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            return (
                f"{int(bad.sum())} of {batch.n_atoms} owned atoms have non-finite {name} "
                f"(first: atom id {int(batch.atom_ids[row])}, {name} {t[row].tolist()}); "
                "the time step may be too large or the model diverged"
            )
    return None


# ------------------------------------------------------ the step's decision


def reduce_device(group: Any) -> torch.device | None:
    """Where :func:`decision_code` reduces over ``group``: its collectives'
    device, None for a group of one rank (nothing to reduce). Fixed per group:
    a caller that decides every step asks once."""
    return comm_device(group) if get_world_size(group) > 1 else None


def decision_code(
    moved: torch.Tensor | None,
    model_flag: torch.Tensor | None,
    batch: Batch,
    group: Any,
    on: torch.device | str | None = "ask",
    *,
    reference: torch.Tensor | None = None,
    limit2: float = 0.0,
) -> torch.Tensor:
    """The step's code, int32 ``(1,)``, reduced over ``group`` (no host read).

    ``moved``: nonzero when this rank's atoms used up the skin, or (None) the
    test made here: some owned row moved from ``reference`` by more than
    ``sqrt(limit2)``; ``model_flag``: nonzero when this rank's model buffers
    overflowed (None: no such model); the non-finite flag of ``batch`` is added
    here (the local part in one kernel: :func:`local_code`). ``on``: the
    group's :func:`reduce_device` when the caller knows it (default: asked here).

    **Collective** over ``group`` when it has more than one rank: ONE
    all-reduce (max) of one integer.
    """
    code = local_code(batch, moved=moved, reference=reference, limit2=limit2)
    if model_flag is not None:
        code = torch.maximum(code, (model_flag.reshape(1) != 0).to(torch.int32))
    device = reduce_device(group) if isinstance(on, str) else on
    if device is not None:
        code = code.to(device)
        all_reduce(code, "max", group)
    return code


def read_decision(code: torch.Tensor, batch: Batch, group: Any) -> int:
    """The host read of :func:`decision_code`: the code, after raising on every
    rank of ``group`` for :data:`NONFINITE` (**Collective** then: the messages
    are gathered)."""
    verdict = int(code.item())
    if verdict == NONFINITE:
        raise_if_any_rank(nonfinite_message(batch), group)
    return verdict
