"""nvdd.partition: who owns which atom (layer 2 of nvdd).

- :class:`SpatialPartitioner` chooses a rank grid for each system's cell (the one
  with the smallest halo), places the cuts between sub-domains (evenly, or at atom
  quantiles to balance the load), and answers ownership (``owner_of``) and
  hysteresis (``keeps_owner``) questions; ``halo_config`` hands its boxes to
  :mod:`nvdd.halo`.
- :class:`ShardedBatch` holds each rank's owned atoms of a
  :class:`~nvdd.core.Batch`: scatter from one rank, gather to one or all ranks,
  and migrate atoms that left their box.
- :class:`IndexPartitioner` splits item indices into balanced contiguous blocks;
  :class:`IndexShardedBatch` holds each rank's block of atoms (in atom-id order)
  and :func:`graph_ghosts` finds the atoms a block's edges read (the
  graph-partition strategy).
"""

from nvdd.partition.__about__ import __version__
from nvdd.partition._degenerate import DegeneratePartitionWarning
from nvdd.partition._graph import graph_ghosts
from nvdd.partition._index import IndexPartitioner
from nvdd.partition._index_sharded import IndexShardedBatch
from nvdd.partition._sharded import MigrationStats, ShardedBatch
from nvdd.partition._spatial import BalanceMode, SpatialPartitioner

__all__ = [
    "BalanceMode",
    "DegeneratePartitionWarning",
    "IndexPartitioner",
    "IndexShardedBatch",
    "MigrationStats",
    "ShardedBatch",
    "SpatialPartitioner",
    "__version__",
    "graph_ghosts",
]
