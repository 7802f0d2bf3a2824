"""nvalchemi.distributed: one molecular-dynamics system across many GPUs.

Wrap the integrator you already have::

    from nvalchemi.distributed import DomainParallel, DomainConfig

    with DomainParallel(dynamics, DomainConfig(cutoff=8.5, skin=1.0)) as dp:
        dp.partition(batch)
        dp.run(1000)

and launch with ``torchrun``. This package re-exports the public API of the nvdd
packages; the presets live in :mod:`nvalchemi.distributed.spec` and the scope
configuration also in :mod:`nvalchemi.distributed.config`.
"""

from nvalchemi.distributed._versions import check_versions as _check_versions

_check_versions()

from nvalchemi.distributed.__about__ import __version__  # noqa: E402
from nvdd.core import Batch, init_distributed  # noqa: E402
from nvdd.dynamics import (  # noqa: E402
    FIRE,
    MTKNPT,
    BaseDynamics,
    CellDOF,
    DistributedModel,
    DistributedPipelineModel,
    DomainConfig,
    DomainParallel,
    HookScope,
    HookStage,
    Langevin,
    NoseHooverNVT,
    VelocityVerlet,
    trace_and_validate,
)
from nvdd.halo import ParticleHaloConfig, reshard_by_destination  # noqa: E402
from nvdd.padding import COOPadder, DenseBatchPadder, DensePadder, GraphPadder, resolve_cap  # noqa: E402
from nvdd.partition import ShardedBatch, SpatialPartitioner  # noqa: E402
from nvdd.shardtensor import (  # noqa: E402
    Scope,
    ShardTensor,
    autograd_target,
    current_dd_context,
    localize,
    refresh_neighbors,
    scatter_to_owners,
    system_sum,
    to_local,
)
from nvdd.spec import (  # noqa: E402
    AdapterRegistry,
    AdapterStatus,
    BaseModelMixin,
    CompilePolicy,
    DistributionSpec,
    ForceStrategy,
    FunctionAdapter,
    JitAdapter,
    MethodAdapter,
    MLIPSpec,
    OpAdapter,
    OutputKind,
    OutputSpec,
    PythonAdapter,
    Reduce,
    StrategyKind,
    distributed_method,
    neighbor_refresh_adapters,
    receptive_field_spec,
)

__all__ = [
    "FIRE",
    "MTKNPT",
    "AdapterRegistry",
    "AdapterStatus",
    "BaseDynamics",
    "BaseModelMixin",
    "Batch",
    "COOPadder",
    "CellDOF",
    "CompilePolicy",
    "DenseBatchPadder",
    "DensePadder",
    "DistributedModel",
    "DistributedPipelineModel",
    "DistributionSpec",
    "DomainConfig",
    "DomainParallel",
    "ForceStrategy",
    "FunctionAdapter",
    "GraphPadder",
    "HookScope",
    "HookStage",
    "JitAdapter",
    "Langevin",
    "MLIPSpec",
    "MethodAdapter",
    "NoseHooverNVT",
    "OpAdapter",
    "OutputKind",
    "OutputSpec",
    "ParticleHaloConfig",
    "PythonAdapter",
    "Reduce",
    "Scope",
    "ShardTensor",
    "ShardedBatch",
    "SpatialPartitioner",
    "StrategyKind",
    "VelocityVerlet",
    "__version__",
    "autograd_target",
    "current_dd_context",
    "distributed_method",
    "init_distributed",
    "localize",
    "neighbor_refresh_adapters",
    "receptive_field_spec",
    "refresh_neighbors",
    "reshard_by_destination",
    "resolve_cap",
    "scatter_to_owners",
    "system_sum",
    "to_local",
    "trace_and_validate",
]
