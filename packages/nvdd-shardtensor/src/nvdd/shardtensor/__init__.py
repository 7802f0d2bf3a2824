"""nvdd.shardtensor: per-atom tensors whose rows are ``[owned | ghost]``, the live
domain-decomposition context and the intent vocabulary (layer 1 of nvdd).

A model written against plain torch runs unchanged on ShardTensors: scatters
along the rows fold ghost contributions into their owners, gathers read ghost
rows that are kept current, and everything else runs on the local tensor.
Code that needs to say what it means uses the verbs: :func:`refresh_neighbors`,
:func:`scatter_to_owners`, :func:`system_sum`, :func:`to_local`,
:func:`localize`, :func:`autograd_target`, inside :func:`dd_scope`.
"""

from nvdd.shardtensor.__about__ import __version__
from nvdd.shardtensor._autograd import sum_over_ranks
from nvdd.shardtensor._context import DDContext, Scope, current_dd_context, dd_scope
from nvdd.shardtensor._image_layout import SelfImageLayout
from nvdd.shardtensor._protocol import HaloLayout
from nvdd.shardtensor._shard_tensor import ShardTensor
from nvdd.shardtensor._verbs import (
    autograd_target,
    localize,
    refresh_neighbors,
    scatter_to_owners,
    system_sum,
    to_local,
)

__all__ = [
    "DDContext",
    "HaloLayout",
    "Scope",
    "SelfImageLayout",
    "ShardTensor",
    "__version__",
    "autograd_target",
    "current_dd_context",
    "dd_scope",
    "localize",
    "refresh_neighbors",
    "scatter_to_owners",
    "sum_over_ranks",
    "system_sum",
    "to_local",
]
