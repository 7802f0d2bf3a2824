"""nvdd.dynamics: integrators and hooks, DomainConfig, DistributedModel (halo),
GraphPartitionModel (graph partition), DomainParallel."""

from nvdd.dynamics.__about__ import __version__
from nvdd.dynamics._base import (
    ASE_TIME_PER_FS,
    KB_EV_PER_K,
    BaseDynamics,
    ForceProvider,
    ModelForceProvider,
    Reducer,
)
from nvdd.dynamics._collectives import COUNTED_COLLECTIVES, MeshReducer, count_collectives
from nvdd.dynamics._config import DomainConfig
from nvdd.dynamics._consolidate import PendingTotals, UndeclaredOutputWarning, consolidate
from nvdd.dynamics._distributed_model import DDStats, DistributedModel, DistributedPipelineModel
from nvdd.dynamics._domain_parallel import DomainParallel
from nvdd.dynamics._graph_partition import GraphPartitionModel
from nvdd.dynamics._hooks import Hook, HookContext, HookScope, HookStage
from nvdd.dynamics._integrators import FIRE, Langevin, VelocityVerlet, kinetic_energy, temperature
from nvdd.dynamics._rng import atom_normal
from nvdd.dynamics._validate import LayerDiagnostic, ValidationReport, trace_and_validate

__all__ = [
    "ASE_TIME_PER_FS",
    "COUNTED_COLLECTIVES",
    "DDStats",
    "DistributedModel",
    "DistributedPipelineModel",
    "DomainParallel",
    "GraphPartitionModel",
    "MeshReducer",
    "PendingTotals",
    "UndeclaredOutputWarning",
    "consolidate",
    "count_collectives",
    "FIRE",
    "KB_EV_PER_K",
    "BaseDynamics",
    "DomainConfig",
    "ForceProvider",
    "Hook",
    "HookContext",
    "HookScope",
    "HookStage",
    "LayerDiagnostic",
    "Langevin",
    "ModelForceProvider",
    "Reducer",
    "ValidationReport",
    "VelocityVerlet",
    "__version__",
    "atom_normal",
    "kinetic_energy",
    "temperature",
    "trace_and_validate",
]
