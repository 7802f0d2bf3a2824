"""The ``SPEC_*`` presets: one per communication pattern of the shipped model families.

Each preset differs from the others exactly where the pattern differs (see the
table in docs/concepts/specs.md, "The presets"):

=================  ========  =========  ================  ==========  =============
preset             storage   forces     scatter           extra halo  global term
=================  ========  =========  ================  ==========  =============
SPEC_LJ_HALO       halo      direct     none              0           none
SPEC_MPNN_HALO     halo      autograd   local, per layer  0           none
SPEC_UMA_HALO      halo      autograd   local, per layer  0           none
SPEC_EWALD_HALO    halo      direct     none              0           reciprocal
SPEC_PME_HALO      halo      direct     none              0           mesh
SPEC_DFTD3_HALO    halo      direct     local (CN)        0           none
SPEC_MPNN_GP       graph     autograd   local, per layer  n/a         none
=================  ========  =========  ================  ==========  =============
"""

from __future__ import annotations

from nvdd.spec._adapters import PythonAdapter
from nvdd.spec._spec import DistributionSpec, MLIPSpec
from nvdd.spec._types import (
    ForceStrategy,
    GlobalCoupling,
    OutputKind,
    OutputSpec,
    Reduce,
    ScatterMode,
    StrategyKind,
    StrategyOptions,
)

__all__ = [
    "DFTD3_CN_CUTOFF",
    "SPEC_DFTD3_HALO",
    "SPEC_EWALD_HALO",
    "SPEC_LJ_HALO",
    "SPEC_MPNN_GP",
    "SPEC_MPNN_HALO",
    "SPEC_PME_HALO",
    "SPEC_UMA_HALO",
    "graph_parallel_disabled",
]

#: Default coordination-number cutoff (Angstrom) of DFT-D3 (``nvdd.models.D3Config``).
DFTD3_CN_CUTOFF = 10.0

# Output declarations shared by the presets.
#: Per-system energy already summed over owned rows and all-reduced by the model
#: (``system_sum(scope=Scope.OWNED)``): correct on every rank.
_ENERGY_REPLICATED = OutputSpec(OutputKind.PER_GRAPH, Reduce.OWNED_ONLY)
#: Per-system partial sums (this rank's share): all-reduced by consolidation.
_PER_GRAPH_PARTIAL = OutputSpec(OutputKind.PER_GRAPH, Reduce.ALL_REDUCE)
#: Per-node partials on ``[owned | ghost]`` rows: ghost rows folded into owners.
_PER_NODE_FOLD = OutputSpec(OutputKind.PER_NODE, Reduce.ALL_REDUCE)
#: Per-node values already exact on owned rows.
_PER_NODE_OWNED = OutputSpec(OutputKind.PER_NODE, Reduce.OWNED_ONLY)

_SHORT_RANGE_OUTPUTS = {
    "energy": _ENERGY_REPLICATED,
    "forces": _PER_NODE_FOLD,
    "atom_energies": _PER_NODE_OWNED,
    "stress": _PER_GRAPH_PARTIAL,
    "virial": _PER_GRAPH_PARTIAL,
}
_LONG_RANGE_OUTPUTS = {
    **_SHORT_RANGE_OUTPUTS,
    # Real-space share of owned atoms plus the reciprocal share of owned charges.
    "energy": _PER_GRAPH_PARTIAL,
    "charges": _PER_NODE_OWNED,
}


def graph_parallel_disabled() -> bool:
    """Replacement for fairchem's ``gp_utils.initialized``: graph parallel off.

    Under nvdd's halo storage the model must run its single-process path on the
    padded rows; fairchem's own graph-parallel mode would split the graph again.
    """
    return False


SPEC_LJ_HALO = MLIPSpec(
    name="SPEC_LJ_HALO",
    # The pair kernel sums owned atom energies locally (Scope.LOCAL): consolidation
    # all-reduces the energy only on steps that ask for it, so a step that needs
    # only forces costs two all_to_all and one small all-reduce (one all_to_all
    # under nvdd.models.LennardJones's own variant, whose owned rows are exact
    # and whose ghost rows carry no force: nothing to fold). Per-atom virials
    # (opt-in, LJConfig.atom_virials) are booked like the atom energies: each edge
    # gives half its pair virial to its receiver, an owned row, so they are exact on
    # owned rows and nothing is folded.
    outputs={
        **_SHORT_RANGE_OUTPUTS,
        "energy": _PER_GRAPH_PARTIAL,
        "atom_virials": _PER_NODE_OWNED,
    },
    force_strategy=ForceStrategy.DIRECT,
    options=StrategyOptions(scatter=ScatterMode.NONE, wraps_periodic_axes=True),
)
"""Pair potential with direct forces: ghost forces are folded into their owners;
per-system energy and virial are local partials, all-reduced on demand; atom
energies and (when the model returns them) atom virials are exact on owned rows."""

SPEC_MPNN_HALO = MLIPSpec(
    name="SPEC_MPNN_HALO",
    outputs=_SHORT_RANGE_OUTPUTS,
    force_strategy=ForceStrategy.AUTOGRAD,
    options=StrategyOptions(scatter=ScatterMode.LOCAL, wraps_periodic_axes=True),
)
"""MACE, NequIP, Allegro, ORB: owned receivers, so scatters stay local (ghost rows
receive nothing) and ghost features are refreshed from their owners per layer:
one exchange per layer instead of a fold's two, the same forces."""

SPEC_UMA_HALO = MLIPSpec(
    name="SPEC_UMA_HALO",
    outputs=_SHORT_RANGE_OUTPUTS,
    force_strategy=ForceStrategy.AUTOGRAD,
    distribution=DistributionSpec(
        helpers=(
            PythonAdapter(
                "fairchem.core.common.gp_utils:initialized",
                graph_parallel_disabled,
                optional=True,
                declared_in="SPEC_UMA_HALO",
            ),
        ),
    ),
    options=StrategyOptions(scatter=ScatterMode.LOCAL),
)
"""UMA (eSCN family): owned-complete neighbourhoods with local scatters, ghost rows
refreshed per block, fairchem's own graph parallel disabled."""

SPEC_EWALD_HALO = MLIPSpec(
    name="SPEC_EWALD_HALO",
    outputs=_LONG_RANGE_OUTPUTS,
    force_strategy=ForceStrategy.DIRECT,
    distribution=DistributionSpec(sharded_fields=("positions", "atomic_numbers", "charges")),
    options=StrategyOptions(
        global_coupling=GlobalCoupling.RECIPROCAL_SUM, wraps_periodic_axes=True
    ),
)
"""Ewald: real space in the halo; reciprocal space from owned charges, structure
factors all-reduced."""

SPEC_PME_HALO = MLIPSpec(
    name="SPEC_PME_HALO",
    outputs=_LONG_RANGE_OUTPUTS,
    force_strategy=ForceStrategy.DIRECT,
    distribution=DistributionSpec(sharded_fields=("positions", "atomic_numbers", "charges")),
    options=StrategyOptions(global_coupling=GlobalCoupling.MESH_SUM, wraps_periodic_axes=True),
)
"""PME: real space in the halo; owned charges spread on the mesh, mesh all-reduced."""

SPEC_DFTD3_HALO = MLIPSpec(
    name="SPEC_DFTD3_HALO",
    # Forces by the model's own autograd (returned on every padded row, folded);
    # the energy is a per-rank partial like LJ's (no collective in the forward).
    outputs={**_SHORT_RANGE_OUTPUTS, "energy": _PER_GRAPH_PARTIAL},
    force_strategy=ForceStrategy.DIRECT,
    options=StrategyOptions(scatter=ScatterMode.LOCAL, wraps_periodic_axes=True),
)
"""DFT-D3: no global coupling; coordination numbers of owned atoms are computed
with the CN cutoff, then ghost rows are refreshed from their owners before the
dispersion energy (halo = max(cutoff, CN cutoff) + skin)."""

SPEC_MPNN_GP = MLIPSpec(
    name="SPEC_MPNN_GP",
    outputs=_SHORT_RANGE_OUTPUTS,
    force_strategy=ForceStrategy.AUTOGRAD,
    distribution=DistributionSpec(storage=StrategyKind.GRAPH_PARTITION),
    options=StrategyOptions(scatter=ScatterMode.LOCAL),
)
"""Graph partition: atoms split by a balanced index range (no spatial halo), each
rank owning the edges into its nodes; its ghost rows are the atoms those edges
read (at their own positions, real cell and pbc), refreshed per layer."""
