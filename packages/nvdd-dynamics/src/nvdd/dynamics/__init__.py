"""nvdd.dynamics: integrators and hooks, DomainConfig, DistributedModel (halo),
GraphPartitionModel (graph partition), WholeBatchModel (one rank), DomainParallel."""

from nvdd.dynamics.__about__ import __version__
from nvdd.dynamics._checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from nvdd.dynamics._collectives import COUNTED_COLLECTIVES, MeshReducer, count_collectives
from nvdd.dynamics._config import DomainConfig
from nvdd.dynamics._distributed_model import DDStats, DistributedModel
from nvdd.dynamics._domain_parallel import DomainParallel
from nvdd.dynamics._graph_partition import GraphPartitionModel
from nvdd.dynamics._graph_step import (
    CUDA_GRAPHS_ENV,
    WARMUP_STEPS,
    StepGraphs,
    cuda_graphs_default,
)
from nvdd.dynamics._hooks import Hook, HookScope, HookStage
from nvdd.dynamics._integrators import (
    ASE_TIME_PER_FS,
    FIRE,
    KB_EV_PER_K,
    PER_ATOM_OUTPUTS,
    BaseDynamics,
    ForceProvider,
    HookContext,
    Langevin,
    ModelForceProvider,
    Reducer,
    StepState,
    VelocityVerlet,
    kinetic_energy,
    temperature,
)
from nvdd.dynamics._nose_hoover import NoseHooverChain, StepSums, step_sums
from nvdd.dynamics._npt import EV_PER_A3_PER_BAR, MTKNPT, CellDOF
from nvdd.dynamics._nvt import NoseHooverNVT
from nvdd.dynamics._pipeline import DistributedPipelineModel, distributed_model_for
from nvdd.dynamics._provider import PendingTotals, UndeclaredOutputWarning, consolidate
from nvdd.dynamics._rng import atom_normal
from nvdd.dynamics._spec_report import describe_spec
from nvdd.dynamics._validate import LayerDiagnostic, ValidationReport, trace_and_validate
from nvdd.dynamics._whole_batch import WholeBatchModel

__all__ = [
    "ASE_TIME_PER_FS",
    "COUNTED_COLLECTIVES",
    "CUDA_GRAPHS_ENV",
    "EV_PER_A3_PER_BAR",
    "FIRE",
    "KB_EV_PER_K",
    "MTKNPT",
    "PER_ATOM_OUTPUTS",
    "WARMUP_STEPS",
    "BaseDynamics",
    "CellDOF",
    "CheckpointError",
    "DDStats",
    "DistributedModel",
    "DistributedPipelineModel",
    "DomainConfig",
    "DomainParallel",
    "ForceProvider",
    "GraphPartitionModel",
    "Hook",
    "HookContext",
    "HookScope",
    "HookStage",
    "Langevin",
    "LayerDiagnostic",
    "MeshReducer",
    "ModelForceProvider",
    "NoseHooverChain",
    "NoseHooverNVT",
    "PendingTotals",
    "Reducer",
    "StepGraphs",
    "StepState",
    "StepSums",
    "UndeclaredOutputWarning",
    "ValidationReport",
    "VelocityVerlet",
    "WholeBatchModel",
    "__version__",
    "atom_normal",
    "consolidate",
    "count_collectives",
    "cuda_graphs_default",
    "describe_spec",
    "distributed_model_for",
    "kinetic_energy",
    "load_checkpoint",
    "read_checkpoint",
    "save_checkpoint",
    "step_sums",
    "temperature",
    "trace_and_validate",
]
