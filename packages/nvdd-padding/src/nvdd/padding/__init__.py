"""nvdd.padding: fixed-shape padding of graphs so a compiled forward is reused.

Under the graph-partition strategy (and any compiled forward) the per-rank atom
and edge counts drift every step. The padders here pad them to capacities that
only grow, geometrically and rank-agreed (:func:`resolve_cap`), so
``torch.compile`` sees the same shapes step after step. Padding entries follow
one rule (see :class:`GraphPadder`) that keeps them out of every real result.
"""

from nvdd.padding.__about__ import __version__
from nvdd.padding._cap import (
    DEFAULT_GROWTH,
    DEFAULT_MULTIPLE,
    CapacityRegistry,
    GrowthEvent,
    GrowthListener,
    default_registry,
    resolve_cap,
)
from nvdd.padding._coo import COOGraph, COOPadder, PaddedCOO
from nvdd.padding._dense import DenseGraph, DensePadder, PaddedDense
from nvdd.padding._dense_batch import DenseBatchGraph, DenseBatchPadder, PaddedDenseBatch
from nvdd.padding._protocol import GraphPadder, PaddedGraph

__all__ = [
    "DEFAULT_GROWTH",
    "DEFAULT_MULTIPLE",
    "COOGraph",
    "COOPadder",
    "CapacityRegistry",
    "DenseBatchGraph",
    "DenseBatchPadder",
    "DenseGraph",
    "DensePadder",
    "GraphPadder",
    "GrowthEvent",
    "GrowthListener",
    "PaddedCOO",
    "PaddedDense",
    "PaddedDenseBatch",
    "PaddedGraph",
    "__version__",
    "default_registry",
    "resolve_cap",
]
