"""What every force provider of a distributed scope shares.

A provider computes forces as the phases of :mod:`nvdd.dynamics._step`
(``open``, ``decide``, ``rebuild``, ``exchange``, ``forward``, ``fold``,
``close``). :class:`ProviderBase` holds what does not depend on the mode: the
model and its spec, the scope's configuration, :class:`DDStats` and the phase
timers, collective counting, the compiled forward, the pending per-system
totals and the non-finite checks. The modes are its subclasses, one per module:

- :class:`~nvdd.dynamics._whole_batch.WholeBatchModel`: one rank, the model on
  the whole batch with its own boundaries (no plan, no exchange);
- :class:`~nvdd.dynamics._distributed_model.DistributedModel`: the halo
  (spatial blocks, ghost rows as explicit periodic images);
- :class:`~nvdd.dynamics._graph_partition.GraphPartitionModel`: graph
  partition (index blocks, the real cell);
- the pipeline variants of the last two (``_pipeline``).

Forces are read from a forward by :func:`~nvdd.dynamics._consolidate.extract_forces`
and the other outputs consolidated by :func:`~nvdd.dynamics._consolidate.consolidate`
in every mode.
"""

from __future__ import annotations

import abc
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from nvdd.core import (
    Batch,
    ConfigurationError,
    ModelOutputs,
    capturing,
    count_collectives,
)
from nvdd.dynamics._compile import CompileMode, check_compilable, compiled_graphs
from nvdd.dynamics._config import DomainConfig
from nvdd.dynamics._consolidate import PendingTotals
from nvdd.dynamics._finite import LazyFiniteCheck
from nvdd.dynamics._step import (
    Reducer,
    StepState,
    compute_forces,
    decision_code,
    read_decision,
)
from nvdd.spec import AdapterRegistry, MLIPSpec, ModelContract, StrategyKind, as_model

if TYPE_CHECKING:
    from nvdd.partition import IndexShardedBatch, ShardedBatch

    #: The state a distributed model runs on: spatial (halo) or index (graph) blocks.
    State = ShardedBatch | IndexShardedBatch

__all__ = ["DDStats", "ProviderBase", "check_strategy", "device_problem"]

_PER_SYSTEM = ("energy", "stress", "virial")


@dataclass
class DDStats:
    """Counters and timings of a distributed model (per process).

    Attributes
    ----------
    calls, rebuilds:
        Forward calls and halo rebuilds so far.
    migrated:
        Atoms this rank sent away at migrations so far.
    n_owned, n_ghost:
        Rows of the current plan.
    last_collectives:
        ``torch.distributed`` calls made by the last forward, by name.
    compile_mode:
        ``"off"``, ``"core"`` (the model compiles its own padded regions) or
        ``"whole"`` (``torch.compile`` of the whole forward).
    compiles:
        Graphs ``torch._dynamo`` compiled during this model's forward calls (first
        compiles and recompiles); constant once the shapes have settled.
    last_compile_call:
        The call (1-based) during which the last graph was compiled (0: none).
    seconds:
        Accumulated wall time per phase: ``check``, ``migrate``, ``plan``,
        ``exchange`` (ghost positions), ``model``, ``fold``, ``reduce``.
    """

    calls: int = 0
    rebuilds: int = 0
    migrated: int = 0
    n_owned: int = 0
    n_ghost: int = 0
    last_collectives: Counter[str] = field(default_factory=Counter)
    compile_mode: str = "off"
    compiles: int = 0
    last_compile_call: int = 0
    seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("check", "migrate", "plan", "exchange", "model", "fold", "reduce"), 0.0
        )
    )


class _Timer:
    def __init__(self, stats: DDStats, sync: bool) -> None:
        self.stats, self.sync = stats, sync

    def __call__(self, phase: str, t0: float) -> float:
        if self.sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        self.stats.seconds[phase] += t1 - t0
        return t1


def _no_hooks(dyn: Any, stage: Any, hooks: Any) -> None:
    """The hook runner of a direct call's state (it runs no hooks)."""


class ProviderBase(abc.ABC):
    """A force provider of a distributed scope (one mode per subclass).

    Parameters
    ----------
    model:
        A :class:`~nvdd.spec.ModelContract` (a ``BaseModelMixin``; any other
        object is completed by :func:`~nvdd.spec.as_model`).
    config:
        The :class:`DomainConfig` of the scope.
    spec:
        Overrides ``model.distribution_spec(config.strategy)``.
    count:
        Count the collectives of every call (:attr:`DDStats.last_collectives`);
        off by default (counting costs a little host time per collective).
    sync_timings:
        Synchronise CUDA before reading phase timers (exact per-phase times for
        benchmarks, slower steps).

    Raises
    ------
    ConfigurationError
        When ``config.strategy`` is not this class's :attr:`strategy`
        (``StrategyKind.HALO``; :class:`GraphPartitionModel` runs
        ``GRAPH_PARTITION``), or the spec's ``distribution.storage`` differs from
        ``config.strategy`` (a spec for one strategy never runs under the other).
    """

    #: The strategy this class runs.
    strategy: ClassVar[StrategyKind] = StrategyKind.HALO

    #: Whether compiles during a CUDA-graph capture are counted in :attr:`stats`.
    _compiles_counted_in_capture: ClassVar[bool] = True

    def __init__(
        self,
        model: Any,
        config: DomainConfig,
        *,
        spec: MLIPSpec | None = None,
        count: bool = False,
        sync_timings: bool = False,
    ) -> None:
        if not isinstance(config, DomainConfig):
            raise ConfigurationError(f"config must be a DomainConfig, got {type(config).__name__}")
        self.model: ModelContract = as_model(model)
        self.config = config
        self.spec = spec if spec is not None else self.model.distribution_spec(config.strategy)
        if not isinstance(self.spec, MLIPSpec):
            raise ConfigurationError(
                f"{type(model).__name__}.distribution_spec returned {self.spec!r}, not an MLIPSpec"
            )
        check_strategy(type(self), config.strategy, self.spec)
        check_compilable(self.model, self.spec, config.compile)
        cutoff = float(self.model.cutoff)
        if cutoff > config.cutoff + 1e-12:
            raise ConfigurationError(
                f"the model's cutoff {cutoff} exceeds DomainConfig.cutoff={config.cutoff}: ghosts "
                "would be missing"
            )
        self.stats = DDStats()
        self.count = count
        self._timer = _Timer(self.stats, sync_timings)
        self._registry = AdapterRegistry(self.spec.adapters())
        self.forward_fn: Any = self.model  # compiled (or not) at attach, released at detach
        self._sharded: State | None = None
        self._finite = LazyFiniteCheck()
        self.pending: PendingTotals | None = None
        # the phases' bookkeeping
        self._counting: AbstractContextManager[Counter[str]] | None = None
        self._counts: Counter[str] = Counter()
        self._graphs_at_open: int | None = None

    # ---------------------------------------------------------------- scope
    @property
    def sync_timings(self) -> bool:
        """Whether phase timers synchronise CUDA first (exact shares, slower steps)."""
        return self._timer.sync

    @sync_timings.setter
    def sync_timings(self, value: bool) -> None:
        self._timer.sync = bool(value)

    @property
    def ghost_width(self) -> float:
        """Halo width the partitioner must use: the config's (plus the spec's extra)
        plus the migration hysteresis (an owned atom may sit that far outside its
        box, and its neighbours must still be ghosts)."""
        return self.config.resolved_ghost_width(self.spec.extra_reach(self.config.cutoff)) + (
            self.config.hysteresis
        )

    @property
    def sharded(self) -> State:
        """The sharded batch this model runs on (after :meth:`attach`)."""
        if self._sharded is None:
            raise ConfigurationError("DistributedModel: call attach(sharded_batch) first")
        return self._sharded

    @abc.abstractmethod
    def attach(self, sharded: State) -> None:
        """Start running on ``sharded``. **Collective** over its group."""

    @abc.abstractmethod
    def detach(self) -> None:
        """Stop running: restore what :meth:`attach` changed."""

    def _release_compiled(self) -> None:
        """Hand a model that compiled its own core back to eager (``compile_forward(None)``)."""
        if self.stats.compile_mode == CompileMode.CORE.value:
            self.model.compile_forward(None)  # idempotent; stats keep how the run compiled
        self.forward_fn = self.model

    @property
    def adapter_statuses(self) -> tuple[Any, ...]:
        """One :class:`~nvdd.spec.AdapterStatus` per adapter of the spec."""
        return self._registry.statuses

    # ------------------------------------------------------------- the step
    def __call__(self, batch: Batch) -> tuple[Batch, ModelOutputs]:
        """Outputs for this rank's owned atoms (a ``ForceProvider``): the phases
        below in one call (:func:`nvdd.dynamics._step.compute_forces`).

        **Collective** over the mesh: every rank calls it once per compute.
        Returns the batch to continue with (rows change when atoms migrate).
        """
        sharded = self.sharded
        if batch is not sharded.local_batch:  # a caller that keeps its own batch
            sharded.local_batch = batch
        # (the integrator's step runs the phases over its own StepState; a
        # direct call gets a state of its own, with no reducer or hooks to use)
        outputs = compute_forces(self, StepState(sharded, self, Reducer(), _no_hooks))
        return sharded.local_batch, outputs

    def open(self, st: StepState) -> None:
        """Phase 0: count this force computation (and its collectives when
        :attr:`count` is set) and start its phase timers."""
        if self.count:
            self._stop_counting()  # (a computation that raised left its counter open)
            self._counting = count_collectives()
            self._counts = self._counting.__enter__()
        st.t0 = time.perf_counter()
        compiling = self.stats.compile_mode != CompileMode.OFF.value
        self._graphs_at_open = compiled_graphs() if compiling else None
        if not capturing():  # (a captured call is counted by each replay)
            self.stats.calls += 1

    @abc.abstractmethod
    def decide(self, st: StepState) -> bool:
        """Phase 1: whether :meth:`rebuild` runs first."""

    @abc.abstractmethod
    def rebuild(self, st: StepState) -> None:
        """Phase 2, when :meth:`decide` said so."""

    @abc.abstractmethod
    def exchange(self, st: StepState) -> None:
        """Phase 3: the positions the model runs on, into ``st.padded``."""

    @abc.abstractmethod
    def forward(self, st: StepState) -> None:
        """Phase 4: the model's raw outputs, into ``st.raw``."""

    @abc.abstractmethod
    def fold(self, st: StepState) -> ModelOutputs:
        """Phase 5: the outputs of the owned rows."""

    def close(self, st: StepState) -> None:
        """Phase 6: drop the step's scratch, note compiles, stop counting."""
        st.padded = st.raw = None
        graphs = self._graphs_at_open
        if graphs is not None and (self._compiles_counted_in_capture or not capturing()):
            now = compiled_graphs()
            if now != graphs:
                self.stats.compiles += now - graphs
                self.stats.last_compile_call = self.stats.calls
        if self._counting is not None:
            self.stats.last_collectives = self._counts
            self._stop_counting()

    def _stop_counting(self) -> None:
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None

    # ---------------------------------------------------- CUDA-graph capture
    @abc.abstractmethod
    def graph_key(self, batch: Batch) -> Hashable | None:
        """What a CUDA-graph capture of a step through this provider bakes in
        (None: not capturable now; ``nvdd.dynamics.StepGraphs``)."""

    @property
    @abc.abstractmethod
    def splits_step(self) -> bool:
        """Whether a captured step is split at :meth:`begin_step` / :meth:`take_verdict`."""

    @abc.abstractmethod
    def begin_step(self, batch: Batch) -> None:
        """Queue this step's decision on the device, unread (capturable)."""

    @abc.abstractmethod
    def take_verdict(self, batch: Batch) -> bool:
        """Read the decision of :meth:`begin_step`: whether the captured rest may run."""

    @abc.abstractmethod
    def request_rebuild(self) -> None:
        """Rebuild at the next call, whatever moved.

        Local, but every rank must call it before the same step (a checkpoint
        does, so that a run and its restart rebuild at the same step).
        """

    def check_finite(self) -> None:
        """Raise on every rank if any rank holds a non-finite position, velocity or
        force. **Collective** over the mesh (one all-reduce of a flag; only on
        failure a gather of the messages). Also reads every flag queued by a
        one-rank step (:class:`LazyFiniteCheck`)."""
        batch, group = self.sharded.local_batch, self.sharded.group
        self._finite.poll(block=True)
        still = torch.zeros((), dtype=torch.int32, device=batch.positions.device)
        read_decision(decision_code(still, None, batch, group), batch, group)

    # ------------------------------------------------------------ on demand
    def materialize(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Per-system totals (summed over ranks) of the last forward's partial outputs.

        **Collective** over the mesh (one all-reduce when something is pending).
        ``names`` default: energy, stress and virial, less those the last
        forward cannot give (a model under the receptive-field spec); naming
        one of those raises :class:`ConfigurationError` with the reason.
        """
        if self.pending is None:
            return {}
        if names is None:
            names = [n for n in _PER_SYSTEM if n not in self.pending.unavailable]
        return self.pending.materialize(names)


def check_strategy(cls: type, strategy: StrategyKind, spec: MLIPSpec) -> None:
    """Raise :class:`ConfigurationError` unless ``cls``, ``strategy`` and ``spec`` agree."""
    runs: StrategyKind = getattr(cls, "strategy", StrategyKind.HALO)
    if strategy is not runs:
        other = "GraphPartitionModel" if runs is StrategyKind.HALO else "DistributedModel"
        raise ConfigurationError(
            f"{cls.__name__} runs {runs}, but DomainConfig.strategy is {strategy}: use "
            f"{other} (DomainParallel picks the right one)"
        )
    storage = spec.distribution.storage
    if storage is not strategy:
        raise ConfigurationError(
            f"the spec {spec.name or '(unnamed)'} declares storage {storage} but "
            f"DomainConfig.strategy is {strategy}: a spec written for one strategy does not run "
            "under the other; ask the model for distribution_spec(config.strategy) or set the "
            "strategy the spec was written for"
        )


def device_problem(model: object, device: torch.device) -> str | None:
    """Why ``model`` cannot run on atoms on ``device`` (its tensors live elsewhere)."""
    if not isinstance(model, torch.nn.Module):
        return None
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device != device:
            return (
                f"the model's tensor {name!r} is on {t.device} but the atoms are on {device}: "
                f"move the model with model.to({str(device)!r}) before DomainParallel"
            )
    return None
