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
    rows, its process group and mesh.

    Attributes
    ----------
    local_batch:
        This rank's owned atoms and every system's fields. The one owner of
        this rank's atom state under ``DomainParallel`` (the integrator reads
        and writes its ``batch`` here; a step reads it several times, so it is
        a plain attribute). Assigning replaces the owned rows without a check
        (local).
    group:
        The process group (None: the default group).
    """

    __slots__ = ("_mesh", "group", "local_batch")
    local_batch: Batch
    group: ProcessGroup | None
    _mesh: DeviceMesh | None

    @property
    def mesh(self) -> DeviceMesh | None:
        """The 1-D device mesh, when one was given."""
        return self._mesh

    @property
    def rank(self) -> int:
        """This rank in :attr:`group`."""
        return get_rank(self.group)

    @property
    def world_size(self) -> int:
        """Number of ranks in :attr:`group`."""
        return get_world_size(self.group)

    @property
    def n_owned(self) -> int:
        """Atoms owned by this rank."""
        return self.local_batch.n_atoms
