"""`BaseDynamics`: the single-process integrator skeleton with hooks.

A step is ``pre_update`` -> forces -> ``post_update``, with hooks around each
stage: :func:`nvdd.dynamics._step.step`, over the :class:`StepState` the
integrator is bound to. Forces at t = 0 are computed before the first
``pre_update``. The same class runs unchanged under
:class:`~nvdd.dynamics.DomainParallel`, which binds its own state (a distributed
force provider, a mesh-wide :class:`Reducer`, its hook runner) from
``partition`` to ``close``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nvdd.core import Batch, ConfigurationError, ModelOutputs
from nvdd.dynamics import _step
from nvdd.dynamics._graph_step import StepGraphs
from nvdd.dynamics._hooks import PER_ATOM_OUTPUTS, Hook, HookScope, HookStage
from nvdd.dynamics._step import (
    CapturableSteps,
    ForceProvider,
    HookRunner,
    PhasedProvider,
    Reducer,
    StateOwner,
    StepState,
)
from nvdd.spec import ModelContract, as_model

__all__ = [
    "ASE_TIME_PER_FS",
    "KB_EV_PER_K",
    "PER_ATOM_OUTPUTS",
    "BaseDynamics",
    "ForceProvider",
    "HookContext",
    "ModelForceProvider",
    "Reducer",
    "StateOwner",
    "StepState",
]

#: One femtosecond in ASE time units (Angstrom * sqrt(amu / eV)).
ASE_TIME_PER_FS = 0.09822694788464063
#: Boltzmann constant, eV / K.
KB_EV_PER_K = 8.617333262e-5


@dataclass(frozen=True)
class HookContext:
    """What a hook callback receives.

    Attributes
    ----------
    batch:
        The batch of the hook's scope (owned atoms for LOCAL, the whole system in
        atom-id order for GLOBAL / RANK_ZERO).
    step:
        Steps completed so far (0 before the first step).
    stage:
        The stage running.
    dynamics:
        The inner integrator.
    rank, world_size:
        Place of this process in the decomposition (0 and 1 in a single process).
    """

    batch: Batch
    step: int
    stage: HookStage
    dynamics: BaseDynamics
    rank: int = 0
    world_size: int = 1


class _OwnState:
    """The single-process owner: just the batch."""

    __slots__ = ("local_batch",)

    def __init__(self, batch: Batch) -> None:
        self.local_batch = batch


class ModelForceProvider:
    """Runs a model on the whole batch in this process."""

    def __init__(self, model: Callable[[Batch], ModelOutputs]) -> None:
        self.model = model
        # the model's step hooks (a plain callable: the contract's defaults)
        self.contract: ModelContract = as_model(model)

    def __call__(self, batch: Batch) -> tuple[Batch, ModelOutputs]:
        return batch, self.model(batch)

    # the phases of a force computation (nvdd.dynamics._step): one model call
    def open(self, st: StepState) -> None:
        """Nothing to start."""

    def decide(self, st: StepState) -> bool:
        """Nothing is ever rebuilt."""
        return False

    def rebuild(self, st: StepState) -> None:
        """Never called (:meth:`decide` is False)."""

    def exchange(self, st: StepState) -> None:
        """No ghosts: nothing to exchange."""

    def forward(self, st: StepState) -> None:
        """The model on the whole batch."""
        st.raw = self.model(st.batch)

    def fold(self, st: StepState) -> ModelOutputs:
        """No ghosts: the model's outputs as they are."""
        raw: ModelOutputs = st.raw
        st.raw = None
        return raw

    def close(self, st: StepState) -> None:
        """Nothing to finish."""

    def graph_key(self, batch: Batch) -> Hashable | None:
        """The model's ``graph_key(batch)`` (None when it has none)."""
        return self.contract.graph_key(batch)

    @property
    def splits_step(self) -> bool:
        """Whether the model's captured steps are split at its own decision
        (``begin_step`` / ``take_verdict``, see ``StepGraphs``)."""
        return bool(self.contract.splits_step)

    def begin_step(self, batch: Batch) -> None:
        """The model's ``begin_step(batch)`` (queued on the device, unread)."""
        self.contract.begin_step(batch)

    def take_verdict(self, batch: Batch) -> bool:
        """The model's ``take_verdict(batch)``: whether the captured rest fits."""
        return bool(self.contract.take_verdict(batch))


class _CallProvider:
    """A one-call :class:`ForceProvider` (``provider(batch) -> (batch, outputs)``)
    run as the phases of a force computation. Its steps are captured only when
    it declares :class:`~nvdd.dynamics._step.CapturableSteps` (read once, here);
    every other attribute is the provider's own."""

    def __init__(self, provider: ForceProvider) -> None:
        self.provider = provider
        self._captures: CapturableSteps | None = (
            provider if isinstance(provider, CapturableSteps) else None
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["provider"], name)

    def open(self, st: StepState) -> None:
        """Nothing to start."""

    def decide(self, st: StepState) -> bool:
        """The provider decides inside its call."""
        return False

    def rebuild(self, st: StepState) -> None:
        """Never called (:meth:`decide` is False)."""

    def exchange(self, st: StepState) -> None:
        """Inside the provider's call."""

    def forward(self, st: StepState) -> None:
        """The provider's call (it may return other rows: they are the owner's now)."""
        batch, st.raw = self.provider(st.batch)
        if batch is not st.owner.local_batch:
            st.owner.local_batch = batch

    def fold(self, st: StepState) -> ModelOutputs:
        """The provider's outputs as they are."""
        raw: ModelOutputs = st.raw
        st.raw = None
        return raw

    def close(self, st: StepState) -> None:
        """Nothing to finish."""

    # what the provider declares of capture (CapturableSteps), or nothing
    def graph_key(self, batch: Batch) -> Hashable | None:
        """The provider's ``graph_key(batch)``; None when it declares none."""
        return None if self._captures is None else self._captures.graph_key(batch)

    @property
    def splits_step(self) -> bool:
        """The provider's ``splits_step`` (False when it declares none)."""
        return self._captures is not None and bool(self._captures.splits_step)

    def begin_step(self, batch: Batch) -> None:
        """The provider's ``begin_step(batch)``."""
        if self._captures is not None:
            self._captures.begin_step(batch)

    def take_verdict(self, batch: Batch) -> bool:
        """The provider's ``take_verdict(batch)`` (True when it declares none)."""
        return self._captures is None or bool(self._captures.take_verdict(batch))


def _phased(provider: Any) -> PhasedProvider:
    """``provider`` as the phases of a force computation (a one-call provider wrapped)."""
    if isinstance(provider, PhasedProvider):  # (the phases and CapturableSteps declared)
        return provider
    return _CallProvider(provider)


def _run_hooks_locally(dyn: BaseDynamics, stage: HookStage, hooks: list[Hook]) -> None:
    for hook in hooks:
        hook.fn(HookContext(batch=dyn.batch, step=dyn.step_count, stage=stage, dynamics=dyn))


class BaseDynamics:
    """Integrator skeleton: ``step`` = pre_update, compute, post_update (+ hooks).

    Subclasses implement :meth:`pre_update` and :meth:`post_update` on
    ``self.batch`` (owned atoms only under DD) and may override
    :meth:`is_converged`. Per-atom integrator state must live in
    ``batch.atom_extras`` so it travels with migrating atoms. The integrator
    keeps its own copies of the positions and velocities it is given, so it may
    update them in place; the caller's batch is never modified.

    Parameters
    ----------
    model:
        A callable ``model(batch) -> ModelOutputs`` (an ``nvdd.spec.BaseModelMixin``).
    batch:
        The system.
    dt_fs:
        Time step in femtoseconds.
    hooks:
        Initial hooks.
    cuda_graphs:
        Capture steady steps in a CUDA graph and replay them where the
        integrator, the force provider and the model allow it (see
        :class:`~nvdd.dynamics.StepGraphs`); default ``$NVDD_CUDA_GRAPHS`` or
        on. The counters are in :attr:`graphs`.
    """

    def __init__(
        self,
        model: Callable[[Batch], ModelOutputs],
        batch: Batch,
        *,
        dt_fs: float = 1.0,
        hooks: Iterable[Hook] = (),
        cuda_graphs: bool | None = None,
    ) -> None:
        if not dt_fs > 0:
            raise ConfigurationError(f"dt_fs must be positive, got {dt_fs!r}")
        self.model = model
        # The integrator's own positions and velocities: integrators may update
        # them in place without touching the caller's tensors.
        own = batch.replace(positions=batch.positions.clone(), velocities=batch.velocities.clone())
        # The states this integrator is stepped through: its own (the whole
        # batch, the model, the identity reducer), then the one bound last
        # (DomainParallel's, from partition to close) on top.
        self._states: list[StepState] = [
            StepState(_OwnState(own), ModelForceProvider(model), Reducer(), _run_hooks_locally)
        ]
        self.dt_fs = float(dt_fs)
        self.step_count = 0
        self.converged = False
        self.hooks: list[Hook] = list(hooks)
        #: Outputs of the last force computation that are whole on this process
        #: (under DD, per-system partials are not here until reduced).
        self.outputs: dict[str, torch.Tensor] = {}
        #: Capture and replay of steady steps (CUDA graphs).
        self.graphs = StepGraphs(self, cuda_graphs)

    # ---------------------------------------------------------------- state
    @property
    def step_state(self) -> StepState:
        """The :class:`StepState` this integrator steps through now (its own, or
        the one ``DomainParallel`` bound)."""
        return self._states[-1]

    def bind(self, state: StepState) -> None:
        """Step through ``state`` from now on (its owner's atoms, provider,
        reducer, hook runner and heartbeat) until :meth:`unbind`.
        ``DomainParallel.partition`` binds its own; nothing else changes."""
        self._states.append(state)

    def unbind(self, state: StepState) -> None:
        """Stop stepping through ``state`` (bound by :meth:`bind`): the
        integrator's own state takes over, with ``state``'s current atoms (this
        rank's owned atoms under DD) and whether their forces are computed."""
        if state not in self._states[1:]:
            return
        self._states.remove(state)
        own = self._states[-1]
        own.owner.local_batch = state.owner.local_batch
        own.forces_ready = state.forces_ready

    @property
    def batch(self) -> Batch:
        """The atoms this integrator advances (this rank's owned atoms under DD)."""
        return self._states[-1].owner.local_batch

    @batch.setter
    def batch(self, batch: Batch) -> None:
        self._states[-1].owner.local_batch = batch

    @property
    def reducer(self) -> Reducer:
        """Global sums for the integrator (mesh-wide under DD; identity otherwise)."""
        return self._states[-1].reducer

    @property
    def force_provider(self) -> PhasedProvider:
        """The force phases of the step (a one-call ``ForceProvider`` assigned
        here runs as its ``forward`` phase)."""
        return self._states[-1].provider

    @force_provider.setter
    def force_provider(self, provider: ForceProvider | PhasedProvider) -> None:
        self._states[-1].provider = _phased(provider)

    @property
    def hook_runner(self) -> HookRunner:
        """Runs the due hooks of a stage (DomainParallel's under DD)."""
        return self._states[-1].run_hooks

    @property
    def heartbeat(self) -> Callable[[int, str], None] | None:
        """Called with ``(step_count, phase)`` at every hook stage (phase: the
        stage's value), whether or not hooks are due, and again after due hooks
        ran (``"<stage> hooks done"``): progress beats for a watchdog (DomainParallel
        binds one), so a rank stuck in a hook falls behind the others."""
        return self._states[-1].heartbeat

    @heartbeat.setter
    def heartbeat(self, beat: Callable[[int, str], None] | None) -> None:
        self._states[-1].heartbeat = beat

    @property
    def _forces_ready(self) -> bool:
        return self._states[-1].forces_ready

    @_forces_ready.setter
    def _forces_ready(self, ready: bool) -> None:
        self._states[-1].forces_ready = ready

    def attach_state(self, owner: StateOwner | None) -> None:
        """Keep the atom state in ``owner`` from now on (``None``: in this object,
        starting from the owner's current batch)."""
        self._states[-1].owner = _OwnState(self.batch) if owner is None else owner

    # ---------------------------------------------------------------- hooks
    def register_hook(
        self,
        stage: HookStage,
        fn: Callable[[HookContext], Any],
        *,
        every: int = 1,
        scope: HookScope = HookScope.LOCAL,
        needs: Iterable[str] = (),
    ) -> Hook:
        """Add a hook; returns it (pass it to :meth:`remove_hook` to drop it)."""
        hook = Hook(stage=stage, fn=fn, every=every, scope=scope, needs=frozenset(needs))
        self.hooks.append(hook)
        return hook

    def remove_hook(self, hook: Hook) -> None:
        """Drop a hook registered earlier."""
        self.hooks.remove(hook)

    # ------------------------------------------------------------ the step
    @property
    def dt(self) -> float:
        """Time step in ASE time units."""
        return self.dt_fs * ASE_TIME_PER_FS

    def pre_update(self) -> None:
        """First half of the step, before forces (e.g. half kick and drift)."""
        raise NotImplementedError(f"{type(self).__name__} must implement pre_update")

    def post_update(self) -> None:
        """Second half of the step, after forces (e.g. the second half kick)."""
        raise NotImplementedError(f"{type(self).__name__} must implement post_update")

    def compute(self) -> None:
        """Run the model; store forces, energy and stress in the batch and the
        per-atom outputs of :data:`PER_ATOM_OUTPUTS` it returns (``atom_energies``,
        ``atom_virials``) in ``batch.atom_extras``; keep every whole output in
        :attr:`outputs` (:func:`nvdd.dynamics._step.compute`)."""
        _step.compute(self, self._states[-1])

    def graph_key(self) -> Hashable | None:
        """Host state a CUDA-graph capture of ``pre_update`` / ``compute`` /
        ``post_update`` would bake in (e.g. the time step); ``None`` (the
        default): this integrator's steps are never captured. An integrator that
        opts in updates its state in place on the device and makes no host
        decision in those stages."""
        return None

    def state_arrays(self) -> dict[str, Any]:
        """Integrator state beyond its public scalars that an exact restart needs
        (a thermostat's chain, a barostat's cell momentum): float64 NumPy arrays
        by name, global (the same on every rank). Default: none.
        ``save_checkpoint`` stores them and ``load_checkpoint`` hands them to
        :meth:`load_state_arrays`."""
        return {}

    def load_state_arrays(self, arrays: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_arrays` returned (float64 arrays by name).

        Raises
        ------
        ConfigurationError
            When ``arrays`` holds names this integrator does not keep.
        """
        if arrays:
            raise ConfigurationError(
                f"{type(self).__name__} keeps no array state, the checkpoint holds {sorted(arrays)}"
            )

    def is_converged(self) -> bool:
        """Convergence check after each step (MD integrators never converge)."""
        return False

    def ensure_forces(self) -> None:
        """Compute forces at the current positions if not done yet (t = 0)."""
        _step.ensure_forces(self, self._states[-1])

    def step(self) -> None:
        """One step with every hook stage (:func:`nvdd.dynamics._step.step`)."""
        _step.step(self, self._states[-1])

    def run(self, n_steps: int) -> bool:
        """Up to ``n_steps`` steps, stopping early at convergence; returns
        ``converged`` (:func:`nvdd.dynamics._step.run`: a structure that already
        meets its criterion takes no step)."""
        return _step.run(self, self._states[-1], n_steps)
