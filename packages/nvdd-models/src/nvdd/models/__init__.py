"""nvdd.models: neighbour lists and models that run unchanged under domain decomposition.

- :class:`NeighborList` / :class:`VerletList`: full COO edge lists with integer
  image shifts (periodic, open and mixed boundaries, several systems per batch),
  searched by vesin; the Verlet list keeps a skin and rebuilds only when needed.
- :class:`LennardJones`: per-species Lennard-Jones, direct or autograd forces;
  :class:`LJBackend` picks Warp kernels over a device neighbour list (no host
  synchronisation in a step that rebuilds nothing) or the torch reference.
- :class:`ReferenceMPNN`: a small deterministic message-passing network.

Both models are ``nvdd.spec.BaseModelMixin``s: ``distribution_spec()`` returns
``SPEC_LJ_HALO`` / ``SPEC_MPNN_HALO``, and inside a live DD context
(``nvdd.shardtensor.dd_scope``) ``forward`` runs on one rank's
``[owned | ghost]`` rows (owned receivers, owned energies, forces on every row).
"""

from nvdd.models.__about__ import __version__
from nvdd.models._lj import LennardJones
from nvdd.models._lj_config import ForceMode, LJBackend, LJConfig, MixingRule
from nvdd.models._mpnn import MPNNConfig, ReferenceMPNN
from nvdd.models._neighbors import EdgeList, NeighborList
from nvdd.models._verlet import VerletList

__all__ = [
    "EdgeList",
    "ForceMode",
    "LJBackend",
    "LJConfig",
    "LennardJones",
    "MPNNConfig",
    "MixingRule",
    "NeighborList",
    "ReferenceMPNN",
    "VerletList",
    "__version__",
]
