"""`GraphPartitionModel`: the per-step path of ``StrategyKind.GRAPH_PARTITION``.

Nodes are split by index (:class:`~nvdd.partition.IndexShardedBatch`): rank
``r`` owns a fixed block of atoms in atom-id order and every edge *into* them.
Nothing migrates. Per call (the integrator's compute stage):

1. one all-reduce of the flag of :class:`DistributedModel` (skin used up, or a
   non-finite value anywhere);
2. on a rebuild: one ``all_to_all_single`` replicates the positions (every
   rank's block to every rank), :func:`~nvdd.partition.graph_ghosts` picks the
   atoms within ``cutoff + skin`` of an owned atom (periodic images included),
   and :func:`~nvdd.halo.build_request_plan` asks their owners for them;
3. one forward exchange: the ghost rows' positions, unchanged (no image shift);
4. the model on ``[owned | ghost]`` rows with the **real cell and pbc**: it
   builds its own neighbour list, keeps edges into owned rows, and refreshes
   the ghost rows' features after each layer through the same plan (only the
   rows its edges read travel, not a full all-gather; see docs/design.md);
5. consolidation by the spec, exactly as under the halo (ghost-row forces
   folded into their owners by one reverse exchange).

A step that rebuilds nothing costs what a halo step costs: two
``all_to_all_single`` and one small all-reduce, plus the model's own exchanges.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from nvdd.core import Batch, ConfigurationError, all_to_all_single, comm_device
from nvdd.dynamics._config import DomainConfig
from nvdd.dynamics._distributed_model import DistributedModel
from nvdd.halo import build_request_plan
from nvdd.partition import IndexShardedBatch, graph_ghosts
from nvdd.spec import MLIPSpec, StrategyKind

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["GraphPartitionModel"]


def replicate_rows(
    rows: torch.Tensor, counts: tuple[int, ...], group: ProcessGroup | None
) -> torch.Tensor:
    """Every rank's block of ``rows``, concatenated in rank order, on every rank.

    **Collective** over ``group``: one ``all_to_all_single`` in which each rank
    sends its block to every rank (uneven blocks allowed: ``counts``).

    Parameters
    ----------
    rows:
        Shape ``(counts[rank], *f)``.
    counts:
        Rows of every rank's block.

    Returns
    -------
    torch.Tensor
        Shape ``(sum(counts), *f)``, on ``rows``' device.
    """
    world = len(counts)
    if world == 1:
        return rows.clone()
    dev = comm_device(group)
    send = rows.detach().to(dev).contiguous()
    send = send.unsqueeze(0).expand(world, *send.shape).reshape(-1, *send.shape[1:])
    out = torch.empty((sum(counts), *rows.shape[1:]), dtype=rows.dtype, device=dev)
    all_to_all_single(out, send.contiguous(), list(counts), [int(rows.shape[0])] * world, group)
    return out.to(rows.device)


class GraphPartitionModel(DistributedModel):
    """Wrap a model for the graph-partition strategy (a node partition by index).

    For models that build their own neighbour list inside ``forward``: the
    model sees this rank's block of atoms plus, as ghost rows, every atom within
    ``cutoff + skin`` of it, at their own positions, with the real cell and
    pbc. Edges must be kept only for receivers among the owned rows
    (``current_dd_context().layout.n_owned``); the layout's
    ``explicit_images`` is False, which tells the model not to expect open
    boundaries. Ghost features are refreshed through the layout
    (``refresh_neighbors``), forces and energies consolidated by the spec.

    Parameters
    ----------
    model:
        A ``BaseModelMixin`` whose ``distribution_spec(StrategyKind.GRAPH_PARTITION)``
        declares ``storage=StrategyKind.GRAPH_PARTITION`` (e.g. ``SPEC_MPNN_GP``).
    config:
        The :class:`DomainConfig`; its ``strategy`` must be ``GRAPH_PARTITION``.
    spec, count, sync_timings:
        As for :class:`DistributedModel`.

    Notes
    -----
    :meth:`attach` takes an :class:`~nvdd.partition.IndexShardedBatch`
    (``DomainParallel.partition`` builds it). Rebuilds happen when some owned
    atom moved more than ``skin / 2`` since the last one (one flag all-reduce
    per call decides, on every rank together).
    """

    _captures_halo_steps = False  # (its own step: not captured)

    strategy: ClassVar[StrategyKind] = StrategyKind.GRAPH_PARTITION

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
        self._all_ids: torch.Tensor | None = None
        self._all_systems: torch.Tensor | None = None

    @property
    def ghost_width(self) -> float:
        """Distance within which non-owned atoms become ghost rows: ``cutoff +
        skin`` (plus the spec's extra); no migration hysteresis (nothing migrates)."""
        return self.config.resolved_ghost_width(self.spec.extra_reach(self.config.cutoff))

    @property
    def index_sharded(self) -> IndexShardedBatch:
        """The index-partitioned state (after :meth:`attach`)."""
        sharded = self.sharded
        if not isinstance(sharded, IndexShardedBatch):
            raise ConfigurationError(
                f"GraphPartitionModel runs on an IndexShardedBatch, got {type(sharded).__name__}"
            )
        return sharded

    def _rebuild(self, local: Batch, *, migrate: bool) -> None:
        """Replicate positions, choose the ghost rows, build the request plan.

        **Collective** over the mesh: one ``all_to_all_single`` of positions (and,
        at the first build, of ids and systems), the plan's two exchanges and
        flag all-reduce, and one packed exchange of the ghosts' static fields.
        """
        sharded = self.index_sharded
        group, counts = sharded.group, sharded.owned_counts
        t0 = time.perf_counter()
        local = sharded.local_batch
        dev = local.device
        if self._all_ids is None or self._all_systems is None:  # fixed: nothing migrates
            static = torch.stack([local.atom_ids, local.system_index], dim=1)
            both = replicate_rows(static, counts, group)
            self._all_ids, self._all_systems = both[:, 0], both[:, 1]
        positions = replicate_rows(local.positions.detach(), counts, group)
        start, stop = sharded.bounds
        owned = torch.zeros(sharded.n_atoms, dtype=torch.bool, device=dev)
        owned[start:stop] = True
        ghosts = graph_ghosts(
            positions, self._all_systems, local.cell, local.pbc, owned, self.ghost_width
        )
        part = sharded.partitioner
        owner = part.owner_of(ghosts)
        offsets = torch.tensor(part.offsets(), dtype=torch.int64, device=dev)
        plan = build_request_plan(
            owner,
            ghosts - offsets[owner],
            local.n_atoms,
            group=group,
            atom_ids=self._all_ids[ghosts],
            system_index=self._all_systems[ghosts],
            n_systems=local.n_systems,
        )
        self._install(local, plan, local.pbc)
        self.stats.n_owned, self.stats.n_ghost = plan.n_owned, plan.n_ghost
        self._timer("plan", t0)
