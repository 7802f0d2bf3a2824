"""What every distributed batch of this package shares: the owned rows and the group."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nvdd.core import Batch, get_rank, get_world_size

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["OwnedRows"]


class OwnedRows:
    """Base of :class:`ShardedBatch` and :class:`IndexShardedBatch`: this rank's owned
    rows (``_local``), its process group (``_group``) and mesh (``_mesh``)."""

    __slots__ = ("_group", "_local", "_mesh")
    _local: Batch
    _group: ProcessGroup | None
    _mesh: DeviceMesh | None

    @property
    def local_batch(self) -> Batch:
        """This rank's owned atoms and every system's fields.

        The one owner of this rank's atom state under ``DomainParallel`` (the
        integrator reads and writes its ``batch`` here). Assigning replaces the
        owned rows without a check (local).
        """
        return self._local

    @local_batch.setter
    def local_batch(self, batch: Batch) -> None:
        self._local = batch

    @property
    def group(self) -> ProcessGroup | None:
        """The process group (None: the default group)."""
        return self._group

    @property
    def mesh(self) -> DeviceMesh | None:
        """The 1-D device mesh, when one was given."""
        return self._mesh

    @property
    def rank(self) -> int:
        """This rank in :attr:`group`."""
        return get_rank(self._group)

    @property
    def world_size(self) -> int:
        """Number of ranks in :attr:`group`."""
        return get_world_size(self._group)

    @property
    def n_owned(self) -> int:
        """Atoms owned by this rank."""
        return self._local.n_atoms
