"""`DistributedModel`: one model forward on this rank's ``[owned | ghost]`` rows.

Per force computation, one method per phase of :mod:`nvdd.dynamics._step`
(``__call__`` runs them in order):

1. :meth:`~DistributedModel.decide`: one all-reduce of a flag: did any owned
   atom move (in the frame that follows the cell) more than half the skin the
   cell's strain left since the last build (:func:`nvdd.core.skin_exceeded`)?
2. :meth:`~DistributedModel.rebuild`, if so: migrate atoms that left their box
   and rebuild the halo plan (Verlet-style reuse otherwise);
3. :meth:`~DistributedModel.exchange`: one forward exchange of ghost positions
   (image shifts from the current cell);
4. :meth:`~DistributedModel.forward`: the model on the padded rows, open
   boundaries, inside the DD context;
5. :meth:`~DistributedModel.fold`: consolidation by the spec: forces folded
   (one reverse exchange), per-system partials kept until a hook needs them.

So a step that rebuilds nothing costs two ``all_to_all_single`` and one small
all-reduce (plus what the model itself asks for, e.g. ``system_sum``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from nvdd.core import (
    Batch,
    CaptureError,
    ConfigurationError,
    ModelOutputs,
    TensorMemo,
    after_replay,
    capturing,
    count_collectives,
    get_rank,
    raise_if_any_rank,
    skin_exceeded,
)
from nvdd.dynamics._compile import CompileMode, check_compilable, compiled_forward, compiled_graphs
from nvdd.dynamics._config import DomainConfig
from nvdd.dynamics._consolidate import PendingTotals, consolidate, folds_forces
from nvdd.dynamics._extract import extract_forces
from nvdd.dynamics._finite import LazyFiniteCheck, nonfinite_flag
from nvdd.dynamics._receptive import check_reach, owned_energy_forces, owned_row_outputs
from nvdd.dynamics._step import StepState, compute_forces
from nvdd.dynamics._step_decision import (
    MODEL_GROWS,
    REBUILD,
    STEADY,
    decision_code,
    read_decision,
)
from nvdd.halo import HaloPlan, build_halo_plan
from nvdd.partition import ShardedBatch, SpatialPartitioner
from nvdd.shardtensor import DDContext, dd_scope
from nvdd.spec import (
    AdapterRegistry,
    ForceStrategy,
    MLIPSpec,
    ModelContract,
    StrategyKind,
    as_model,
    begins_steps,
    unwrap_model,
)

if TYPE_CHECKING:
    from nvdd.partition import IndexShardedBatch

    #: The state a distributed model runs on: spatial (halo) or index (graph) blocks.
    State = ShardedBatch | IndexShardedBatch

__all__ = ["DDStats", "DistributedModel"]

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


class DistributedModel:
    """Wrap a single-process model wrapper for domain-decomposed inference.

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
        _check_strategy(type(self), config.strategy, self.spec)
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
        # only a model with its own begin_step may split its steps (read once)
        self._begins = begins_steps(self.model)
        self._sharded: State | None = None
        self._plan: HaloPlan | None = None
        self._static: Batch | None = None
        self._open_pbc: torch.Tensor | None = None  # all-False pbc of the padded batch
        self._ref_positions: torch.Tensor | None = None
        self._ref_cell: torch.Tensor | None = None
        # (partitioner, its domain cell of _ref_cell): derived once per build
        self._ref_domain: tuple[object, torch.Tensor] | None = None
        self._cell_at_build = TensorMemo()
        # the partitioner the plan was built for: another one (a rebalance
        # re-cut the boxes) forces a rebuild whatever the atoms did
        self._built_for: object = None
        self._version = 0
        self._whole = False
        self._finite = LazyFiniteCheck()
        self.pending: PendingTotals | None = None
        # a split step (StepGraphs): the rebuild code queued by begin_step, and
        # the decision take_verdict read from it for the next call
        self._code: torch.Tensor | None = None
        # (plan version, padded positions) exchanged by _begin_model_step: the
        # forwards of that plan reuse them instead of exchanging again (every
        # step of a model that splits its steps begins with that search)
        self._head_padded: tuple[int, torch.Tensor] | None = None
        self._decided: bool | None = None
        # __call__'s state of the step phases, and the phases' bookkeeping
        self._st: StepState | None = None
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
    def plan(self) -> HaloPlan:
        """The current halo plan (after :meth:`attach`)."""
        if self._whole:
            raise ConfigurationError(
                "a world of one rank runs the model on the whole batch and has no halo plan "
                "(DomainConfig(halo_on_one_rank=True) builds one)"
            )
        if self._plan is None:
            raise ConfigurationError("DistributedModel: call attach(sharded_batch) first")
        return self._plan

    @property
    def sharded(self) -> State:
        """The sharded batch this model runs on (after :meth:`attach`)."""
        if self._sharded is None:
            raise ConfigurationError("DistributedModel: call attach(sharded_batch) first")
        return self._sharded

    def attach(self, sharded: State) -> None:
        """Start running on ``sharded``: install the spec's adapters, build the plan.

        **Collective** over the sharded batch's group.
        """
        raise_if_any_rank(
            _device_problem(unwrap_model(self.model), sharded.local_batch.device),
            sharded.group,
            exc_type=ConfigurationError,
        )
        self._sharded = sharded
        self.pending = PendingTotals(sharded.group)
        self._whole = self._runs_whole(sharded)
        if self._whole:  # one rank: no decomposition, no adapters, no plan
            self.stats.n_owned, self.stats.n_ghost = sharded.n_owned, 0
            self.forward_fn, mode = compiled_forward(
                self.model, self.spec, self.config.compile, get_rank()
            )
            self.stats.compile_mode = mode.value
            return
        check_reach(
            self.spec,
            sharded.local_batch,
            self.ghost_width,
            type(unwrap_model(self.model)).__name__,
        )
        self._registry.install()
        try:
            self.forward_fn, mode = compiled_forward(
                self.model, self.spec, self.config.compile, get_rank()
            )
            self.stats.compile_mode = mode.value
            self._rebuild(sharded.local_batch, migrate=False)
            self.model.distributed_setup(self._context(self.plan, None))
        except BaseException:
            self._release_compiled()
            self._registry.restore()
            raise

    #: Whether a world of one rank may run the model on the whole batch.
    _single_rank_passthrough = True

    def _runs_whole(self, sharded: State) -> bool:
        return (
            self._single_rank_passthrough
            and sharded.world_size == 1
            and not self.config.halo_on_one_rank
            and self.spec.strategy is StrategyKind.HALO
        )

    def detach(self) -> None:
        """Restore the adapters and call the model's ``distributed_teardown`` (and
        ``compile_forward(None)`` when the model compiled its own core)."""
        self._release_compiled()
        if self._whole:
            self._sharded = None
            self._whole = False
            return
        try:
            if self._sharded is not None:
                self.model.distributed_teardown()
        finally:
            self._registry.restore()
            self._sharded = None

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
        st = self._st
        if st is None or st.owner is not sharded:
            st = self._st = StepState(sharded)
        outputs = compute_forces(self, st)
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

    def decide(self, st: StepState) -> bool:
        """Phase 1: whether atoms migrate and the halo is rebuilt first.

        **Collective** over the mesh: one small all-reduce of the step's code
        (Verlet criterion, a model's overflow, a non-finite value anywhere:
        :meth:`_skin_used_up`), unless :meth:`take_verdict` read it already;
        raises on every rank together on NaN/inf. One rank running the whole
        batch decides nothing: its non-finite flags are queued and read later
        (no host sync).
        """
        batch = st.batch
        if self._whole:
            if capturing():  # a CUDA-graph capture (see graph_key)
                flag = nonfinite_flag(batch)  # recomputed by every replay
                after_replay(lambda: self._replayed_whole(flag))
                return False
            self._finite.push(batch)
            if self._finite.poll():
                self.check_finite()
            st.t0 = self._timer("check", st.t0)
            return False
        rebuild, self._decided = self._decided, None  # (decided by take_verdict)
        if rebuild is None:
            rebuild = self._skin_used_up(batch)
        st.t0 = self._timer("check", st.t0)
        if rebuild and capturing():
            raise CaptureError("DistributedModel: a step that rebuilds the halo")
        return rebuild

    def rebuild(self, st: StepState) -> None:
        """Phase 2, when :meth:`decide` said so: migrate the atoms that left their
        box (``st.batch`` then holds the new rows), build the new halo plan and
        the padded batch's rows that do not move. **Collective** over the mesh."""
        self._rebuild(st.batch, migrate=True)
        st.t0 = time.perf_counter()

    def exchange(self, st: StepState) -> None:
        """Phase 3: the ``[owned | ghost]`` positions into ``st.padded``.

        **Collective** under the halo: one forward exchange of the ghost
        positions (image shifts from the batch's cell), unless this step's head
        (:meth:`begin_step`) exchanged them already, so an eager step and a
        replayed one make the same exchanges. One rank running the whole batch:
        its own positions.
        """
        local = st.batch
        autograd = self.spec.force_strategy is ForceStrategy.AUTOGRAD
        if self._whole:
            pos = local.positions.detach()
            st.padded = pos.clone().requires_grad_(True) if autograd else pos
            return
        head = self._head_padded
        if head is not None and head[0] == self._version:
            padded = head[1]
        else:
            padded = self._padded_positions(self.plan, local)
        if autograd:
            padded.requires_grad_(True)
        st.padded = padded
        st.t0 = self._timer("exchange", st.t0)

    def forward(self, st: StepState) -> None:
        """Phase 4: the model on the padded rows, into ``st.raw`` (under the
        halo: open boundaries, inside the DD context; one rank running the whole
        batch: the batch with its own boundaries)."""
        local = st.batch
        autograd = self.spec.force_strategy is ForceStrategy.AUTOGRAD
        if self._whole:
            with torch.set_grad_enabled(autograd or torch.is_grad_enabled()):
                st.raw = dict(self.forward_fn(local.replace(positions=st.padded)))
            st.t0 = self._timer("model", st.t0)
            return
        plan, static = self.plan, self._static
        assert static is not None
        padded = st.padded
        padded_batch = static.replace(positions=padded, cell=local.cell)
        with (
            dd_scope(self._context(plan, padded)),
            torch.set_grad_enabled(autograd or torch.is_grad_enabled()),
        ):
            st.raw = dict(self.forward_fn(padded_batch))
        st.t0 = self._timer("model", st.t0)

    def fold(self, st: StepState) -> ModelOutputs:
        """Phase 5: the outputs of the owned rows: ghost forces folded to their
        owners (one reverse exchange) and the other outputs consolidated as the
        spec says (per-system partials kept in :attr:`pending`)."""
        if self._whole:
            return self._fold_whole(st)
        outputs = self._consolidate(st.raw, st.padded, st.t0)
        if capturing():  # the host work of every replay of this call
            assert self.pending is not None
            partials, version = self.pending.partials(), self._version
            after_replay(lambda: self._replayed_halo(version, partials))
        return outputs

    def close(self, st: StepState) -> None:
        """Phase 6: drop the step's scratch, note compiles, stop counting."""
        st.padded = st.raw = None
        graphs = self._graphs_at_open
        if graphs is not None and not (self._whole and capturing()):
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

    #: Whether steady steps of the halo path may be captured (subclasses that
    #: run another step opt out).
    _captures_halo_steps: ClassVar[bool] = True

    def graph_key(self, batch: Batch) -> Hashable | None:
        """Whether a step through this provider may be captured in a CUDA graph
        (``nvdd.dynamics.StepGraphs``): uncompiled, without collective counting
        or synchronised timers, and only when the model opts in (its
        ``graph_key(batch)``; under the halo it is asked inside the DD context,
        on the padded rows). A world of one running the whole batch captures
        whole steps; the halo path (:attr:`splits_step`) captures a steady step
        as two graphs around its rebuild decision, and the key changes with
        every plan (a rebuild drops the graphs)."""
        if self.count or self.sync_timings:
            return None
        if self.stats.compile_mode == CompileMode.WHOLE.value:
            return None  # (the model's own compiled core: captured when it says so)
        if self._whole:
            inner = self.model.graph_key(batch)
            return None if inner is None else ("whole batch", inner)
        plan, static = self._plan, self._static
        if not self._captures_halo_steps or plan is None or static is None:
            return None
        if self._ref_positions is None or self._stale_partition():
            return None  # (the next call rebuilds)
        with dd_scope(self._context(plan, None)):
            inner = self.model.graph_key(static)
        if inner is None:
            return None
        return ("halo", self._version, self._cell_at_build.same(batch.cell), inner)

    @property
    def splits_step(self) -> bool:
        """Whether a captured step must be split at this provider's rebuild
        decision (:meth:`begin_step`, :meth:`take_verdict`): the halo path, or a
        world of one running the whole batch through a model that splits its
        own steps (the MPNN on its device edges)."""
        if self._whole:
            return bool(self.model.splits_step)
        return self._plan is not None

    def begin_step(self, batch: Batch) -> None:
        """Queue this step's rebuild decision on the device, unread (capturable).

        **Collective** over the mesh: the one small all-reduce of the step (see
        :meth:`_skin_used_up`). :meth:`take_verdict` reads it; the next call then
        skips its own check. A world of one running the whole batch calls the
        model's own ``begin_step`` instead (local).
        """
        if self._whole:  # the model's own decision (e.g. its edge buffers fit)
            self.model.begin_step(batch)
            return
        self._code = self._verdict_code(batch, self._begin_model_step(batch))

    def _begin_model_step(self, batch: Batch) -> torch.Tensor | None:
        """A model that splits its own steps (the MPNN on its device edges)
        searches its edges here, on the padded rows with current ghosts, and
        its overflow flag joins the step's decision (so a captured tail never
        runs on edges that did not fit). None for any other model.

        **Collective** (one ghost exchange) when the model splits its steps.
        """
        plan, static = self._plan, self._static
        if not self._begins or plan is None or static is None or self._stale_partition():
            return None  # (no such model, or the step rebuilds anyway)
        with dd_scope(self._context(plan, None)):  # (the same answer on every rank)
            if not self.model.splits_step:
                return None
        padded = self._padded_positions(plan, batch)
        self._head_padded = (self._version, padded)
        padded_batch = static.replace(positions=padded, cell=batch.cell)
        with dd_scope(self._context(plan, padded)):
            self.model.begin_step(padded_batch)
        return self.model.overflow_flag()

    def take_verdict(self, batch: Batch) -> bool:
        """Read the decision queued by :meth:`begin_step` (one host read): True
        when the plan still holds (a captured rest of the step may run), False
        when the next call must migrate and rebuild. Raises on every rank
        together when some rank holds a non-finite value (as the call would).
        """
        if self._whole:
            return bool(self.model.take_verdict(batch))
        if self._code is None:
            raise CaptureError("DistributedModel.take_verdict before begin_step")
        verdict = self._read_code(self._code, batch)
        self._decided = verdict == REBUILD
        if verdict == MODEL_GROWS:  # some rank's model buffers overflowed: it grows,
            self.model.take_verdict(batch)  # (a local read) and this step runs eagerly
        return verdict == STEADY

    def _replayed_halo(self, version: int, partials: dict[str, torch.Tensor]) -> bool:
        """After a replay of a halo call: count it and make its per-system
        partials the pending ones; False once the plan it used is gone."""
        self.stats.calls += 1
        self._decided = None  # (the replay consumed the decision, as a call would)
        assert self.pending is not None
        self.pending.set(partials)
        return self._version == version

    def _replayed_whole(self, flag: torch.Tensor) -> bool:
        """After a replay: count the call and queue its non-finite flag."""
        self.stats.calls += 1
        self._finite.push_flag(flag)
        if self._finite.poll():
            self.check_finite()
        return True

    def request_rebuild(self) -> None:
        """Migrate and rebuild the halo plan at the next call, whatever moved.

        Local, but every rank must call it before the same step (a checkpoint
        does, so that a run and its restart rebuild at the same step).
        """
        self._ref_positions = None

    def check_finite(self) -> None:
        """Raise on every rank if any rank holds a non-finite position, velocity or
        force. **Collective** over the mesh (one all-reduce of a flag; only on
        failure a gather of the messages). Also reads every flag queued by a
        one-rank step (:class:`LazyFiniteCheck`)."""
        batch, group = self.sharded.local_batch, self.sharded.group
        self._finite.poll(block=True)
        still = torch.zeros((), dtype=torch.int32, device=batch.positions.device)
        read_decision(decision_code(still, None, batch, group), batch, group)

    def _skin_used_up(self, batch: Batch) -> bool:
        """Whether any rank must migrate and rebuild its plan (Verlet criterion).

        **Collective** over the mesh: :meth:`_verdict_code` (with the model's
        own search first when it splits its steps, so that an eager step issues
        the collectives of a replayed one), then one host read.
        """
        verdict = self._read_code(self._verdict_code(batch, self._begin_model_step(batch)), batch)
        if verdict == MODEL_GROWS:
            self.model.take_verdict(batch)  # the overflowing rank grows (a local read)
        return verdict == REBUILD

    def _verdict_code(self, batch: Batch, model_flag: torch.Tensor | None = None) -> torch.Tensor:
        """The step's decision as a device integer, reduced over ranks (no host
        read; the codes of ``_step_decision``): ``REBUILD`` when some owned atom
        moved more than half the skin left since the last build (the cell's
        strain eats into it; always with ``skin == 0``), ``MODEL_GROWS`` when
        ``model_flag`` is set on some rank, ``NONFINITE`` when some rank holds a
        non-finite position, velocity or force (the previous step's).

        **Collective** over the mesh: ONE all-reduce (max) of one small integer.
        """
        pos = batch.positions.detach()
        ref, ref_cell = self._ref_positions, self._ref_cell
        skin = self.config.skin
        part = self.sharded.partitioner
        if (
            ref is None
            or ref_cell is None
            or ref.shape != pos.shape
            or skin == 0
            or self._stale_partition()
        ):
            moved = torch.ones((), dtype=torch.int32, device=pos.device)
        elif not isinstance(part, SpatialPartitioner):  # index blocks: displacements only
            d2 = ((pos - ref) ** 2).sum(dim=1).amax() if pos.shape[0] else pos.new_zeros(())
            moved = (d2 > (0.5 * skin) ** 2).to(torch.int32)
        else:  # strain since the build eats into the skin (nvdd.core.skin_exceeded)
            reach = self.ghost_width - self.config.hysteresis - skin
            if self._ref_domain is None or self._ref_domain[0] is not part:
                self._ref_domain = (part, part.domain_cell(ref_cell))  # once per build
            ref_dom = self._ref_domain[1]
            same = self._cell_at_build.same(batch.cell)  # the build's cell, unmodified
            moved = skin_exceeded(
                pos,
                ref,
                batch.system_index,
                ref_dom,
                ref_dom if same else part.domain_cell(batch.cell),
                cutoff=reach,
                skin=skin,
                same_cell=same,
            ).to(torch.int32)
        return decision_code(moved, model_flag, batch, self.sharded.group)

    def _stale_partition(self) -> bool:
        """Whether the sharded batch's partitioner is not the one the plan was
        built for (``ShardedBatch.rebalance`` re-cut the boxes): the same on
        every rank, since every rank holds the broadcast partitioner."""
        return getattr(self.sharded, "partitioner", None) is not self._built_for

    def _read_code(self, code: torch.Tensor, batch: Batch) -> int:
        """The host read of :meth:`_verdict_code` (:func:`read_decision`)."""
        return read_decision(code, batch, self.sharded.group)

    def _rebuild(self, local: Batch, *, migrate: bool) -> None:
        sharded = self.sharded
        if not isinstance(sharded, ShardedBatch):
            raise ConfigurationError(
                f"{type(self).__name__} (StrategyKind.HALO) runs on a ShardedBatch, got "
                f"{type(sharded).__name__}"
            )
        t0 = time.perf_counter()
        if migrate:
            stats = sharded.migrate(self.config.hysteresis)
            self.stats.migrated += int(getattr(stats, "n_sent", 0))
            t0 = self._timer("migrate", t0)
        local = sharded.local_batch
        part = sharded.partitioner
        plan = build_halo_plan(
            part.halo_config(sharded.group),
            local.positions.detach(),
            local.atom_ids,
            local.system_index,
            part.domain_cell(local.cell),
        )
        # ghosts are explicit images: open boundaries, one tensor kept across
        # rebuilds (a model reads a pbc tensor it has not seen on the host)
        pbc = self._open_pbc
        if pbc is None or pbc.shape != local.pbc.shape or pbc.device != local.pbc.device:
            pbc = self._open_pbc = torch.zeros_like(local.pbc)
        self._install(local, plan, pbc)
        self.stats.n_owned, self.stats.n_ghost = plan.n_owned, plan.n_ghost
        self._timer("plan", t0)

    def _install(self, local: Batch, plan: HaloPlan, pbc: torch.Tensor) -> None:
        """Make ``plan`` current: the padded batch's fields that do not move (one
        packed exchange), the Verlet reference positions, a new topology version.

        **Collective** over the plan's group. ``pbc``: the padded batch's
        boundaries (open under the halo, the real ones under graph partition).
        """
        # Fields the model reads at neighbours but that do not move: exchanged once.
        extras = [f for f in self.spec.distribution.sharded_fields if f in local.atom_extras]
        ghosts = plan.forward_many(
            [local.atomic_numbers, local.masses, *(local.atom_extras[f] for f in extras)]
        )
        n_ghost = plan.n_ghost
        zeros3 = local.positions.new_zeros(n_ghost, 3)
        self._static = Batch(
            positions=torch.cat([local.positions.detach(), zeros3]),
            atomic_numbers=torch.cat([local.atomic_numbers, ghosts[0]]),
            masses=torch.cat([local.masses, ghosts[1]]),
            velocities=torch.cat([local.velocities, zeros3]),
            forces=torch.cat([local.forces, zeros3]),
            system_index=torch.cat([local.system_index, plan.ghost_system_index.to(local.device)]),
            atom_ids=torch.cat([local.atom_ids, plan.ghost_atom_ids.to(local.device)]),
            cell=local.cell,
            pbc=pbc,
            energy=torch.zeros_like(local.energy),
            stress=torch.zeros_like(local.stress),
            atom_extras={
                f: torch.cat([local.atom_extras[f], g])
                for f, g in zip(extras, ghosts[2:], strict=True)
            },
            validate=False,
        )
        self._plan = plan
        self._ref_positions = local.positions.detach().clone()
        self._ref_cell = local.cell.detach().clone()
        self._ref_domain = None
        # while a step's batch holds this cell tensor unmodified, the skin test
        # needs no cell algebra (skin_exceeded(same_cell))
        self._cell_at_build.remember(local.cell)
        self._built_for = getattr(self.sharded, "partitioner", None)
        self._version += 1
        self.stats.rebuilds += 1

    def _fold_whole(self, st: StepState) -> ModelOutputs:
        """The outputs of one rank running the whole batch: all of them totals."""
        raw = st.raw
        forces = extract_forces(raw, st.padded, self.spec.force_strategy, self.model)
        final: dict[str, Any] = {
            k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in raw.items()
        }
        final["forces"] = forces
        assert self.pending is not None
        self.pending.set({})  # every output is already the total
        self._timer("reduce", st.t0)
        return final  # type: ignore[return-value]

    def _context(self, plan: HaloPlan, positions: torch.Tensor | None) -> DDContext:
        return DDContext(
            layout=plan,
            group=self.sharded.group,
            n_systems=self.sharded.local_batch.n_systems,
            positions=positions,
            topology_version=self._version,
        )

    @staticmethod
    def _padded_positions(plan: HaloPlan, batch: Batch) -> torch.Tensor:
        """``[owned | ghost]`` positions, detached. **Collective**: one forward
        exchange of the ghost positions (image shifts from ``batch.cell``)."""
        owned = batch.positions.detach()
        return torch.cat([owned, plan.ghost_positions(owned, batch.cell).detach()])

    def _consolidate(
        self, raw: dict[str, Any], padded: torch.Tensor, t0: float, spec: MLIPSpec | None = None
    ) -> ModelOutputs:
        plan = self.plan
        spec = spec if spec is not None else self.spec
        if spec.options.receptive_field_fold:  # forces: -d(owned atom energies)/d rows
            owned_energy_forces(raw, padded, plan.n_owned, self.model)
        f_padded = extract_forces(raw, padded, spec.force_strategy, self.model)
        if folds_forces(spec):
            forces = f_padded[: plan.n_owned] + plan.reverse(f_padded[plan.n_owned :])
        else:  # the spec says owned rows are already exact: ghost rows are dropped
            forces = f_padded[: plan.n_owned]
        t0 = self._timer("fold", t0)
        unavailable: dict[str, str] = {}
        if spec.owned_rows_exact:  # the receptive-field safe path: rebuild the energy
            assert self._static is not None
            raw, unavailable = owned_row_outputs(
                raw,
                spec,
                n_owned=plan.n_owned,
                system_index=self._static.system_index,
                n_systems=self.sharded.local_batch.n_systems,
                model_name=type(unwrap_model(self.model)).__name__,
            )
        final, partial = consolidate(
            {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in raw.items()},
            spec,
            plan,
            self.sharded.group,
        )
        assert self.pending is not None
        self.pending.set(partial)
        self.pending.unavailable = unavailable
        final["forces"] = forces
        self._timer("reduce", t0)
        return final  # type: ignore[return-value]

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


def _check_strategy(cls: type, strategy: StrategyKind, spec: MLIPSpec) -> None:
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


def _device_problem(model: object, device: torch.device) -> str | None:
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
