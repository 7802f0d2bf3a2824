"""`BaseDynamics`: the single-process integrator skeleton with hooks.

A step is ``pre_update`` -> ``compute`` -> ``post_update``, with hooks around each
stage. Forces at t = 0 are computed before the first ``pre_update``. The same
class runs unchanged under :class:`~nvdd.dynamics.DomainParallel`, which swaps in a
distributed force provider, a mesh-wide :class:`Reducer`, and its hook runner.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Protocol

import torch

from nvdd.core import Batch, ConfigurationError, ModelOutputs, ValidationError, get_rank
from nvdd.dynamics._graph_step import StepGraphs
from nvdd.dynamics._hooks import Hook, HookContext, HookScope, HookStage
from nvdd.spec import ModelContract, as_model

__all__ = [
    "ASE_TIME_PER_FS",
    "KB_EV_PER_K",
    "PER_ATOM_OUTPUTS",
    "BaseDynamics",
    "ForceProvider",
    "ModelForceProvider",
    "Reducer",
    "StateOwner",
]

#: One femtosecond in ASE time units (Angstrom * sqrt(amu / eV)).
ASE_TIME_PER_FS = 0.09822694788464063
#: Boltzmann constant, eV / K.
KB_EV_PER_K = 8.617333262e-5

_ENERGY_KEYS = ("energy", "stress")
#: Per-atom model outputs the integrator keeps in ``batch.atom_extras`` when the
#: model returns them (they migrate with their atoms and reach hooks and
#: trajectory writers): ``atom_energies`` ``(n_atoms,)`` and ``atom_virials``
#: ``(n_atoms, 3, 3)`` (summing to the system virial, ``-dE/d strain``; only
#: models that say so return them, e.g. ``LJConfig(atom_virials=True)``). A hook
#: may name them in ``needs``: a model that does not return one is then an error.
PER_ATOM_OUTPUTS = ("atom_energies", "atom_virials")


class Reducer:
    """Sums and maxima of small tensors over every atom of the system.

    The single-process reducer is the identity; the distributed one (set by
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
    """Computes model outputs for the integrator's batch.

    Returns the batch to continue with (a distributed provider may migrate atoms
    and return different owned rows) and the outputs for its rows. Forces are
    always returned; a distributed provider may leave out per-system totals that
    need a reduction (they are reduced on demand, when a hook needs them).
    """

    def __call__(self, batch: Batch) -> tuple[Batch, ModelOutputs]: ...


class StateOwner(Protocol):
    """Holds an integrator's atom state (``local_batch``, read and written).

    On one process the integrator owns it; under ``DomainParallel`` the
    :class:`~nvdd.partition.ShardedBatch` does, so migration and the integrator
    never hold two copies that must be re-synced.
    """

    local_batch: Batch


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


HookRunner = Callable[["BaseDynamics", HookStage, list[Hook]], None]


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
        self._state: StateOwner = _OwnState(own)
        self.dt_fs = float(dt_fs)
        self.step_count = 0
        self.converged = False
        self.hooks: list[Hook] = list(hooks)
        self.reducer: Reducer = Reducer()
        self.force_provider: ForceProvider = ModelForceProvider(model)
        self.hook_runner: HookRunner = _run_hooks_locally
        #: Outputs of the last force computation that are whole on this process
        #: (under DD, per-system partials are not here until reduced).
        self.outputs: dict[str, torch.Tensor] = {}
        #: Called with ``(step_count, phase)`` at every hook stage (phase: the
        #: stage's value), whether or not hooks are due, and again after due hooks
        #: ran (``"<stage> hooks done"``): progress beats for a watchdog (set by
        #: DomainParallel), so a rank stuck in a hook falls behind the others.
        self.heartbeat: Callable[[int, str], None] | None = None
        self._forces_ready = False
        #: Capture and replay of steady steps (CUDA graphs).
        self.graphs = StepGraphs(self, cuda_graphs)

    # ---------------------------------------------------------------- state
    @property
    def batch(self) -> Batch:
        """The atoms this integrator advances (this rank's owned atoms under DD)."""
        return self._state.local_batch

    @batch.setter
    def batch(self, batch: Batch) -> None:
        self._state.local_batch = batch

    def attach_state(self, owner: StateOwner | None) -> None:
        """Keep the atom state in ``owner`` from now on (``None``: in this object,
        starting from the owner's current batch). ``DomainParallel`` attaches its
        :class:`~nvdd.partition.ShardedBatch`."""
        self._state = _OwnState(self.batch) if owner is None else owner

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

    def _fire(self, stage: HookStage) -> None:
        beat = self.heartbeat
        if beat is not None:
            beat(self.step_count, stage.value)
        due = [h for h in self.hooks if h.stage is stage and h.due(self.step_count)]
        if due:
            self._check_per_atom_needs(stage, due)
            self.hook_runner(self, stage, due)
            if beat is not None:
                beat(self.step_count, f"{stage.value} hooks done")

    def _check_per_atom_needs(self, stage: HookStage, hooks: list[Hook]) -> None:
        """Raise if a due hook needs a per-atom output the model did not return.

        Local: every rank holds the same model, so every rank raises together.
        """
        kept = self.batch.atom_extras
        for hook in hooks:
            missing = sorted(n for n in hook.needs if n in PER_ATOM_OUTPUTS and n not in kept)
            if missing:
                name = getattr(hook.fn, "__name__", hook.fn)
                raise ConfigurationError(
                    f"rank {get_rank()}: a {stage.value} hook ({name!r}) "
                    f"needs {missing}, which {type(self.model).__name__} does not return (its "
                    f"outputs: {sorted(self.outputs)}); per-atom virials come from models that "
                    "say so, e.g. LennardJones(LJConfig(..., atom_virials=True))"
                )

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
        :attr:`outputs`."""
        batch, out = self.force_provider(self.batch)
        if "forces" not in out:
            raise ValidationError(
                f"{type(self.model).__name__} returned no 'forces' (got {sorted(out)})"
            )
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
        self.batch = batch.replace(**fields)
        self.outputs = outputs
        self._forces_ready = True

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
        if not self._forces_ready:
            self.compute()

    def step(self) -> None:
        """One step with every hook stage."""
        self.ensure_forces()
        self._fire(HookStage.BEFORE_STEP)
        if not self.graphs.run_step():  # a replay of the captured middle, when steady
            self._fire(HookStage.BEFORE_PRE_UPDATE)
            self.pre_update()
            self._fire(HookStage.AFTER_PRE_UPDATE)
            self._fire(HookStage.BEFORE_COMPUTE)
            self.compute()
            self._fire(HookStage.AFTER_COMPUTE)
            self._fire(HookStage.BEFORE_POST_UPDATE)
            self.post_update()
            self._fire(HookStage.AFTER_POST_UPDATE)
        self.step_count += 1
        self._fire(HookStage.AFTER_STEP)
        if self.is_converged():
            self.converged = True
            self._fire(HookStage.ON_CONVERGE)

    def run(self, n_steps: int) -> bool:
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
            self.ensure_forces()
            if self.is_converged():
                self.converged = True
                self._fire(HookStage.ON_CONVERGE)
                return True
        for _ in range(n_steps):
            self.step()
            if self.converged:
                break
        return self.converged
