"""Integrators: `BaseDynamics`, the skeleton every integrator shares, and the
plain ones: velocity-Verlet NVE, Langevin NVT (BAOAB), FIRE.

`BaseDynamics`: the single-process integrator skeleton with hooks.

A step is ``pre_update`` -> forces -> ``post_update``, with hooks around each
stage: :func:`nvdd.dynamics._step.step`, over the :class:`StepState` the
integrator is bound to. Forces at t = 0 are computed before the first
``pre_update``. The same class runs unchanged under
:class:`~nvdd.dynamics.DomainParallel`, which binds its own state (a distributed
force provider, a mesh-wide :class:`Reducer`, its hook runner) from
``partition`` to ``close``.

The thermostatted and barostatted integrators (``_nvt``, ``_npt``) build on
:class:`BaseDynamics` in their own modules.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nvdd.core import (
    KB_EV_PER_K,
    Batch,
    CaptureError,
    ConfigurationError,
    ModelOutputs,
    capturing,
    sum_by_system,
)
from nvdd.dynamics import _step
from nvdd.dynamics._graph_step import StepGraphs
from nvdd.dynamics._hooks import PER_ATOM_OUTPUTS, Hook, HookScope, HookStage
from nvdd.dynamics._rng import atom_normal
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
    "FIRE",
    "KB_EV_PER_K",
    "PER_ATOM_OUTPUTS",
    "BaseDynamics",
    "ForceProvider",
    "HookContext",
    "Langevin",
    "ModelForceProvider",
    "Reducer",
    "StateOwner",
    "StepState",
    "VelocityVerlet",
    "kinetic_energy",
    "temperature",
]

#: One femtosecond in ASE time units (Angstrom * sqrt(amu / eV)).
ASE_TIME_PER_FS = 0.09822694788464063


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


class _OneCallPhases:
    """The phases of a force computation (:mod:`nvdd.dynamics._step`) when the
    forces come from one call (:meth:`forward`, the subclass's): nothing to start,
    decide, rebuild, exchange or finish, and the outputs folded as they are."""

    def open(self, st: StepState) -> None:
        """Nothing to start."""

    def decide(self, st: StepState) -> bool:
        """Nothing to rebuild here (a one-call provider decides inside its call)."""
        return False

    def rebuild(self, st: StepState) -> None:
        """Never called (:meth:`decide` is False)."""

    def exchange(self, st: StepState) -> None:
        """No ghosts here (a one-call provider exchanges inside its call)."""

    def fold(self, st: StepState) -> ModelOutputs:
        """The outputs as they are."""
        raw: ModelOutputs = st.raw
        st.raw = None
        return raw

    def close(self, st: StepState) -> None:
        """Nothing to finish."""


class ModelForceProvider(_OneCallPhases):
    """Runs a model on the whole batch in this process."""

    def __init__(self, model: Callable[[Batch], ModelOutputs]) -> None:
        self.model = model
        # the model's step hooks (a plain callable: the contract's defaults)
        self.contract: ModelContract = as_model(model)

    def __call__(self, batch: Batch) -> tuple[Batch, ModelOutputs]:
        return batch, self.model(batch)

    # the one phase with work (the others: _OneCallPhases)
    def forward(self, st: StepState) -> None:
        """The model on the whole batch."""
        st.raw = self.model(st.batch)

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


class _CallProvider(_OneCallPhases):
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

    def forward(self, st: StepState) -> None:
        """The provider's call (it may return other rows: they are the owner's now)."""
        batch, st.raw = self.provider(st.batch)
        if batch is not st.owner.local_batch:
            st.owner.local_batch = batch

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


# ------------------------------------------------------- the plain integrators
def kinetic_energy(batch: Batch, reducer: Any = None) -> torch.Tensor:
    """Per-system kinetic energy (eV), shape ``(n_systems,)``; summed over ranks by
    ``reducer`` when given (a **Collective** under DD)."""
    per_atom = 0.5 * batch.masses * (batch.velocities * batch.velocities).sum(dim=1)
    ke = sum_by_system(per_atom, batch.system_index, batch.n_systems)
    return reducer.sum(ke) if reducer is not None else ke


def temperature(batch: Batch, reducer: Any = None) -> torch.Tensor:
    """Per-system instantaneous temperature (K) with 3N degrees of freedom."""
    n = torch.bincount(batch.system_index, minlength=batch.n_systems).to(batch.dtype)
    if reducer is not None:
        n = reducer.sum(n)
    return 2.0 * kinetic_energy(batch, reducer) / (3.0 * n.clamp(min=1) * KB_EV_PER_K)


def _accel(batch: Batch) -> torch.Tensor:
    return batch.forces / batch.masses[:, None]


class VelocityVerlet(BaseDynamics):
    """Velocity-Verlet NVE: half kick, drift | forces | half kick.

    The updates are in place (three fused element-wise kernels per step, no
    temporaries): the integrator's positions and velocities are its own copies
    (see :class:`BaseDynamics`), so a caller's batch is never modified, but a
    hook that keeps ``ctx.batch.positions`` beyond the call must clone it.
    """

    def graph_key(self) -> Hashable | None:
        """Its steps may be captured (in-place updates, no host decision); the
        time step is baked in."""
        return ("velocity-verlet", self.dt_fs)

    def pre_update(self) -> None:
        """Half kick then drift, in place: ``v += F/m dt/2``, ``x += v dt``."""
        b = self.batch
        b.velocities.addcdiv_(b.forces, b.masses.unsqueeze(1), value=0.5 * self.dt)
        b.positions.add_(b.velocities, alpha=self.dt)

    def post_update(self) -> None:
        """The second half kick with the new forces, in place: ``v += F/m dt/2``."""
        b = self.batch
        b.velocities.addcdiv_(b.forces, b.masses.unsqueeze(1), value=0.5 * self.dt)


class Langevin(BaseDynamics):
    """Langevin NVT with the BAOAB splitting (B A O A | forces | B).

    The noise of every atom is a function of ``(seed, step, atom id)`` only, so a
    domain-decomposed run draws exactly the noise of the single-process run.

    Parameters
    ----------
    temperature_K:
        Bath temperature.
    friction_per_fs:
        Friction coefficient gamma, 1/fs.
    seed:
        Noise seed.
    """

    def __init__(
        self,
        model: Callable[[Batch], ModelOutputs],
        batch: Batch,
        *,
        dt_fs: float = 1.0,
        temperature_K: float,
        friction_per_fs: float = 0.01,
        seed: int = 0,
        hooks: Iterable[Hook] = (),
        cuda_graphs: bool | None = None,
    ) -> None:
        super().__init__(model, batch, dt_fs=dt_fs, hooks=hooks, cuda_graphs=cuda_graphs)
        if not temperature_K >= 0:
            raise ConfigurationError(f"temperature_K must be >= 0, got {temperature_K!r}")
        if not friction_per_fs >= 0:
            raise ConfigurationError(f"friction_per_fs must be >= 0, got {friction_per_fs!r}")
        self.temperature_K = float(temperature_K)
        self.friction_per_fs = float(friction_per_fs)
        self.seed = int(seed)
        self._step_on_device: torch.Tensor | None = None
        self._coefficients: tuple[tuple[float, float], float, float] | None = None

    def graph_key(self) -> Hashable | None:
        """Its steps may be captured: the noise reads the step number from a
        device counter that the captured step advances; the time step, bath and
        seed are baked in."""
        return ("langevin", self.dt_fs, self.temperature_K, self.friction_per_fs, self.seed)

    def _ou_coefficients(self) -> tuple[float, float]:
        """``exp(-gamma dt)`` and ``sqrt(1 - c1**2)``, computed once per
        ``(gamma, dt)`` on the host (so a captured step holds no host tensor op)."""
        key = (self.friction_per_fs, self.dt_fs)
        cached = self._coefficients
        if cached is None or cached[0] != key:
            c1 = torch.exp(torch.tensor(-key[0] * key[1], dtype=torch.float64))
            cached = (key, float(c1), float(torch.sqrt(1.0 - c1 * c1)))
            self._coefficients = cached
        return cached[1], cached[2]

    def _noise_step(self, device: torch.device) -> torch.Tensor:
        """The step number as an int64 device tensor (the noise's counter)."""
        counter = self._step_on_device
        if counter is None or counter.device != device:
            if capturing():
                raise CaptureError("Langevin: the noise counter must exist before a capture")
            counter = torch.zeros((), dtype=torch.int64, device=device)
            self._step_on_device = counter
        if not capturing():  # eager: the host's count (a replay finds it advanced)
            counter.fill_(self.step_count)
        return counter

    def pre_update(self) -> None:
        """B A O A: half kick, half drift, the Ornstein-Uhlenbeck velocity update
        with this step's per-atom noise, half drift."""
        b = self.batch
        half = 0.5 * self.dt
        v = b.velocities + half * _accel(b)
        x = b.positions + half * v
        c1, c2 = self._ou_coefficients()
        sigma = torch.sqrt(KB_EV_PER_K * self.temperature_K / b.masses)[:, None]
        step = self._noise_step(b.device)
        noise = atom_normal(self.seed, step, b.atom_ids, dtype=b.dtype)
        step.add_(1)  # the next step's count: what a capture of the next step reads
        v = c1 * v + c2 * sigma * noise
        x = x + half * v
        self.batch = b.replace(velocities=v, positions=x)

    def post_update(self) -> None:
        """The final B: a half kick with the new forces."""
        b = self.batch
        self.batch = b.replace(velocities=b.velocities + 0.5 * self.dt * _accel(b))


class FIRE(BaseDynamics):
    """FIRE minimiser (Bitzek et al. 2006) with mesh-wide power and norms.

    Converged when the largest force component norm over all atoms is below
    ``fmax`` (eV/Angstrom). Global sums go through ``self.reducer``, so a
    decomposed run takes the same steps as the single-process one.

    The adaptive state (time step, mixing ``alpha``, the count of steps with
    positive power) lives on the atoms' device and is updated there, with the
    velocities and positions in place: a step makes no host decision, so its
    steady steps may be captured in a CUDA graph like an MD integrator's. The
    one host read per step is the convergence test after it. ``dt_fs``,
    ``alpha`` and ``n_positive`` read (and set) that state, so each read waits
    for the device: read them between runs, not per step.
    """

    def __init__(
        self,
        model: Callable[[Batch], ModelOutputs],
        batch: Batch,
        *,
        dt_fs: float = 1.0,
        dt_max_fs: float = 10.0,
        fmax: float = 0.05,
        n_min: int = 5,
        f_inc: float = 1.1,
        f_dec: float = 0.5,
        alpha_start: float = 0.1,
        f_alpha: float = 0.99,
        hooks: Iterable[Hook] = (),
        cuda_graphs: bool | None = None,
    ) -> None:
        super().__init__(model, batch, dt_fs=dt_fs, hooks=hooks, cuda_graphs=cuda_graphs)
        if not (fmax > 0 and dt_max_fs >= dt_fs and 0 < f_dec < 1 < f_inc and 0 < alpha_start < 1):
            raise ConfigurationError(
                f"FIRE: need fmax > 0 (got {fmax}), dt_max_fs >= dt_fs ({dt_max_fs} vs {dt_fs}), "
                f"0 < f_dec < 1 < f_inc ({f_dec}, {f_inc}), 0 < alpha_start < 1 ({alpha_start})"
            )
        self.fmax, self.dt_max_fs, self.n_min = float(fmax), float(dt_max_fs), int(n_min)
        self.f_inc, self.f_dec = float(f_inc), float(f_dec)
        self.alpha_start, self.f_alpha = float(alpha_start), float(f_alpha)
        self.alpha = self.alpha_start
        self.n_positive = 0

    # ------------------------------------------------ the state on the device
    def _adaptive(self) -> torch.Tensor:
        """float64 ``[dt_fs, alpha, n_positive]`` on the atoms' device (made, zero,
        at the first use, which is the base class setting ``dt_fs``; moved when
        the atoms moved, which changes :meth:`graph_key`)."""
        state: torch.Tensor | None = self.__dict__.get("_fire_state")
        device = self.batch.device
        if state is None:
            state = torch.zeros(3, dtype=torch.float64, device=device)
            self.__dict__["_fire_state"] = state
        elif state.device != device:
            state = state.to(device)
            self.__dict__["_fire_state"] = state
        return state

    def _get(self, k: int) -> float:
        return float(self._adaptive()[k])

    def _set(self, k: int, value: float) -> None:
        self._adaptive()[k] = float(value)

    @property
    def dt_fs(self) -> float:
        """The current (adaptive) time step in fs (a host read)."""
        return self._get(0)

    @dt_fs.setter
    def dt_fs(self, value: float) -> None:
        self._set(0, value)

    @property
    def alpha(self) -> float:
        """The current velocity-mixing coefficient (a host read)."""
        return self._get(1)

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._set(1, value)

    @property
    def n_positive(self) -> int:
        """Steps in a row with positive power (a host read)."""
        return round(self._get(2))

    @n_positive.setter
    def n_positive(self, value: int) -> None:
        self._set(2, int(value))

    def state_arrays(self) -> dict[str, Any]:
        """``fire``: ``[dt_fs, alpha, n_positive]`` (what a restart restores)."""
        return {"fire": self._adaptive().cpu().numpy()}

    def load_state_arrays(self, arrays: Mapping[str, Any]) -> None:
        """Restore ``fire`` (``[dt_fs, alpha, n_positive]``) from :meth:`state_arrays`;
        other names go to the base class, which refuses them."""
        rest = {k: v for k, v in arrays.items() if k != "fire"}
        super().load_state_arrays(rest)
        if "fire" in arrays:
            values = torch.as_tensor(arrays["fire"], dtype=torch.float64).reshape(3)
            self._adaptive().copy_(values)

    def graph_key(self) -> Hashable | None:
        """Its steps may be captured: the adaptive state is read and written on
        the device (at a fixed address); the parameters are baked in."""
        params = (self.dt_max_fs, self.n_min, self.f_inc, self.f_dec, self.alpha_start)
        return ("fire", *params, self.f_alpha, self._adaptive().data_ptr())

    # ------------------------------------------------------------ the step
    def pre_update(self) -> None:
        """The FIRE update, on the device and in place: mix velocities towards the
        forces (zero them uphill), adapt ``dt_fs`` and ``alpha``, then a kick and a
        drift. The power and norms are mesh-wide sums (a **Collective** under DD)."""
        b = self.batch
        f, v = b.forces, b.velocities
        state = self._adaptive()
        sums = self.reducer.sum(
            torch.stack([(f * v).sum(), (f * f).sum(), (v * v).sum()]).to(torch.float64)
        )
        power, f2, v2 = sums.unbind()
        dt_fs, alpha, n_positive = state.unbind()
        uphill = ~(power > 0)  # (NaN power stops too)
        mixing = ~uphill & (f2 > 0)
        # v <- (1 - a) v + a |v| F / |F| downhill, v unchanged without a force, 0 uphill
        keep = torch.where(mixing, 1.0 - alpha, torch.where(uphill, 0.0, 1.0))
        push = torch.where(mixing, alpha * v2.sqrt() / torch.where(mixing, f2, 1.0).sqrt(), 0.0)
        v.mul_(keep.to(v.dtype)).add_(f * push.to(v.dtype))
        grow = ~uphill & (n_positive > self.n_min)
        new_dt = torch.where(grow, (dt_fs * self.f_inc).clamp(max=self.dt_max_fs), dt_fs)
        new_alpha = torch.where(grow, alpha * self.f_alpha, alpha)
        state.copy_(
            torch.stack(
                [
                    torch.where(uphill, dt_fs * self.f_dec, new_dt),
                    torch.where(uphill, self.alpha_start, new_alpha),
                    torch.where(uphill, 0.0, n_positive + 1.0),
                ]
            )
        )
        dt = (state[0] * ASE_TIME_PER_FS).to(v.dtype)
        v.add_(_accel(b) * dt)
        b.positions.add_(v * dt)

    def post_update(self) -> None:
        """Nothing: the whole FIRE step happens in :meth:`pre_update`."""

    def max_force(self) -> float:
        """Largest per-atom force norm over all atoms (a **Collective** under DD)."""
        f = self.batch.forces
        local = (
            f.norm(dim=1).max() if f.shape[0] else torch.zeros((), dtype=f.dtype, device=f.device)
        )
        return float(self.reducer.max(local.reshape(1).to(torch.float64))[0])

    def is_converged(self) -> bool:
        """True when :meth:`max_force` is below ``fmax`` (a **Collective** under DD)."""
        return self.max_force() < self.fmax
