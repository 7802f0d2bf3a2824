"""`ShardedBatch`: the owned atoms of a `Batch` on every rank of a 1-D mesh."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nvdd.core import (
    Batch,
    ConfigurationError,
    ValidationError,
    get_rank,
    get_world_size,
    raise_if_any_rank,
)
from nvdd.partition._build import imbalance_of
from nvdd.partition._comm import (
    all_reduce_max,
    all_reduce_sum,
    broadcast_object,
    reshard,
    resolve_group,
)
from nvdd.partition._degenerate import empty_rank_reasons, enforce
from nvdd.partition._gather import gather_to, gather_to_all
from nvdd.partition._owned import OwnedRows
from nvdd.partition._scatter import (
    ERRORS,
    Header,
    PartitionerSource,
    checked_header,
    local_rows,
    src_header,
)
from nvdd.partition._spatial import SpatialPartitioner

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MigrationStats", "ShardedBatch"]


@dataclass(frozen=True)
class MigrationStats:
    """What one :meth:`ShardedBatch.migrate` did.

    Attributes
    ----------
    n_moved:
        Atoms that changed owner, over all ranks (the same on every rank).
    n_sent, n_received:
        Rows this rank sent to / received from other ranks.
    owned_counts:
        Owned atoms of every rank after the migration.
    """

    n_moved: int
    n_sent: int
    n_received: int
    owned_counts: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        """``max / mean`` of ``owned_counts``."""
        return imbalance_of(self.owned_counts)


class ShardedBatch(OwnedRows):
    """A :class:`~nvdd.core.Batch` distributed over a 1-D mesh: each rank holds the
    atoms it owns (rows keyed by global atom id) and a copy of every system field.

    Build it with :meth:`from_batch` (scatter from one rank); the constructor wraps
    rows that are already distributed. Every system is partitioned over the whole
    mesh.

    Parameters
    ----------
    local_batch:
        This rank's owned atoms and every system's fields.
    partitioner:
        Identical on every rank (see :meth:`SpatialPartitioner.broadcast`).
    mesh:
        A 1-D DeviceMesh, a ProcessGroup, or None (the default group).

    Notes
    -----
    The constructor is **Collective** over the mesh's group (two small
    all-reduces: the partitioners' fingerprints, which must agree, and the owned
    counts). It neither moves atoms nor checks that they sit in their owner's box:
    call :meth:`migrate` for that.
    """

    __slots__ = ("_counts", "_last", "partitioner")
    #: The partitioner (identical on every rank; :meth:`rebalance` replaces it).
    partitioner: SpatialPartitioner

    def __init__(
        self,
        local_batch: Batch,
        partitioner: SpatialPartitioner,
        mesh: DeviceMesh | ProcessGroup | None = None,
    ) -> None:
        group, dmesh = resolve_group(mesh)
        world, rank = get_world_size(group), get_rank(group)
        problem = None
        if not isinstance(partitioner, SpatialPartitioner) or partitioner.world_size != world:
            problem = (
                f"ShardedBatch needs a SpatialPartitioner of {world} ranks, got {partitioner!r}"
            )
        fp = 0 if problem is not None else partitioner.fingerprint()
        flags = all_reduce_max(torch.tensor([fp, -fp, int(problem is not None)]), group)
        if int(flags[2]):
            raise_if_any_rank(problem, group, exc_type=ConfigurationError)
        if int(flags[0]) != -int(flags[1]):
            raise ConfigurationError(
                f"rank {rank}: the partitioners differ between ranks (fingerprints "
                f"{-int(flags[1])}..{int(flags[0])}); build them from the same inputs or "
                "use SpatialPartitioner.broadcast"
            )
        message = None
        if not isinstance(local_batch, Batch):
            message = f"local_batch must be a Batch, got {type(local_batch).__name__}"
        elif local_batch.n_systems != partitioner.n_systems:
            message = (
                f"local_batch has {local_batch.n_systems} systems, the partitioner "
                f"{partitioner.n_systems}"
            )
        raise_if_any_rank(message, group)
        onehot = torch.zeros(world, dtype=torch.int64)
        onehot[rank] = local_batch.n_atoms
        counts = tuple(all_reduce_sum(onehot, group).tolist())
        self._setup(local_batch, partitioner, group, dmesh, counts)

    def _setup(
        self,
        local: Batch,
        partitioner: SpatialPartitioner,
        group: ProcessGroup | None,
        mesh: DeviceMesh | None,
        counts: tuple[int, ...],
    ) -> None:
        self.local_batch = local
        self.partitioner = partitioner
        self.group = group
        self._mesh = mesh
        self._counts = counts
        self._last: MigrationStats | None = None

    @classmethod
    def from_batch(
        cls,
        batch: Batch | None,
        mesh: DeviceMesh | ProcessGroup | None,
        partitioner: PartitionerSource | None,
        src: int = 0,
        *,
        wrap: bool = True,
        device: torch.device | str | None = None,
    ) -> ShardedBatch:
        """Scatter ``batch`` from rank ``src``: every rank receives only its own rows.

        **Collective** over the mesh's group: every rank calls it. Two small
        broadcasts of ``src``'s header (the partitioner, the owned counts, the
        system fields, the per-atom field names, dtypes and shapes), then one
        packed ``reshard_by_destination`` that moves each atom from ``src`` to its
        owner: memory on every other rank is O(rows it owns).

        Parameters
        ----------
        batch:
            The whole batch on ``src``; ignored elsewhere (pass None).
        mesh:
            A 1-D DeviceMesh, a ProcessGroup, or None (the default group).
        partitioner:
            On ``src``: a :class:`SpatialPartitioner`, or a factory
            ``batch -> SpatialPartitioner`` (e.g. to balance cuts on the atoms);
            it is broadcast, so every rank gets ``src``'s boxes. Ignored elsewhere.
        src:
            The rank (in the mesh's group) holding the batch.
        wrap:
            Wrap positions into the cell on periodic axes first (default True);
            the halo expects wrapped positions.
        device:
            Where the local batches live; default: ``src``'s device type (a CUDA
            batch lands on each rank's current CUDA device).

        Raises
        ------
        ValidationError, ConfigurationError
            On every rank together, when ``src``'s batch or partitioner is bad
            (malformed fields, a system without atoms, a world size or pbc that
            does not match), or when the partition is degenerate and the
            partitioner requires it not to be (else a
            :class:`DegeneratePartitionWarning` on every rank).
        """
        group, dmesh = resolve_group(mesh)
        world, rank = get_world_size(group), get_rank(group)
        if not 0 <= src < world:
            raise ConfigurationError(f"rank {rank}: src {src} is outside [0, {world})")
        part: SpatialPartitioner | None = None
        header: Header | None = None
        sent = None
        if rank == src:
            header, part, fields, destination = src_header(batch, partitioner, world, wrap, src)
            sent = None if destination is None else (fields, destination)
        header = checked_header(broadcast_object(header, src, group), Header, rank, src)
        if header.state is None:  # pragma: no cover - defensive: set with the systems
            raise ValidationError(f"rank {rank}: incomplete header from rank {src}")
        if part is None:
            part = SpatialPartitioner._from_state(header.state)
        local = local_rows(header, sent, batch, device, group)
        new = cls.__new__(cls)
        new._setup(local, part, group, dmesh, header.counts)
        reasons = part.degeneracies(list(header.counts), cell=local.cell)
        enforce(reasons, part.require_nondegenerate)
        return new

    # ------------------------------------------------------------------ basics

    @property
    def n_atoms(self) -> int:
        """Atoms over all ranks."""
        return sum(self._counts)

    @property
    def owned_counts(self) -> tuple[int, ...]:
        """Owned atoms of every rank (as of the last scatter or migration)."""
        return self._counts

    @property
    def imbalance(self) -> float:
        """Load imbalance ``max / mean`` of :attr:`owned_counts` (1.0 is perfect)."""
        return imbalance_of(self._counts)

    @property
    def last_migration(self) -> MigrationStats | None:
        """What the last :meth:`migrate` did (None before the first)."""
        return self._last

    def __repr__(self) -> str:
        return (
            f"ShardedBatch(rank={self.rank}, world_size={self.world_size}, "
            f"n_owned={self.n_owned}, n_atoms={self.n_atoms}, n_systems={self.local_batch.n_systems}, "
            f"imbalance={self.imbalance:.3f})"
        )

    # -------------------------------------------------------------- gathering
    def gather(self, dst: int = 0) -> Batch | None:
        """The whole batch, in atom-id order, on rank ``dst`` (None elsewhere).

        **Collective** over :attr:`group`: every rank calls it with the same
        ``dst``. One packed ``reshard_by_destination`` of every per-atom field to
        ``dst``; system fields are ``dst``'s copies.
        """
        return gather_to(self.local_batch, dst, self.group)

    def to_global(self) -> Batch:
        """The whole batch, in atom-id order, on every rank.

        **Collective** over :attr:`group`: every rank calls it. One packed
        exchange in which every rank sends its rows to every rank (O(N) memory
        per rank, as the result).
        """
        return gather_to_all(self.local_batch, self.group)

    # --------------------------------------------------------------- updating
    def update_from_batch(self, batch: Batch, *, check: bool = True) -> None:
        """Replace the owned rows (and the system fields) by ``batch``'s.

        ``batch`` must hold exactly this rank's atom ids (any order), e.g. the
        local batch after an integrator step. With ``check`` (default) this is
        **Collective** over :attr:`group` (one all-reduce of a failure flag) so a
        mismatch raises :class:`ValidationError` on every rank together; with
        ``check=False`` it is local and trusts the caller.
        """
        if check:
            raise_if_any_rank(self._update_problem(batch), self.group)
        self.local_batch = batch

    def _update_problem(self, batch: object) -> str | None:
        if not isinstance(batch, Batch):
            return f"update_from_batch needs a Batch, got {type(batch).__name__}"
        local = self.local_batch
        if batch.n_atoms != local.n_atoms or batch.n_systems != local.n_systems:
            return (
                f"update_from_batch: batch has {batch.n_atoms} atoms in {batch.n_systems} "
                f"systems, this rank owns {local.n_atoms} atoms in {local.n_systems} systems"
            )
        mine = torch.sort(local.atom_ids).values
        theirs = torch.sort(batch.atom_ids.to(local.atom_ids.device)).values
        if not torch.equal(mine, theirs):
            diff = (mine != theirs).nonzero()[0, 0]
            return (
                f"update_from_batch: atom ids differ from the owned ids (first difference at "
                f"sorted position {int(diff)}: owned {int(mine[diff])}, got {int(theirs[diff])})"
            )
        return None

    # -------------------------------------------------------------- migrating
    def migrate(self, hysteresis: float = 0.0) -> MigrationStats:
        """Wrap positions and send every atom that left its owner's box to its new owner.

        **Collective** over :attr:`group`: every rank calls it with the same
        ``hysteresis``. One all-reduce of a small count vector (new owned counts,
        moved atoms, failure flag), then, only if some atom moves, one packed
        ``reshard_by_destination`` of every per-atom field (extras included). An
        atom stays while it is inside its box grown by ``hysteresis`` (see
        :meth:`SpatialPartitioner.keeps_owner`), so atoms on a face do not
        ping-pong. The id set is conserved exactly.

        Returns
        -------
        MigrationStats
            Also kept in :attr:`last_migration`.

        Raises
        ------
        ConfigurationError
            If ``hysteresis`` is negative or not below the skin.
        ValidationError
            On every rank together, if any rank has non-finite positions; or
            (with ``require_nondegenerate``) when a rank is left without atoms.
        """
        part, group = self.partitioner, self.group
        h = part.check_hysteresis(hysteresis)
        world, rank = self.world_size, self.rank
        local = self.local_batch
        pos, si, cell = local.positions, local.system_index, local.cell
        bad = ~torch.isfinite(pos).all(dim=1)
        # every atom's destination (non-finite rows kept in place): no host read
        # before the one copy of the counts (a GPU queues the whole computation)
        wrapped, dest = part._destinations(pos, si, rank, h, cell)
        per_rank = _destination_counts(dest, world)
        sent = torch.zeros(world, dtype=torch.int64, device=dest.device)
        sent[rank] = (dest != rank).sum()  # each rank's own slot: summed, all are known
        stats = torch.cat([per_rank, sent, bad.sum().reshape(1)])
        total = all_reduce_sum(stats, group)  # the one read of this step's migration
        if int(total[2 * world]):
            message = None
            n_bad = int(bad.sum())
            if n_bad:
                row = int(bad.nonzero()[0, 0])
                message = (
                    f"migrate: {n_bad} of {local.n_atoms} owned atoms have non-finite "
                    f"positions (first id {int(local.atom_ids[row])}: {pos[row].tolist()})"
                )
            raise_if_any_rank(message, group)
        n_sent = int(total[world + rank])
        counts = tuple(int(c) for c in total[:world].tolist())
        n_moved = int(total[world : 2 * world].sum())
        if n_moved:
            fields = local.atom_fields()
            fields["positions"] = wrapped
            rows = reshard(fields, dest, group)
            self.local_batch = local.with_atom_fields(rows)
        else:
            self.local_batch = local.replace(positions=wrapped)
        self._counts = counts
        kept = local.n_atoms - n_sent
        self._last = MigrationStats(
            n_moved=n_moved,
            n_sent=n_sent,
            n_received=counts[rank] - kept,
            owned_counts=counts,
        )
        enforce(empty_rank_reasons(counts), part.require_nondegenerate)
        return self._last

    def rebalance(
        self,
        src: int = 0,
        *,
        grid_dims: Sequence[int] | Sequence[Sequence[int]] | None = None,
        hysteresis: float = 0.0,
    ) -> MigrationStats:
        """Re-cut the boxes at the current atoms' quantiles and move atoms to them.

        **Collective** over :attr:`group`: every rank calls it with the same
        arguments. The positions and system indices of every atom (no other field)
        go to ``src`` in one packed exchange (O(N) memory there only); ``src``
        builds a :attr:`BalanceMode.QUANTILE` partitioner with the same pbc, ghost
        width, skin and degeneracy policy (:meth:`SpatialPartitioner.rebuilt`,
        grid chosen again unless ``grid_dims``), broadcasts it, and
        :meth:`migrate` moves the atoms. Use it when :attr:`imbalance` drifts
        (a droplet that wanders or evaporates).

        Returns
        -------
        MigrationStats
            Of the migration to the new boxes.
        """
        world, rank, group = self.world_size, self.rank, self.group
        if not 0 <= src < world:
            raise ConfigurationError(f"rank {rank}: src {src} is outside [0, {world})")
        part = self.partitioner
        h = part.check_hysteresis(hysteresis)
        local = self.local_batch
        dest = torch.full((local.n_atoms,), src, dtype=torch.int64, device=local.device)
        pos = local.positions.detach()
        finite = bool(torch.isfinite(pos).all())
        rows = reshard({"positions": pos, "system_index": local.system_index}, dest, group)
        problem = None
        new: SpatialPartitioner | None = None
        if rank == src:
            try:
                if not finite or not bool(torch.isfinite(rows["positions"]).all()):
                    raise ValidationError("rebalance: non-finite positions")
                new = part.rebuilt(
                    rows["positions"], rows["system_index"], cell=local.cell, grid_dims=grid_dims
                )
            except (ConfigurationError, ValidationError) as exc:
                problem = (type(exc).__name__, f"rank {src}: {exc}")
        verdict = broadcast_object(problem, src, group)
        if verdict is not None:
            raise ERRORS[verdict[0]](verdict[1])
        self.partitioner = SpatialPartitioner.broadcast(new, src, group)
        return self.migrate(h)


#: Up to this many ranks, :func:`_destination_counts` compares instead of scattering.
_COMPARE_WORLD = 16


def _destination_counts(dest: torch.Tensor, world: int) -> torch.Tensor:
    """How many of ``dest`` go to each rank, int64 ``(world,)`` on their device.

    Not ``bincount`` (on CUDA it reads its input's maximum on the host); for a
    few ranks not a scatter either: ``scatter_add_`` of a million ones into one
    or two slots serialises on their atomics (a rebuild's timeline on an H200,
    LJ 1M on one rank, credited migration with 0.78 ms of scatter kernels),
    while ``world`` comparisons and a sum stream through memory.
    """
    if world <= _COMPARE_WORLD:
        ranks = torch.arange(world, dtype=dest.dtype, device=dest.device)
        return (dest.unsqueeze(0) == ranks.unsqueeze(1)).sum(dim=1)
    per_rank = torch.zeros(world, dtype=torch.int64, device=dest.device)
    return per_rank.scatter_add_(0, dest, torch.ones_like(dest))
