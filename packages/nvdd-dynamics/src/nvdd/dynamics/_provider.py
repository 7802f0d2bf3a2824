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

The ``fold`` phase of every mode reads the outputs of one forward with the
functions below: forces by :func:`extract_forces`, the other outputs by
:func:`consolidate`.

**A forward's outputs -> this rank's share of the truth**: the forces, then the rest.

Forces come out of the raw outputs by :func:`extract_forces` (the model's own,
or ``-dE/dx`` by autograd); every force provider (the whole batch on one rank,
the halo, graph partition, each component of a pipeline) reads them through it,
so the rules and the error messages are the same in every mode.

Every other output is combined by its :class:`~nvdd.spec.OutputSpec`:

============  ============  ==================================================
kind          reduce        what happens
============  ============  ==================================================
PER_NODE      ALL_REDUCE    ghost rows folded into their owners (one reverse
                            exchange), owned rows kept
PER_NODE      OWNED_ONLY    owned rows kept
PER_GRAPH     ALL_REDUCE    kept as this rank's partial; summed over ranks on
                            demand (:meth:`PendingTotals.materialize`)
PER_GRAPH     OWNED_ONLY    kept (already the global value on every rank)
GLOBAL        ALL_REDUCE    summed over ranks now
GLOBAL        OWNED_ONLY    passed through
UNKNOWN       (any)         passed through unchanged, with a one-time warning
============  ============  ==================================================
"""

from __future__ import annotations

import abc
import time
import warnings
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from nvdd.core import (
    Batch,
    ConfigurationError,
    ModelOutputs,
    ValidationError,
    capturing,
    count_collectives,
)
from nvdd.dynamics._collectives import MeshReducer
from nvdd.dynamics._compile import CompileMode, check_compilable, compiled_graphs
from nvdd.dynamics._config import DomainConfig
from nvdd.dynamics._finite import LazyFiniteCheck
from nvdd.dynamics._step import (
    Reducer,
    StepState,
    compute_forces,
    decision_code,
    read_decision,
)
from nvdd.spec import (
    AdapterRegistry,
    ForceStrategy,
    MLIPSpec,
    ModelContract,
    OutputKind,
    Reduce,
    StrategyKind,
    as_model,
    unwrap_model,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nvdd.halo import HaloPlan
    from nvdd.partition import IndexShardedBatch, ShardedBatch

    #: The state a distributed model runs on: spatial (halo) or index (graph) blocks.
    State = ShardedBatch | IndexShardedBatch

__all__ = [
    "DDStats",
    "PendingTotals",
    "ProviderBase",
    "UndeclaredOutputWarning",
    "check_strategy",
    "consolidate",
    "device_problem",
    "extract_forces",
    "folds_forces",
    "output_rules",
]

_PER_SYSTEM = ("energy", "stress", "virial")


# ---------------------------------------------------- the outputs of a forward
class UndeclaredOutputWarning(UserWarning):
    """A model output has no OutputSpec; it is passed through unverified."""


_WARNED: set[tuple[str, str]] = set()


@dataclass(frozen=True, slots=True)
class OutputRules:
    """What consolidation reads of a spec, derived once per spec object so that a
    step calls nothing of it (:func:`output_rules`).

    Attributes
    ----------
    folds_forces:
        :func:`folds_forces` of the spec.
    owned_rows_exact:
        ``spec.owned_rows_exact`` (a receptive-field spec).
    rules:
        ``{output name: (kind, effective reduce)}`` of every declared output.
    """

    folds_forces: bool
    owned_rows_exact: bool
    rules: Mapping[str, tuple[OutputKind, Reduce]]


#: ``id(spec) -> (spec, its rules)`` (the spec is kept, so its id is not reused).
_RULES: dict[int, tuple[MLIPSpec, OutputRules]] = {}
_UNDECLARED = (OutputKind.UNKNOWN, Reduce.NONE)


def output_rules(spec: MLIPSpec) -> OutputRules:
    """The :class:`OutputRules` of ``spec`` (computed at its first use)."""
    hit = _RULES.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    rules = OutputRules(
        folds_forces=spec.folds_forces,
        owned_rows_exact=spec.owned_rows_exact,
        rules={n: (o.kind, o.effective_reduce()) for n, o in spec.outputs.items()},
    )
    _RULES[id(spec)] = (spec, rules)
    return rules


def folds_forces(spec: MLIPSpec) -> bool:
    """Whether ghost-row forces are folded into their owners under ``spec``
    (:func:`output_rules`)."""
    return output_rules(spec).folds_forces


def _fold(x: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
    n = plan.n_owned
    if x.shape[0] != plan.n_padded:
        raise ValueError(
            f"per-node output has {x.shape[0]} rows, expected n_padded={plan.n_padded}"
        )
    return x[:n] + plan.reverse(x[n:])


def consolidate(
    outputs: Mapping[str, Any],
    spec: MLIPSpec,
    plan: HaloPlan,
    group: ProcessGroup | None,
    *,
    skip: Iterable[str] = (),
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Combine one forward's outputs; returns ``(final, partial_per_graph)``.

    **Collective** over ``group`` when an output needs a fold (one reverse
    exchange each) or is a GLOBAL all-reduce. PER_GRAPH partials are returned
    separately, not reduced (see :class:`PendingTotals`).
    """
    final: dict[str, Any] = {}
    partial: dict[str, torch.Tensor] = {}
    skipped = set(skip)
    table = output_rules(spec).rules
    for name, value in outputs.items():
        if name in skipped:
            continue
        kind, rule = table.get(name, _UNDECLARED)
        if not isinstance(value, torch.Tensor):
            final[name] = value
            continue
        if kind is OutputKind.UNKNOWN:
            key = (spec.name, name)
            if key not in _WARNED:
                _WARNED.add(key)
                warnings.warn(
                    f"output {name!r} of {spec.name or 'the model'} has no OutputSpec; it is "
                    "passed through unchanged (declare it to make it exact under DD)",
                    UndeclaredOutputWarning,
                    stacklevel=3,
                )
            final[name] = value
        elif kind is OutputKind.PER_NODE:
            final[name] = _fold(value, plan) if rule is Reduce.ALL_REDUCE else value[: plan.n_owned]
        elif kind is OutputKind.PER_GRAPH:
            if rule is Reduce.ALL_REDUCE:
                partial[name] = value
            else:
                final[name] = value
        elif rule is Reduce.ALL_REDUCE:  # GLOBAL
            final[name] = MeshReducer(group).sum(value)
        else:
            final[name] = value
    return final, partial


class PendingTotals:
    """Per-system partial sums kept until someone needs the totals.

    Reducing a step's energy costs an all-reduce; an NVE step that no hook
    inspects does not need it. :meth:`materialize` sums every pending partial
    over the mesh in ONE all-reduce (**Collective**: every rank calls it at the
    same point, which holds because hooks are registered on every rank alike).
    """

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self._partials: dict[str, torch.Tensor] = {}
        self._base: dict[str, torch.Tensor] = {}
        self._totals: dict[str, torch.Tensor] = {}
        #: ``{name: why}`` of totals the last forward cannot give (a model under
        #: the receptive-field spec); asking for one by name raises
        self.unavailable: dict[str, str] = {}

    def _refuse(self, names: Iterable[str]) -> None:
        for n in names:
            if n in self.unavailable:
                raise ConfigurationError(self.unavailable[n])

    def set(
        self,
        partials: Mapping[str, torch.Tensor],
        base: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Replace the pending partials with one forward's (totals become stale).

        ``base`` holds values already global on every rank that are added to the
        reduced partials of the same name (a pipeline mixing both kinds).
        """
        self._partials = {k: v.detach() for k, v in partials.items()}
        self._base = {k: v.detach() for k, v in (base or {}).items()}
        self._totals = {}

    def partials(self) -> dict[str, torch.Tensor]:
        """The unreduced partials (no communication)."""
        return dict(self._partials)

    @property
    def pending(self) -> frozenset[str]:
        """Names whose partials are not reduced yet."""
        return frozenset(k for k in self._partials if k not in self._totals)

    def materialize(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Totals of ``names`` (default: all), reducing what is still pending.

        **Collective** over :attr:`group` when something is pending.
        """
        if names is not None:
            names = list(names)
            self._refuse(names)
        want = [n for n in (self._partials if names is None else names) if n in self._partials]
        todo = sorted(n for n in want if n not in self._totals)
        if todo:
            flat = [self._partials[n].reshape(-1) for n in todo]
            self._store(todo, MeshReducer(self.group).sum(torch.cat(flat)))
        return {n: self._totals[n] for n in want}

    def materialize_with(
        self, extra: torch.Tensor, names: Iterable[str]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``extra`` summed over ranks, and the totals of ``names``, in ONE all-reduce.

        **Collective** over :attr:`group`: every rank calls it with the same
        names and an ``extra`` of the same shape. The buffer is float64 (each
        total is cast back to its partial's dtype); totals already reduced are
        reused, not sent again.

        Returns
        -------
        (torch.Tensor, dict)
            ``extra`` summed (float64, its shape) and the totals of the
            ``names`` that are pending partials.
        """
        names = list(names)
        self._refuse(names)
        want = [n for n in names if n in self._partials]
        todo = sorted(n for n in want if n not in self._totals)
        head = extra.detach().reshape(-1).to(torch.float64)
        flat = [self._partials[n].reshape(-1).to(head.device, torch.float64) for n in todo]
        buf = MeshReducer(self.group).sum(torch.cat([head, *flat]))
        if todo:
            tail = buf[head.numel() :]
            self._store(todo, tail, cast=True)
        summed = buf[: head.numel()].reshape(extra.shape)
        return summed, {n: self._totals[n] for n in want}

    def _store(self, names: list[str], buf: torch.Tensor, cast: bool = False) -> None:
        offset = 0
        for n in names:
            partial = self._partials[n]
            total = buf[offset : offset + partial.numel()].reshape(partial.shape)
            if cast:
                total = total.to(device=partial.device, dtype=partial.dtype)
            self._totals[n] = total + self._base[n] if n in self._base else total
            offset += partial.numel()


# ------------------------------------------------------------------ forces
def extract_forces(
    raw: dict[str, Any], positions: torch.Tensor, strategy: ForceStrategy, model: ModelContract
) -> torch.Tensor:
    """Take the forces out of ``raw`` (popped), detached, one row per position.

    The model's ``forces`` when it returns them (whatever ``strategy`` says);
    otherwise, under ``ForceStrategy.AUTOGRAD``, ``-d(sum energy)/d positions``
    (zeros when the energy does not depend on ``positions``).

    Parameters
    ----------
    raw:
        The forward's outputs by name (a mutable copy: ``forces`` is removed).
    positions:
        The positions the model ran on, shape ``(n_rows, 3)``: the autograd
        leaf when ``strategy`` is ``AUTOGRAD``.
    strategy:
        The spec's :class:`~nvdd.spec.ForceStrategy`.
    model:
        The model that returned ``raw`` (named in errors).

    Returns
    -------
    torch.Tensor
        Shape ``positions.shape``, detached.

    Raises
    ------
    ValidationError
        When ``raw`` holds neither ``forces`` nor (under ``AUTOGRAD``) an
        ``energy``, or the forces do not have one row per position.
    """
    if "forces" in raw:
        forces = raw.pop("forces")
    elif strategy is ForceStrategy.AUTOGRAD and "energy" in raw:
        (grad,) = torch.autograd.grad(raw["energy"].sum(), positions, allow_unused=True)
        forces = -grad if grad is not None else torch.zeros_like(positions)
    else:
        raise ValidationError(
            f"{_name(model)} returned neither 'forces' nor a differentiable 'energy' "
            f"(got {sorted(raw)}) under {strategy}"
        )
    if forces.shape != positions.shape:
        raise ValidationError(
            f"{_name(model)}: forces have shape {tuple(forces.shape)}, expected one row per "
            f"position {tuple(positions.shape)}"
        )
    out: torch.Tensor = forces.detach()
    return out


def _name(model: ModelContract) -> str:
    return type(unwrap_model(model)).__name__


# ------------------------------------------------------------ the providers


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
