"""nvdd.models: neighbour lists and models that run unchanged under domain decomposition.

- :class:`NeighborList` / :class:`VerletList`: full COO edge lists with integer
  image shifts (periodic, open and mixed boundaries, several systems per batch),
  searched by vesin; the Verlet list keeps a skin and rebuilds only when needed.
- :class:`LennardJones`: per-species Lennard-Jones, direct or autograd forces;
  :class:`LJBackend` picks Warp kernels over a device neighbour list (no host
  synchronisation in a step that rebuilds nothing) or the torch reference.
- :class:`ReferenceMPNN`: a small deterministic message-passing network.
- :class:`Ewald` / :class:`ParticleMeshEwald`: electrostatics of per-atom charges
  (``atom_extras["charges"]``, :func:`assign_charges`) on nvalchemi-toolkit-ops
  kernels (extra ``nvdd-models[longrange]``); under DD the reciprocal term is
  combined across ranks by one all-reduce (structure factors / charge mesh).
- :class:`DFTD3`: D3(BJ) dispersion with tad-dftd3's reference tables; under DD
  the coordination numbers of ghost rows are refreshed from their owners.
- :class:`PipelineModel`: the sum of several models; ``DomainParallel`` runs it
  under one halo, each component by its own spec.

- :class:`MACEModel`: any mace-torch ``MACE`` / ``ScaleShiftMACE`` (the optional
  ``nvdd-models[mace]`` extra; :func:`load_mace` reads a saved ``.model`` file,
  :func:`build_mace` builds a random one from a :class:`MACEConfig`).
- :class:`SevenNetModel`: a SevenNet potential (the optional ``nvdd-models[sevenn]``
  extra, its own environment: sevenn needs e3nn >= 0.5, mace-torch 0.3.16 pins 0.4.4),
  from a checkpoint file or built from its configuration; it runs unmodified under
  DD on a receptive-field halo (``nvdd.spec.receptive_field_spec``).
- :class:`UMAModel`: a fairchem UMA (eSCN-MD) potential (the optional
  ``nvdd-models[uma]`` extra, in SevenNet's environment for the same e3nn reason),
  from a fairchem checkpoint or built from its configuration; it runs unmodified
  under DD on a receptive-field halo, a mixture-of-experts backbone once merged
  for the system's composition.
- :class:`AIMNet2Model`: an AIMNet2 potential (the optional ``nvdd-models[aimnet2]``
  extra), from an aimnet v2 file or built from its configuration; under DD on a
  receptive-field halo, its neural charge equilibration's sums all-reduced over ranks.

Every model is an ``nvdd.spec.BaseModelMixin``: ``distribution_spec()`` returns
its preset (``SPEC_LJ_HALO``, ``SPEC_MPNN_HALO``, ``SPEC_MACE_HALO``, ``SPEC_EWALD_HALO``,
``SPEC_PME_HALO``, ``SPEC_DFTD3_HALO``) or the ``spec=`` it was built with, and inside a live DD context
(``nvdd.shardtensor.dd_scope``) ``forward`` runs on one rank's
``[owned | ghost]`` rows (owned receivers, owned energies, forces on every row).
"""

from nvdd.models.__about__ import __version__
from nvdd.models._aimnet2 import AIMNet2Model
from nvdd.models._charges import CHARGES, assign_charges
from nvdd.models._coulomb_config import COULOMB_EV_A, EwaldConfig, PMEConfig
from nvdd.models._dftd3 import DFTD3, D3Config
from nvdd.models._ewald import Ewald
from nvdd.models._lj import LennardJones
from nvdd.models._lj_config import ForceMode, LJBackend, LJConfig, MixingRule
from nvdd.models._mace import MACEModel
from nvdd.models._mace_build import MACEConfig, build_mace, load_mace
from nvdd.models._mpnn import MPNNConfig, ReferenceMPNN
from nvdd.models._neighbors import EdgeList, NeighborList
from nvdd.models._pipeline import PipelineModel
from nvdd.models._pme import ParticleMeshEwald
from nvdd.models._sevenn import SevenNetModel
from nvdd.models._uma import UMAModel
from nvdd.models._verlet import VerletList

__all__ = [
    "AIMNet2Model",
    "CHARGES",
    "COULOMB_EV_A",
    "D3Config",
    "DFTD3",
    "EdgeList",
    "Ewald",
    "EwaldConfig",
    "ForceMode",
    "LJBackend",
    "LJConfig",
    "LennardJones",
    "MACEConfig",
    "MACEModel",
    "MPNNConfig",
    "MixingRule",
    "NeighborList",
    "PMEConfig",
    "ParticleMeshEwald",
    "PipelineModel",
    "ReferenceMPNN",
    "SevenNetModel",
    "UMAModel",
    "VerletList",
    "assign_charges",
    "build_mace",
    "load_mace",
    "__version__",
]
