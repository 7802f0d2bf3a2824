"""`DistributedModel`: the halo mode, one model forward on this rank's ``[owned | ghost]`` rows.

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
from collections.abc import Hashable
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
    get_rank,
    raise_if_any_rank,
    skin_exceeded,
)
from nvdd.dynamics._compile import CompileMode, compiled_forward
from nvdd.dynamics._config import DomainConfig
from nvdd.dynamics._provider import (
    DDStats,
    PendingTotals,
    ProviderBase,
    consolidate,
    device_problem,
    extract_forces,
    output_rules,
)
from nvdd.dynamics._receptive import check_reach, owned_energy_forces, owned_row_outputs
from nvdd.dynamics._step import (
    MODEL_GROWS,
    REBUILD,
    STEADY,
    StepState,
    decision_code,
    read_decision,
    reduce_device,
)
from nvdd.halo import HaloPlan, build_halo_plan
from nvdd.partition import ShardedBatch, SpatialPartitioner
from nvdd.shardtensor import DDContext, dd_scope
from nvdd.spec import (
    ForceStrategy,
    MLIPSpec,
    begins_steps,
    unwrap_model,
)

if TYPE_CHECKING:
    from nvdd.dynamics._provider import State

__all__ = ["DDStats", "DistributedModel", "shipped_model"]


def shipped_model(model: object) -> bool:
    """Whether ``model``'s class is one of nvdd's own (``nvdd.models``)."""
    return type(model).__module__.startswith("nvdd.models.")


class DistributedModel(ProviderBase):
    """The halo: the model on this rank's ``[owned | ghost]`` rows, open boundaries.

    Ghost rows are explicit periodic images of atoms within the ghost width of
    this rank's box (with :attr:`wraps_whole_axes`, not along the periodic axes
    the rank grid leaves whole: the padded rows are periodic along those, with
    the real cell). Also on a world of one rank (the images of its own atoms;
    ``DomainParallel`` runs :class:`~nvdd.dynamics.WholeBatchModel` there unless
    ``DomainConfig(halo_on_one_rank=True)``). Parameters and errors: those of
    :class:`~nvdd.dynamics._provider.ProviderBase`.
    """

    def __init__(
        self,
        model: Any,
        config: DomainConfig,
        *,
        spec: MLIPSpec | None = None,
        count: bool = False,
        sync_timings: bool = False,
    ) -> None:
        super().__init__(model, config, spec=spec, count=count, sync_timings=sync_timings)
        # only a model with its own begin_step may split its steps (read once)
        self._begins = begins_steps(self.model)
        self._plan: HaloPlan | None = None
        self._static: Batch | None = None
        # the padded batch's pbc (open, or periodic along the plan's periodic
        # axes) and those axes as host flags: one tensor kept while they hold
        self._padded_pbc: tuple[object, torch.Tensor] | None = None
        self._ref_positions: torch.Tensor | None = None
        self._ref_cell: torch.Tensor | None = None
        # (partitioner, its domain cell of _ref_cell, the reach the skin test
        # checks): derived once per build
        self._ref_domain: tuple[object, torch.Tensor, float] | None = None
        self._cell_at_build = TensorMemo()
        # the partitioner the plan was built for: another one (a rebalance
        # re-cut the boxes) forces a rebuild whatever the atoms did
        self._built_for: object = None
        self._version = 0
        # a split step (StepGraphs): the rebuild code queued by begin_step, and
        # the decision take_verdict read from it for the next call
        self._code: torch.Tensor | None = None
        # (plan version, padded positions) exchanged by _begin_model_step: the
        # forwards of that plan reuse them instead of exchanging again (every
        # step of a model that splits its steps begins with that search)
        self._head_padded: tuple[int, torch.Tensor] | None = None
        self._decided: bool | None = None
        # the DD context of the current plan (without positions): see _context
        self._ctx: DDContext | None = None
        # where the step's decision is all-reduced (None: one rank), set at
        # attach; "ask": not known yet (decision_code asks the group)
        self._reduce_on: torch.device | str | None = "ask"

    @property
    def plan(self) -> HaloPlan:
        """The current halo plan (after :meth:`attach`)."""
        if self._plan is None:
            raise ConfigurationError("DistributedModel: call attach(sharded_batch) first")
        return self._plan

    def attach(self, sharded: State) -> None:
        """Start running on ``sharded``: install the spec's adapters, build the plan.

        **Collective** over the sharded batch's group.
        """
        raise_if_any_rank(
            device_problem(unwrap_model(self.model), sharded.local_batch.device),
            sharded.group,
            exc_type=ConfigurationError,
        )
        self._sharded = sharded
        self._reduce_on = reduce_device(sharded.group)
        self.pending = PendingTotals(sharded.group)
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

    def detach(self) -> None:
        """Restore the adapters and call the model's ``distributed_teardown`` (and
        ``compile_forward(None)`` when the model compiled its own core)."""
        self._release_compiled()
        try:
            if self._sharded is not None:
                self.model.distributed_teardown()
        finally:
            self._registry.restore()
            self._sharded = None

    # ------------------------------------------------------------- the step
    def decide(self, st: StepState) -> bool:
        """Phase 1: whether atoms migrate and the halo is rebuilt first.

        **Collective** over the mesh: one small all-reduce of the step's code
        (Verlet criterion, a model's overflow, a non-finite value anywhere:
        :meth:`_skin_used_up`), unless :meth:`take_verdict` read it already;
        raises on every rank together on NaN/inf.
        """
        batch = st.batch
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
        replayed one make the same exchanges.
        """
        local = st.batch
        autograd = self.spec.force_strategy is ForceStrategy.AUTOGRAD
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
        """Phase 4: the model on the padded rows, into ``st.raw`` (open
        boundaries, inside the DD context)."""
        local = st.batch
        autograd = self.spec.force_strategy is ForceStrategy.AUTOGRAD
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
        outputs = self._consolidate(st.raw, st.padded, st.t0)
        if capturing():  # the host work of every replay of this call
            assert self.pending is not None
            partials, version = self.pending.partials(), self._version
            after_replay(lambda: self._replayed_halo(version, partials))
        return outputs

    # ---------------------------------------------------- CUDA-graph capture
    #: Whether steady steps of the halo path may be captured (subclasses that
    #: run another step opt out).
    _captures_halo_steps: ClassVar[bool] = True

    def graph_key(self, batch: Batch) -> Hashable | None:
        """Whether a step through this provider may be captured in a CUDA graph
        (``nvdd.dynamics.StepGraphs``): uncompiled, without collective counting
        or synchronised timers, and only when the model opts in (its
        ``graph_key(batch)``, asked inside the DD context, on the padded rows).
        A steady step is captured as two graphs around its rebuild decision
        (:attr:`splits_step`), and the key changes with every plan (a rebuild
        drops the graphs)."""
        if self.count or self.sync_timings:
            return None
        if self.stats.compile_mode == CompileMode.WHOLE.value:
            return None  # (the model's own compiled core: captured when it says so)
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
        decision (:meth:`begin_step`, :meth:`take_verdict`): once a plan is built."""
        return self._plan is not None

    def begin_step(self, batch: Batch) -> None:
        """Queue this step's rebuild decision on the device, unread (capturable).

        **Collective** over the mesh: the one small all-reduce of the step (see
        :meth:`_skin_used_up`). :meth:`take_verdict` reads it; the next call then
        skips its own check.
        """
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

    def request_rebuild(self) -> None:
        """Migrate and rebuild the halo plan at the next call, whatever moved.

        Local, but every rank must call it before the same step (a checkpoint
        does, so that a run and its restart rebuild at the same step).
        """
        self._ref_positions = None

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
        read; the codes of ``_step``): ``REBUILD`` when some owned atom
        moved more than half the skin left since the last build (the cell's
        strain eats into it; always with ``skin == 0``), ``MODEL_GROWS`` when
        ``model_flag`` is set on some rank, ``NONFINITE`` when some rank holds a
        non-finite position, velocity or force (the previous step's).

        **Collective** over the mesh: ONE all-reduce (max) of one small integer.
        """
        pos = batch.positions.detach()
        ref, ref_cell = self._ref_positions, self._ref_cell
        skin = self.config.skin
        sharded = self._sharded
        assert sharded is not None
        part = getattr(sharded, "partitioner", None)
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
        elif self._cell_at_build.same(batch.cell):  # the build's cell, unmodified:
            # plain displacements (skin_exceeded's same_cell test, without its cell
            # algebra), tested with the non-finite values in one pass over the rows
            return decision_code(
                None,
                model_flag,
                batch,
                sharded.group,
                self._reduce_on,
                reference=ref,
                limit2=(0.5 * skin) ** 2,
            )
        else:  # strain since the build eats into the skin (nvdd.core.skin_exceeded)
            if self._ref_domain is None or self._ref_domain[0] is not part:  # once per build
                reach = self.ghost_width - self.config.hysteresis - skin
                self._ref_domain = (part, part.domain_cell(ref_cell), reach)
            _, ref_dom, reach = self._ref_domain
            moved = skin_exceeded(
                pos,
                ref,
                batch.system_index,
                ref_dom,
                part.domain_cell(batch.cell),
                cutoff=reach,
                skin=skin,
            ).to(torch.int32)
        return decision_code(moved, model_flag, batch, sharded.group, self._reduce_on)

    def _stale_partition(self) -> bool:
        """Whether the sharded batch's partitioner is not the one the plan was
        built for (``ShardedBatch.rebalance`` re-cut the boxes): the same on
        every rank, since every rank holds the broadcast partitioner."""
        return getattr(self._sharded, "partitioner", None) is not self._built_for

    def _read_code(self, code: torch.Tensor, batch: Batch) -> int:
        """The host read of :meth:`_verdict_code` (:func:`read_decision`)."""
        sharded = self._sharded
        assert sharded is not None
        return read_decision(code, batch, sharded.group)

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
            part.halo_config(sharded.group, wrap_whole_axes=self.wraps_whole_axes),
            local.positions.detach(),
            local.atom_ids,
            local.system_index,
            part.domain_cell(local.cell),
        )
        self._install(local, plan, self._pbc_of(plan, local.pbc))
        self.stats.n_owned, self.stats.n_ghost = plan.n_owned, plan.n_ghost
        self._timer("plan", t0)

    @property
    def wraps_whole_axes(self) -> bool:
        """Whether the halo leaves the periodic axes the rank grid leaves whole to
        the model's neighbour list (no image rows along them): asked by
        ``DomainConfig(wrap_whole_axes=True)``, declared by the spec
        (``StrategyOptions.wraps_periodic_axes``) and only for models nvdd ships
        (:meth:`_ships_models`); record 0079."""
        return (
            self.config.wrap_whole_axes
            and self.spec.options.wraps_periodic_axes
            and self._ships_models()
        )

    def _ships_models(self) -> bool:
        """Whether the model is one nvdd ships (checked N-vs-1 with a real periodic
        axis). A model of the user's that declares a preset keeps its image rows:
        under a halo it was promised open boundaries, and nothing checked that its
        neighbour list honours ``batch.pbc`` there."""
        return shipped_model(unwrap_model(self.model))

    def _pbc_of(self, plan: HaloPlan, like: torch.Tensor) -> torch.Tensor:
        """The padded batch's pbc: periodic along ``plan.periodic_axes`` (the
        axes left to the model), open along the others (explicit images). One
        tensor is kept while the flags hold (a model reads a pbc tensor it has
        not seen on the host)."""
        axes = plan.periodic_axes
        flags = None if axes is None else tuple(axes.reshape(-1).tolist())
        kept = self._padded_pbc
        if (
            kept is None
            or kept[0] != flags
            or kept[1].shape != like.shape
            or kept[1].device != like.device
        ):
            pbc = torch.zeros_like(like)
            if axes is not None:
                pbc = axes.reshape(like.shape).to(like.device)
            kept = self._padded_pbc = (flags, pbc)
        return kept[1]

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
            system_extras=dict(local.system_extras),  # (per system: every rank has them)
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

    def _context(self, plan: HaloPlan, positions: torch.Tensor | None) -> DDContext:
        """The DD context of a forward on ``plan``'s rows: made (and checked) once
        per plan, then only its ``positions`` change."""
        ctx = self._ctx
        if ctx is None or ctx.layout is not plan or ctx.topology_version != self._version:
            ctx = self._ctx = DDContext(
                layout=plan,
                group=self.sharded.group,
                n_systems=self.sharded.local_batch.n_systems,
                topology_version=self._version,
            )
        return ctx if positions is None else ctx.with_positions(positions)

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
        rules = output_rules(spec)
        if rules.folds_forces:
            forces = f_padded[: plan.n_owned] + plan.reverse(f_padded[plan.n_owned :])
        else:  # the spec says owned rows are already exact: ghost rows are dropped
            forces = f_padded[: plan.n_owned]
        t0 = self._timer("fold", t0)
        unavailable: dict[str, str] = {}
        if rules.owned_rows_exact:  # the receptive-field safe path: rebuild the energy
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
