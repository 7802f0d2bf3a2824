"""nvdd.models: neighbour lists and models that run unchanged under domain decomposition.

- :class:`NeighborList` / :class:`VerletList`: full COO edge lists with integer
  image shifts (periodic, open and mixed boundaries, several systems per batch),
  searched by vesin; the Verlet list keeps a skin and rebuilds only when needed.
- :class:`LennardJones`: per-species Lennard-Jones, direct or autograd forces.
- :class:`ReferenceMPNN`: a small deterministic message-passing network.
- :class:`MACEModel`: any mace-torch ``MACE`` / ``ScaleShiftMACE`` (the optional
  ``nvdd-models[mace]`` extra; :func:`load_mace` reads a saved ``.model`` file,
  :func:`build_mace` builds a random one from a :class:`MACEConfig`).

Every model is an ``nvdd.spec.BaseModelMixin``: ``distribution_spec()`` returns
``SPEC_LJ_HALO`` / ``SPEC_MPNN_HALO`` / ``SPEC_MACE_HALO``, and inside a live DD context
(``nvdd.shardtensor.dd_scope``) ``forward`` runs on one rank's
``[owned | ghost]`` rows (owned receivers, owned energies, forces on every row).
"""

from nvdd.models.__about__ import __version__
from nvdd.models._lj import LennardJones
from nvdd.models._lj_config import ForceMode, LJConfig, MixingRule
from nvdd.models._mace import MACEModel
from nvdd.models._mace_build import MACEConfig, build_mace, load_mace
from nvdd.models._mpnn import MPNNConfig, ReferenceMPNN
from nvdd.models._neighbors import EdgeList, NeighborList
from nvdd.models._verlet import VerletList

__all__ = [
    "EdgeList",
    "ForceMode",
    "LJConfig",
    "LennardJones",
    "MACEConfig",
    "MACEModel",
    "MPNNConfig",
    "MixingRule",
    "NeighborList",
    "ReferenceMPNN",
    "VerletList",
    "build_mace",
    "load_mace",
    "__version__",
]
