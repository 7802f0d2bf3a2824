"""`IndexShardedBatch`: the atoms of a `Batch` split by index (graph partition).

The atoms are put in one order at the scatter (atom-id order, or a space-filling
curve for locality) and numbered along it: the *global index*. Rank ``r`` owns
the contiguous block :meth:`IndexPartitioner.bounds` ``(r)`` and holds those rows
in that order, so local row ``k`` is global index ``start + k``. Ownership never
changes (nothing migrates): an atom belongs to its rank however far it moves,
which is what gives a model that builds its own neighbour list a fixed node
partition of the graph.
"""

from __future__ import annotations

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
from nvdd.partition._comm import all_reduce_max, broadcast_object, resolve_group
from nvdd.partition._gather import gather_to, gather_to_all
from nvdd.partition._index import IndexPartitioner
from nvdd.partition._owned import OwnedRows
from nvdd.partition._scatter import checked_header, local_rows

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ORDERS", "IndexShardedBatch", "space_order"]


@dataclass(frozen=True)
class _Header:
    """What ``src`` broadcasts before scattering (no per-atom data)."""

    error: tuple[str, str] | None
    n_atoms: int = 0
    atom_specs: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...] = ()
    systems: dict[str, torch.Tensor] | None = None
    system_extras: tuple[str, ...] = ()
    device_type: str = "cpu"


#: The orders :meth:`IndexShardedBatch.from_batch` numbers atoms in.
ORDERS = ("id", "space")
_MORTON_BITS = 10  # per axis: 1024 cells along each axis of a system


def _spread_bits(v: torch.Tensor) -> torch.Tensor:
    """Insert two zero bits between the low 10 bits of ``v`` (int64)."""
    v = v & 0x3FF
    v = (v | (v << 16)) & 0x030000FF
    v = (v | (v << 8)) & 0x0300F00F
    v = (v | (v << 4)) & 0x030C30C3
    return (v | (v << 2)) & 0x09249249


def space_order(batch: Batch) -> torch.Tensor:
    """A permutation of ``batch``'s atoms along a Z-order (Morton) curve, per system.

    Fractional coordinates of each system's domain cell (wrapped on periodic
    axes, scaled to the atoms' extent on open ones) are cut into ``2**10`` cells
    per axis and their bits interleaved; ties keep atom-id order. Contiguous
    index blocks of the result are compact regions, so a block's neighbours are
    few (a good node partition for short-range graphs).
    """
    from nvdd.partition._geometry import build_domain_cell

    pos = batch.positions.detach().to("cpu", torch.float64)
    si = batch.system_index.cpu()
    key = torch.zeros(batch.n_atoms, dtype=torch.int64)
    for s in range(batch.n_systems):
        rows = (si == s).nonzero().flatten()
        if rows.numel() == 0:
            continue
        periodic = batch.pbc[s].cpu()
        dom, _ = build_domain_cell(batch.cell[s], periodic, pos[rows])
        frac = pos[rows] @ torch.linalg.inv(dom)
        frac = torch.where(periodic, frac - torch.floor(frac), frac)
        lo = torch.where(periodic, torch.zeros(3, dtype=torch.float64), frac.min(dim=0).values)
        hi = torch.where(periodic, torch.ones(3, dtype=torch.float64), frac.max(dim=0).values)
        cells = ((frac - lo) / (hi - lo).clamp_min(1e-300) * (1 << _MORTON_BITS)).long()
        cells = cells.clamp(0, (1 << _MORTON_BITS) - 1)
        code = _spread_bits(cells[:, 0]) | (_spread_bits(cells[:, 1]) << 1)
        key[rows] = (code | (_spread_bits(cells[:, 2]) << 2)) + (s << (3 * _MORTON_BITS))
    by_id = torch.argsort(batch.atom_ids.cpu())
    return by_id[torch.argsort(key[by_id], stable=True)].to(batch.device)


def _src_rows(
    batch: Batch | None, world: int, src: int, order: str
) -> tuple[_Header, dict[str, torch.Tensor], torch.Tensor | None]:
    """Validate on ``src``; the header, the rows in global order and their destinations."""
    try:
        if not isinstance(batch, Batch):
            raise ValidationError(f"from_batch needs a Batch on src, got {type(batch).__name__}")
        batch.validate()
        if order not in ORDERS:
            raise ConfigurationError(f"order must be one of {ORDERS}, got {order!r}")
        perm = torch.argsort(batch.atom_ids) if order == "id" else space_order(batch)
        part = IndexPartitioner(batch.n_atoms, world)
        dest = part.owner_of(torch.arange(batch.n_atoms, device=batch.device))
    except (ConfigurationError, ValidationError) as exc:
        name = type(exc).__name__
        return _Header(error=(name, f"rank {src}: {exc}")), {}, None
    fields = {k: v.index_select(0, perm) for k, v in batch.atom_fields().items()}
    header = _Header(
        error=None,
        n_atoms=batch.n_atoms,
        atom_specs=tuple((k, v.dtype, tuple(v.shape[1:])) for k, v in fields.items()),
        systems={k: v.detach().cpu() for k, v in batch.system_fields().items()},
        system_extras=tuple(batch.system_extras),
        device_type=batch.device.type,
    )
    return header, fields, dest


class IndexShardedBatch(OwnedRows):
    """A :class:`~nvdd.core.Batch` split over a 1-D mesh by global index.

    Build it with :meth:`from_batch` (scatter from one rank). Each rank holds the
    atoms of its :class:`IndexPartitioner` block and a copy of every system field;
    it is the state owner of the graph-partition strategy (the integrator reads
    and writes :attr:`local_batch`).

    Parameters
    ----------
    local_batch:
        This rank's block, in global-index order (rows keep their order: local
        row ``k`` is global index ``bounds[0] + k``).
    mesh:
        A 1-D DeviceMesh, a ProcessGroup, or None (the default group).

    Notes
    -----
    The constructor is **Collective** over the mesh's group (one all-reduce of the
    block sizes and a failure flag): every rank's block must be the size the
    :class:`IndexPartitioner` of the total gives it, or every rank raises
    :class:`~nvdd.core.ValidationError`.
    """

    __slots__ = ("_partitioner",)

    def __init__(self, local_batch: Batch, mesh: DeviceMesh | ProcessGroup | None = None) -> None:
        group, dmesh = resolve_group(mesh)
        world, rank = get_world_size(group), get_rank(group)
        problem = None
        n = 0
        if not isinstance(local_batch, Batch):
            problem = f"local_batch must be a Batch, got {type(local_batch).__name__}"
        else:
            n = local_batch.n_atoms
        counts = torch.zeros(world + 1, dtype=torch.int64)
        counts[rank] = n
        counts[world] = int(problem is not None)
        # counts are disjoint per rank, so a max is a gather
        total = all_reduce_max(counts, group)
        if int(total[world]):
            raise_if_any_rank(problem, group)
        part = IndexPartitioner(int(total[:world].sum()), world)
        got, want = tuple(int(c) for c in total[:world].tolist()), part.counts()
        if got != want:
            raise ValidationError(
                f"rank {rank}: block sizes {got} are not the balanced split {want} of "
                f"{part.n_items} atoms over {world} ranks (IndexPartitioner)"
            )
        self._setup(local_batch, part, group, dmesh)

    def _setup(
        self,
        local: Batch,
        partitioner: IndexPartitioner,
        group: ProcessGroup | None,
        mesh: DeviceMesh | None,
    ) -> None:
        self.local_batch = local
        self._partitioner = partitioner
        self.group = group
        self._mesh = mesh

    @classmethod
    def from_batch(
        cls,
        batch: Batch | None,
        mesh: DeviceMesh | ProcessGroup | None = None,
        src: int = 0,
        *,
        order: str = "id",
        device: torch.device | str | None = None,
    ) -> IndexShardedBatch:
        """Scatter ``batch`` from rank ``src``: every rank receives its index block.

        **Collective** over the mesh's group: every rank calls it. One broadcast of
        ``src``'s header (atom count, per-atom field names, dtypes and shapes, the
        system fields), then one packed ``reshard_by_destination``: memory on every
        other rank is O(rows it owns). Positions are not wrapped: under graph
        partition the model applies the periodic boundaries itself.

        Parameters
        ----------
        batch:
            The whole batch on ``src``; ignored elsewhere (pass None).
        mesh:
            A 1-D DeviceMesh, a ProcessGroup, or None (the default group).
        src:
            The rank (in the mesh's group) holding the batch.
        order:
            How atoms are numbered before the split: ``"id"`` (atom-id order) or
            ``"space"`` (a Z-order curve per system, :func:`space_order`: compact
            blocks, few ghost rows; what ``DomainParallel`` uses).
        device:
            Where the local batches live; default: ``src``'s device type (a CUDA
            batch lands on each rank's current CUDA device).

        Raises
        ------
        ValidationError, ConfigurationError
            On every rank together, when ``src``'s batch is malformed or
            ``order`` is unknown.
        """
        group, dmesh = resolve_group(mesh)
        world, rank = get_world_size(group), get_rank(group)
        if not 0 <= src < world:
            raise ConfigurationError(f"rank {rank}: src {src} is outside [0, {world})")
        header: _Header | None = None
        sent = None
        if rank == src:
            header, fields, dest = _src_rows(batch, world, src, order)
            sent = None if dest is None else (fields, dest)
        header = checked_header(broadcast_object(header, src, group), _Header, rank, src)
        local = local_rows(header, sent, batch, device, group)
        new = cls.__new__(cls)
        new._setup(local, IndexPartitioner(header.n_atoms, world), group, dmesh)
        return new

    # ------------------------------------------------------------------ basics

    @property
    def partitioner(self) -> IndexPartitioner:
        """The index split (identical on every rank)."""
        return self._partitioner

    @property
    def n_atoms(self) -> int:
        """Atoms over all ranks."""
        return self._partitioner.n_items

    @property
    def owned_counts(self) -> tuple[int, ...]:
        """Owned atoms of every rank (fixed: nothing migrates)."""
        return self._partitioner.counts()

    @property
    def bounds(self) -> tuple[int, int]:
        """``(start, stop)``: the global indices of this rank's rows."""
        return self._partitioner.bounds(self.rank)

    @property
    def imbalance(self) -> float:
        """``max / mean`` of :attr:`owned_counts` (at most ``1 + world / n_atoms``)."""
        return imbalance_of(self.owned_counts)

    def __repr__(self) -> str:
        return (
            f"IndexShardedBatch(rank={self.rank}, world_size={self.world_size}, "
            f"bounds={self.bounds}, n_atoms={self.n_atoms}, n_systems={self.local_batch.n_systems})"
        )

    # -------------------------------------------------------------- gathering
    def gather(self, dst: int = 0) -> Batch | None:
        """The whole batch, in atom-id order, on rank ``dst`` (None elsewhere).

        **Collective** over :attr:`group` (one packed reshard to ``dst``).
        """
        return gather_to(self.local_batch, dst, self.group)

    def to_global(self) -> Batch:
        """The whole batch, in atom-id order, on every rank.

        **Collective** over :attr:`group` (one packed exchange, O(N) per rank).
        """
        return gather_to_all(self.local_batch, self.group)
