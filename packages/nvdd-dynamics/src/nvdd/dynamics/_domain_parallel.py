"""`DomainParallel`: wrap any `BaseDynamics` with spatial domain decomposition.

The watchdog runs from ``partition`` (or ``load``) to ``close`` and gets one beat
at every hook stage of every step (``"step 12 before_compute"``) and one after the
hooks of a stage ran, so the report of a silent rank says which step and phase it
stopped in, and a rank stuck in a hook is one beat behind the others (whatever
the backend: a rank waiting in an NCCL collective may block outside
``torch.distributed``, in a host sync). Phases that are legitimately long get
:data:`SETUP_ALLOWANCE_S`: the scatter from the source rank (which may read and
check a large system first) and, with a compiled forward, the first force
computation.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nvdd.core import (
    Batch,
    CommunicationError,
    ConfigurationError,
    Watchdog,
    all_gather_object,
    any_rank,
    get_rank,
    get_world_size,
    init_distributed,
    install_teardown,
)
from nvdd.dynamics import _checkpoint
from nvdd.dynamics._collectives import MeshReducer
from nvdd.dynamics._config import DomainConfig
from nvdd.dynamics._distributed_model import DDStats, DistributedModel
from nvdd.dynamics._graph_partition import GraphPartitionModel
from nvdd.dynamics._hooks import Hook, HookScope, HookStage
from nvdd.dynamics._integrators import BaseDynamics, HookContext
from nvdd.dynamics._pipeline import distributed_model_for
from nvdd.dynamics._provider import ProviderBase
from nvdd.dynamics._step import StepState, run, step
from nvdd.dynamics._verify import needs_verification, verify_model
from nvdd.partition import BalanceMode, IndexShardedBatch, ShardedBatch, SpatialPartitioner
from nvdd.spec import MLIPSpec, StrategyKind

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DomainParallel"]

_TOTALS = ("energy", "stress", "virial")
#: Seconds the scatter (and a first compiled forward) may take before the watchdog
#: reports, when that is more than its timeout.
SETUP_ALLOWANCE_S = 600.0


def _graph(config: DomainConfig) -> bool:
    return config.strategy is StrategyKind.GRAPH_PARTITION


def _resolve_group(config: DomainConfig) -> ProcessGroup | None:
    mesh = config.mesh
    if mesh is None:
        return None
    get_group = getattr(mesh, "get_group", None)
    if get_group is not None:
        try:
            return get_group(config.mesh_dim)  # type: ignore[no-any-return]
        except (KeyError, ValueError, RuntimeError) as exc:
            raise ConfigurationError(
                f"DomainConfig.mesh has no dimension {config.mesh_dim!r}: {exc}"
            ) from exc
    return mesh  # type: ignore[no-any-return]


def _forces_stale_after(dyn: BaseDynamics, stage: HookStage) -> None:
    """After a hook raised between the drift and the forces, the forces belong to
    the previous positions: mark them stale, so :meth:`DomainParallel.gather`
    computes them at the positions it returns."""
    if stage in (HookStage.AFTER_PRE_UPDATE, HookStage.BEFORE_COMPUTE):
        dyn.step_state.forces_ready = False


class DomainParallel:
    """Wraps any ``BaseDynamics`` subclass with spatial domain decomposition (or,
    with ``DomainConfig(strategy=StrategyKind.GRAPH_PARTITION)``, a node partition
    by index for models that build their own neighbour list).

    The inner integrator and its model are unchanged: the integrator sees its
    owned atoms only, forces come from a :class:`DistributedModel`, global sums
    (FIRE's power, temperatures) go through a mesh-wide reducer, and its hooks
    fire at every stage they registered for. Launch one process per rank
    (``torchrun``); every rank builds the same objects.

    Parameters
    ----------
    dynamics:
        The single-process integrator (its ``batch`` is the whole system on the
        source rank; other ranks may hold anything, e.g. the same file read).
    config:
        The :class:`DomainConfig`.
    spec:
        Overrides the model's ``distribution_spec``.
    src:
        Rank that holds the whole batch at :meth:`partition`.
    backend, timeout_s:
        Used to initialise ``torch.distributed`` when it is not yet (a world of
        one without a torchrun environment).
    sync_timings:
        Exact per-phase timings on GPUs (synchronises; for benchmarks).
    count_collectives:
        Record the collectives of every force call in
        ``stats.last_collectives`` (off by default: it costs host time).
    watchdog_s:
        Seconds a rank may go without progress before its
        :class:`~nvdd.core.Watchdog` names the silent rank(s) and ends the job;
        default ``$NVDD_WATCHDOG_S`` or 120; 0 disables. It beats at every hook
        stage of every step and runs from :meth:`partition` (or :meth:`load`) to
        :meth:`close`.

    Notes
    -----
    ``partition``, ``step``, ``run``, ``gather`` and ``close`` are **Collective**
    over the mesh: every rank calls them in the same order. Under DD the
    per-system totals in ``dynamics.batch`` (energy, stress) are reduced only
    when a hook that needs them is due (or :meth:`gather` / :meth:`totals` is
    called); between such points they are stale.
    """

    def __init__(
        self,
        dynamics: BaseDynamics,
        config: DomainConfig,
        *,
        spec: MLIPSpec | None = None,
        src: int = 0,
        backend: str | None = None,
        timeout_s: float = 600.0,
        sync_timings: bool = False,
        count_collectives: bool = False,
        watchdog_s: float | None = None,
    ) -> None:
        if not isinstance(dynamics, BaseDynamics):
            raise ConfigurationError(
                f"DomainParallel wraps a BaseDynamics, got {type(dynamics).__name__}"
            )
        if not isinstance(config, DomainConfig):
            raise ConfigurationError(f"config must be a DomainConfig, got {type(config).__name__}")
        if not dist.is_initialized():
            device = dynamics.batch.device if isinstance(dynamics.batch, Batch) else None
            init_distributed(backend=backend, device=device, timeout_s=timeout_s)
        install_teardown()  # the process group ends cleanly at exit, whoever created it
        self.config = config
        self.dynamics = dynamics
        self.group = _resolve_group(config)
        self.rank = get_rank(self.group)
        self.world_size = get_world_size(self.group)
        if not 0 <= src < self.world_size:
            raise ConfigurationError(f"src must be in [0, {self.world_size}), got {src}")
        self.src = src
        # by strategy (HALO: DistributedModel, GRAPH_PARTITION: GraphPartitionModel),
        # a composed model (``pipeline_components``) as its pipeline variant, and
        # one rank as WholeBatchModel (unless DomainConfig.halo_on_one_rank)
        self.model: ProviderBase = distributed_model_for(
            dynamics.model,
            config,
            spec=spec,
            world_size=self.world_size,
            sync_timings=sync_timings,
            count=count_collectives,
        )
        self.watchdog = Watchdog(watchdog_s, group=self.group)
        self._sharded: ShardedBatch | IndexShardedBatch | None = None
        #: LOCAL hooks without ``needs`` that every rank registered (by id; the
        #: hook kept beside it), settled by :meth:`_settle_local_hooks`; None
        #: until the first ``step`` / ``run``.
        self._agreed_local: dict[int, Hook] | None = None
        #: What the integrator steps through from :meth:`partition` to
        #: :meth:`close` (bound to it, nothing of it swapped).
        self.step_state: StepState | None = None

    # ------------------------------------------------------------ set-up
    @property
    def sharded(self) -> ShardedBatch | IndexShardedBatch:
        """The partitioned state (after :meth:`partition`): spatial blocks under
        ``StrategyKind.HALO``, index blocks under ``GRAPH_PARTITION``."""
        if self._sharded is None:
            raise ConfigurationError("DomainParallel: call partition(batch) first")
        return self._sharded

    def _state(self) -> StepState:
        """The bound :class:`StepState` (raises before any collective if not partitioned)."""
        if self.step_state is None:
            raise ConfigurationError("DomainParallel: call partition(batch) first")
        return self.step_state

    @property
    def stats(self) -> DDStats:
        """Counters and timings of the distributed model."""
        return self.model.stats

    def partition(
        self,
        batch: Batch | None = None,
        *,
        sharded: ShardedBatch | IndexShardedBatch | None = None,
    ) -> ShardedBatch | IndexShardedBatch:
        """Scatter the system from ``src`` and build the first halo plan.

        **Collective** over the mesh. ``batch`` defaults to ``dynamics.batch`` on
        ``src``; other ranks' arguments are ignored. Each rank receives only its
        own atoms (O(N/P) memory). Pass ``sharded`` instead to adopt atoms that
        are already distributed (a restart: :meth:`load`): a ``ShardedBatch``
        whose partitioner's ghost width is the model's, or under
        ``GRAPH_PARTITION`` an ``IndexShardedBatch``.
        """
        if self._sharded is not None:
            raise ConfigurationError("DomainParallel.partition: already partitioned")
        self.watchdog.start()
        self.watchdog.beat("partition", allow_s=SETUP_ALLOWANCE_S)
        ghost_width = self.model.ghost_width
        state: ShardedBatch | IndexShardedBatch
        if sharded is not None:
            _checkpoint.check_adoptable(sharded, ghost_width, graph=_graph(self.config))
            state = sharded
        else:
            self._verify(batch, ghost_width)
            state = self._scatter(batch, ghost_width)
        self.model.attach(state)
        self._sharded = state
        # Until the first step starts, the first forces are computed (compiled, maybe).
        self.watchdog.beat(
            "partitioned", allow_s=SETUP_ALLOWANCE_S if self.config.compile else None
        )
        # the integrator's batch IS the sharded batch from now on; every stage of
        # every step beats the watchdog (its step_beat's fields)
        self.step_state = StepState(
            state,
            self.model,
            MeshReducer(self.group, totals=self.model.pending),
            self._run_hooks,
            progress=self.watchdog.step_beat,
        )
        self.dynamics.graphs.drop("DomainParallel.partition")  # a captured step used the old wiring
        self.dynamics.bind(self.step_state)
        return state

    def _verify(self, batch: Batch | None, ghost_width: float) -> None:
        """Refuse a model that differs decomposed from one process (``_verify``).

        **Collective** over the world (only where the scope is the whole world,
        rank 0 the source and the model not a pipeline)."""
        dm = self.model
        whole_world = self.group is None or get_world_size(self.group) == dist.get_world_size()
        if (
            self.world_size < 2
            or type(dm) not in (DistributedModel, GraphPartitionModel)
            or not whole_world
            or self.src != 0
            or not needs_verification(dm.model, dm.spec, self.config.verify_model)
        ):
            return
        source = batch if batch is not None else self.dynamics.batch
        if not isinstance(source, Batch):  # a non-source rank's placeholder: only read there
            source = Batch(torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64))
        verify_model(
            dm.model,
            dm.spec,
            source,
            is_source=self.rank == self.src,
            ghost_width=ghost_width,
            skin=self.config.skin,
            strategy=self.config.strategy,
        )

    def _scatter(self, batch: Batch | None, ghost_width: float) -> ShardedBatch | IndexShardedBatch:
        cfg = self.config
        kwargs: dict[str, Any] = {
            "grid_dims": cfg.grid_dims,
            "balance": BalanceMode.QUANTILE if cfg.load_balance else BalanceMode.UNIFORM,
            "require_nondegenerate": cfg.require_nondegenerate,
        }
        if cfg.skin > 0:
            kwargs["skin"] = cfg.skin

        def factory(b: Batch) -> SpatialPartitioner:
            return SpatialPartitioner.from_batch(b, self.world_size, ghost_width, **kwargs)

        source = None
        if self.rank == self.src:
            source = batch if batch is not None else self.dynamics.batch
        if _graph(cfg):  # a node partition by index: nothing spatial, nothing migrates
            return IndexShardedBatch.from_batch(source, self.group, src=self.src, order="space")
        return ShardedBatch.from_batch(source, self.group, factory, src=self.src)

    # ------------------------------------------------------------- hooks
    def register_hook(
        self,
        stage: HookStage,
        fn: Any,
        *,
        every: int = 1,
        scope: HookScope = HookScope.LOCAL,
        needs: Any = (),
    ) -> Hook:
        """Register a hook on the wrapped integrator (see ``BaseDynamics.register_hook``).

        Register the same hooks on every rank: GLOBAL and RANK_ZERO hooks imply a
        gather, which every rank takes part in.
        """
        return self.dynamics.register_hook(stage, fn, every=every, scope=scope, needs=needs)

    def totals(self, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Per-system totals of the last force computation (energy, stress, ...).

        **Collective** over the mesh (one all-reduce when something is pending);
        also stores them in ``dynamics.batch``. ``names`` default: energy,
        stress and virial, less those a model under the receptive-field spec
        cannot give (stored as NaN, never a stale value); naming one of those
        raises :class:`ConfigurationError` with the reason.
        """
        totals = self.model.materialize(names)
        known: dict[str, Any] = {k: v for k, v in totals.items() if k in ("energy", "stress")}
        pending = self.model.pending
        if names is None and pending is not None:
            for k in ("energy", "stress"):
                if k in pending.unavailable:
                    known[k] = torch.full_like(getattr(self.dynamics.batch, k), float("nan"))
        if known:  # (into the owner of the integrator's atoms: the sharded batch)
            self.sharded.local_batch = self.sharded.local_batch.replace(**known)
        return totals

    def _run_hooks(self, dyn: BaseDynamics, stage: HookStage, hooks: list[Hook]) -> None:
        """Due hooks in the order they were registered (every rank alike).

        The totals they need are reduced first (one all-reduce); the whole
        system is gathered once, at the first GLOBAL hook (every rank), and once
        at the first RANK_ZERO hook (to rank 0), and reused by the next ones.
        So a hook registered after another sees its effects (e.g. a checkpoint
        written after the frame of the same step).

        A hook every rank registers is agreed on: GLOBAL and RANK_ZERO hooks and
        hooks with ``needs`` (every rank registers them by contract: the runner
        gathers or reduces for them), and LOCAL hooks found on every rank when
        the ranks last compared their hook lists (:meth:`_settle_local_hooks`).
        After an agreed hook the ranks learn whether it raised anywhere (one
        all-reduce of a flag), and if it did, every rank raises at this stage of
        this step (the failing ranks their own exception, the others a
        ``CommunicationError`` naming them), so :meth:`gather` works after it
        (the save-on-error pattern). A LOCAL hook registered on some ranks only
        (a progress bar on rank 0) raises where it failed, at once, as in one
        process.
        """
        needs = sorted(set().union(*(h.needs for h in hooks)))
        if needs:
            self.totals(tuple(needs))
        whole: Batch | None = None
        gathered: Batch | None = None
        gathered_done = False
        local = self._agreed_local or {}
        for h in hooks:
            agreed = h.scope is not HookScope.LOCAL or bool(h.needs) or local.get(id(h)) is h
            failure: Exception | None = None
            try:
                if h.scope is HookScope.LOCAL:
                    h.fn(self._ctx(dyn.batch, stage))
                elif h.scope is HookScope.GLOBAL:
                    if whole is None:
                        whole = self.sharded.to_global()  # one all-gather for every GLOBAL hook
                    h.fn(self._ctx(whole, stage))
                else:  # RANK_ZERO
                    if not gathered_done:
                        gathered, gathered_done = self.sharded.gather(0), True
                    if gathered is not None:
                        h.fn(self._ctx(gathered, stage))
            except Exception as exc:
                if not agreed:
                    _forces_stale_after(dyn, stage)
                    raise
                failure = exc  # agreed on below, then raised on every rank
            if agreed:
                self._agree_on_hook(dyn, stage, h, failure)

    def _settle_local_hooks(self) -> None:
        """Find the LOCAL hooks without ``needs`` that every rank registered, so
        that a failure in one is agreed on (see :meth:`_run_hooks`).

        **Collective** (one all-gather of each rank's hook keys; none in a world
        of one). A hook's key is its stage, interval, function name and its
        place among this rank's hooks of the same three: ranks that register
        the same hooks in the same order find all of them on every rank; a hook
        only some ranks registered is not agreed on (it never enters a
        collective, so it cannot leave a rank waiting in one).
        """
        if self.world_size == 1:
            self._agreed_local = {}
            return
        mine: dict[tuple[str, int, str, int], Hook] = {}
        seen: dict[tuple[str, int, str], int] = {}
        for h in self.dynamics.hooks:
            if h.scope is not HookScope.LOCAL or h.needs:
                continue
            name = getattr(h.fn, "__qualname__", None) or type(h.fn).__qualname__
            base = (h.stage.value, h.every, name)
            seen[base] = seen.get(base, -1) + 1
            mine[(*base, seen[base])] = h
        keys: list[list[tuple[str, int, str, int]]] = all_gather_object(list(mine), self.group)
        common = set(keys[0]).intersection(*keys[1:])
        self._agreed_local = {id(h): h for k, h in mine.items() if k in common}

    def _agree_on_hook(
        self, dyn: BaseDynamics, stage: HookStage, hook: Hook, failure: Exception | None
    ) -> None:
        """Raise on every rank if ``hook`` raised on any. **Collective** (one
        all-reduce of a flag; after a failure, one all-gather of the messages).

        The failing ranks raise their own exception, the others a
        ``CommunicationError`` naming the failing ranks, step and stage.
        """
        if not any_rank(failure is not None, self.group):  # a world of one: no collective
            return
        _forces_stale_after(dyn, stage)
        if failure is not None and self.world_size == 1:
            raise failure
        name = getattr(hook.fn, "__qualname__", None) or repr(hook.fn)
        what = None
        if failure is not None:
            first = (str(failure).strip().splitlines() or [""])[0][:300]
            what = f"{type(failure).__name__}: {first}"
        messages: list[str | None] = all_gather_object(what, self.group)
        if failure is not None:
            raise failure
        failed = [f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None]
        raise CommunicationError(
            f"rank {self.rank}: stopped at step {dyn.step_count} ({stage.value} hooks) because "
            f"hook {name!r} raised on another rank: " + "; ".join(failed)
        )

    def _ctx(self, batch: Batch, stage: HookStage) -> HookContext:
        return HookContext(
            batch=batch,
            step=self.dynamics.step_count,
            stage=stage,
            dynamics=self.dynamics,
            rank=self.rank,
            world_size=self.world_size,
        )

    # -------------------------------------------------------------- running
    def step(self) -> None:
        """One step of the inner integrator, decomposed. **Collective**.

        :func:`nvdd.dynamics._step.step` over :attr:`step_state`: the
        integrator's own stages on this rank's owned atoms (``pre_update``,
        ``post_update``, hooks), and between them the phases of
        :class:`DistributedModel`: (1) one all-reduced flag: skin used up, or a
        non-finite value anywhere; (2) if used up, migrate atoms and rebuild the
        halo plan; (3) exchange ghost positions; (4) the model on ``[owned |
        ghost]`` rows; (5) fold ghost contributions to their owners as the spec
        says. Per-system totals are reduced only when a hook, :meth:`totals` or
        :meth:`gather` needs them.
        """
        st = self._state()  # (raises before any collective if not partitioned)
        if self._agreed_local is None:  # the first step: which LOCAL hooks every rank has
            self._settle_local_hooks()
        step(self.dynamics, st)

    def run(self, n_steps: int) -> bool:
        """Up to ``n_steps`` steps; stops when the integrator converges mesh-wide.
        **Collective**; returns whether it converged.

        First the ranks compare their LOCAL hooks (one all-gather; hooks added
        since the last ``run`` count from here on): those every rank has are
        agreed on when one raises (see :meth:`_run_hooks`). :meth:`step` does
        this at its first call only.
        """
        st = self._state()
        self._settle_local_hooks()  # hooks may have been added since the last run
        converged = run(self.dynamics, st, n_steps)
        self.model.check_finite()  # the last step's forces, and any queued flag
        return converged

    def gather(self, dst: int = 0) -> Batch | None:
        """The whole system in atom-id order on ``dst`` (None elsewhere), with the
        forces and per-system totals of the current positions (computed first if
        no step computed them yet). **Collective**."""
        self.sharded  # noqa: B018
        self.dynamics.ensure_forces()
        self.model.check_finite()
        self.totals()
        return self.sharded.gather(dst)

    def save(self, path: str | os.PathLike[str], *, metadata: dict[str, Any] | None = None) -> Path:
        """Write a restartable checkpoint of the whole run to the directory ``path``.

        **Collective**. See :func:`nvdd.dynamics.save_checkpoint`.
        """
        return _checkpoint.save_checkpoint(self, path, metadata=metadata)

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restart from a checkpoint instead of :meth:`partition` (any world size).

        **Collective**. See :func:`nvdd.dynamics.load_checkpoint`.
        """
        return _checkpoint.load_checkpoint(self, path)

    def to_global(self) -> Batch:
        """The whole system on every rank, with forces and totals (see
        :meth:`gather`). **Collective**."""
        self.sharded  # noqa: B018
        self.dynamics.ensure_forces()
        self.model.check_finite()
        self.totals()
        return self.sharded.to_global()

    def single_point(self, dst: int | None = 0) -> Batch | None:
        """Forces, energy and stress of the current structure, computed now.

        **Collective**. The single-point API: partition a fixed structure (or
        change positions through ``dynamics.batch``), then call this; the model
        runs once under the decomposition whatever was computed before.

        Parameters
        ----------
        dst:
            Rank that receives the whole system in atom-id order (None elsewhere);
            ``None``: every rank receives it.
        """
        self.sharded  # noqa: B018
        self.dynamics.compute()
        self.totals()
        return self.sharded.to_global() if dst is None else self.sharded.gather(dst)

    def close(self) -> None:
        """Restore the model's adapters and the integrator's single-process wiring.

        The integrator keeps this rank's owned atoms; gather first to keep the
        whole system. Idempotent; the process group stays (it is the caller's).
        """
        self.watchdog.stop()
        if self._sharded is None:
            return
        try:
            self.model.detach()
        finally:
            self.dynamics.graphs.drop("DomainParallel.close", release=True)
            if self.step_state is not None:  # the integrator keeps this rank's owned atoms
                self.dynamics.unbind(self.step_state)
            self.step_state = None
            self._sharded = None
            self._agreed_local = None

    def __enter__(self) -> DomainParallel:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
