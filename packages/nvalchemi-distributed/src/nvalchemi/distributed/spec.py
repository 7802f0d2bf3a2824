"""The ``SPEC_*`` presets (``from nvalchemi.distributed.spec import SPEC_MPNN_HALO``)."""

from nvdd.spec import (
    SPEC_DFTD3_HALO,
    SPEC_EWALD_HALO,
    SPEC_LJ_HALO,
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    SPEC_PME_HALO,
    SPEC_UMA_HALO,
)

__all__ = [
    "SPEC_DFTD3_HALO",
    "SPEC_EWALD_HALO",
    "SPEC_LJ_HALO",
    "SPEC_MPNN_GP",
    "SPEC_MPNN_HALO",
    "SPEC_PME_HALO",
    "SPEC_UMA_HALO",
]
