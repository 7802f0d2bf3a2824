"""nvdd.spec: MLIPSpec, output declarations, presets, scoped adapters, the model contract."""

from nvdd.spec.__about__ import __version__
from nvdd.spec._adapters import (
    Adapter,
    FunctionAdapter,
    JitAdapter,
    MethodAdapter,
    OpAdapter,
    PythonAdapter,
)
from nvdd.spec._decorators import distributed_method, neighbor_refresh_adapters
from nvdd.spec._model import (
    MODEL_CONTRACT,
    BaseModelMixin,
    ModelContract,
    as_model,
    begins_steps,
    unwrap_model,
)
from nvdd.spec._patching import AdapterError, active_patches
from nvdd.spec._presets import (
    DFTD3_CN_CUTOFF,
    SPEC_DFTD3_HALO,
    SPEC_EWALD_HALO,
    SPEC_LJ_HALO,
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    SPEC_PME_HALO,
    SPEC_UMA_HALO,
)
from nvdd.spec._receptive import receptive_field_spec
from nvdd.spec._refs import NamedRef
from nvdd.spec._registry import AdapterRegistry, AdapterStatus
from nvdd.spec._spec import DistributionSpec, MLIPSpec
from nvdd.spec._types import (
    CompilePolicy,
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
    "MODEL_CONTRACT",
    "SPEC_DFTD3_HALO",
    "SPEC_EWALD_HALO",
    "SPEC_LJ_HALO",
    "SPEC_MPNN_GP",
    "SPEC_MPNN_HALO",
    "SPEC_PME_HALO",
    "SPEC_UMA_HALO",
    "Adapter",
    "AdapterError",
    "AdapterRegistry",
    "AdapterStatus",
    "BaseModelMixin",
    "CompilePolicy",
    "DistributionSpec",
    "ForceStrategy",
    "FunctionAdapter",
    "GlobalCoupling",
    "JitAdapter",
    "MLIPSpec",
    "MethodAdapter",
    "ModelContract",
    "NamedRef",
    "OpAdapter",
    "OutputKind",
    "OutputSpec",
    "PythonAdapter",
    "Reduce",
    "ScatterMode",
    "StrategyKind",
    "StrategyOptions",
    "__version__",
    "active_patches",
    "as_model",
    "begins_steps",
    "distributed_method",
    "neighbor_refresh_adapters",
    "receptive_field_spec",
    "unwrap_model",
]
