"""nvdd.core: atomic batches, process groups and errors (layer 0 of nvdd)."""

from nvdd.core.__about__ import __version__
from nvdd.core._batch import Batch, TensorMemo
from nvdd.core._batch_validation import check_cell
from nvdd.core._capture import (
    CaptureError,
    CudaStepGraph,
    EmulatedStepGraph,
    GraphPool,
    StepGraph,
    after_replay,
    can_capture,
    capturing,
    emulated_capture,
    make_step_graph,
    record_launch,
)
from nvdd.core._comm import (
    COLLECTIVE_NAMES,
    add_listener,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast_object,
    count_collectives,
    remove_listener,
)
from nvdd.core._distributed import (
    DEFAULT_MESH_DIM,
    DEFAULT_TIMEOUT_S,
    DistributedEnv,
    any_rank,
    comm_device,
    default_backend,
    get_rank,
    get_world_size,
    init_distributed,
    make_mesh,
    raise_if_any_rank,
    shutdown_distributed,
)
from nvdd.core._errors import (
    CapacityOverflowError,
    CommunicationError,
    ConfigurationError,
    NvddError,
    OptionalDependencyError,
    ValidationError,
    import_optional,
)
from nvdd.core._fields import PER_ATOM_FIELDS, PER_SYSTEM_FIELDS
from nvdd.core._files import AppendLog, atomic_write
from nvdd.core._lifecycle import cpu_threads_per_rank, install_teardown
from nvdd.core._masses import ATOMIC_MASSES, masses_for
from nvdd.core._outputs import ModelOutputs
from nvdd.core._quiet import VERBOSE_ENV, init_warp, verbose
from nvdd.core._spawn import RankFailedError, RankTimeoutError, spawn_ranks
from nvdd.core._strain import (
    deformation_gradient,
    effective_skin,
    nonaffine_displacements,
    skin_exceeded,
)
from nvdd.core._sum_by_system import ONE_HOT_SYSTEMS, sum_by_system
from nvdd.core._thermal import KB_EV_PER_K, maxwell_boltzmann
from nvdd.core._warp_launch import RecordedKernel
from nvdd.core._warp_stream import warp_stream
from nvdd.core._watchdog import (
    DEFAULT_WATCHDOG_S,
    WATCHDOG_ENV,
    WATCHDOG_EXIT_CODE,
    RankProgress,
    Watchdog,
)

__all__ = [
    "ATOMIC_MASSES",
    "COLLECTIVE_NAMES",
    "DEFAULT_MESH_DIM",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WATCHDOG_S",
    "KB_EV_PER_K",
    "PER_ATOM_FIELDS",
    "PER_SYSTEM_FIELDS",
    "WATCHDOG_ENV",
    "WATCHDOG_EXIT_CODE",
    "AppendLog",
    "Batch",
    "CapacityOverflowError",
    "CaptureError",
    "CommunicationError",
    "ConfigurationError",
    "CudaStepGraph",
    "DistributedEnv",
    "EmulatedStepGraph",
    "GraphPool",
    "ModelOutputs",
    "ONE_HOT_SYSTEMS",
    "NvddError",
    "OptionalDependencyError",
    "RankFailedError",
    "RankProgress",
    "RankTimeoutError",
    "RecordedKernel",
    "StepGraph",
    "TensorMemo",
    "VERBOSE_ENV",
    "ValidationError",
    "Watchdog",
    "__version__",
    "add_listener",
    "after_replay",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "any_rank",
    "atomic_write",
    "barrier",
    "broadcast_object",
    "can_capture",
    "capturing",
    "check_cell",
    "comm_device",
    "count_collectives",
    "cpu_threads_per_rank",
    "default_backend",
    "deformation_gradient",
    "effective_skin",
    "emulated_capture",
    "get_rank",
    "get_world_size",
    "import_optional",
    "init_distributed",
    "init_warp",
    "install_teardown",
    "make_mesh",
    "make_step_graph",
    "masses_for",
    "maxwell_boltzmann",
    "nonaffine_displacements",
    "raise_if_any_rank",
    "record_launch",
    "remove_listener",
    "shutdown_distributed",
    "skin_exceeded",
    "spawn_ranks",
    "sum_by_system",
    "verbose",
    "warp_stream",
]
