"""nvdd.halo: ghost atoms with explicit periodic images, and atom migration.

Layer 1 of nvdd. A :class:`HaloPlan` says which owned rows every rank sends to
which rank, with which periodic image shift; its forward and reverse exchanges
are exact adjoints of each other (and each other's autograd backward).
:func:`reshard_by_destination` moves rows (atoms) to their new owner ranks.
:func:`build_request_plan` builds the same plan from the rows a rank asks for
(the graph-partition strategy: the atoms its edges read).
"""

from nvdd.halo.__about__ import __version__
from nvdd.halo._config import ParticleHaloConfig
from nvdd.halo._plan import HaloPlan, build_halo_plan
from nvdd.halo._requests import build_request_plan
from nvdd.halo._reshard import reshard_by_destination
from nvdd.halo._select import SelectBackend

__all__ = [
    "HaloPlan",
    "ParticleHaloConfig",
    "SelectBackend",
    "__version__",
    "build_halo_plan",
    "build_request_plan",
    "reshard_by_destination",
]
