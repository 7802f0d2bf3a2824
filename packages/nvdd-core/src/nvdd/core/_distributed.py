"""Process-group and device-mesh helpers (gloo on CPU, NCCL on CUDA).

Every collective helper here works whether or not ``torch.distributed`` is
initialised: without a process group it behaves as a world of one rank.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nvdd.core import _comm
from nvdd.core._errors import CommunicationError, ConfigurationError, NvddError, ValidationError
from nvdd.core._lifecycle import cpu_threads_per_rank, install_teardown, teardown, track_mesh

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DEFAULT_MESH_DIM",
    "DEFAULT_TIMEOUT_S",
    "DistributedEnv",
    "any_rank",
    "comm_device",
    "default_backend",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "make_mesh",
    "raise_if_any_rank",
    "shutdown_distributed",
]

#: Name of the mesh dimension atoms are decomposed over.
DEFAULT_MESH_DIM = "domain"
#: Default collective timeout, seconds.
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DistributedEnv:
    """What :func:`init_distributed` set up.

    Attributes
    ----------
    rank, world_size, local_rank:
        This process's place in the default group (``local_rank``: on this node).
    backend:
        ``"gloo"`` or ``"nccl"``.
    device:
        The device this rank computes on (``cuda:<local_rank>`` under NCCL).
    mesh:
        A 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` over all ranks,
        its single dimension named ``mesh_dim``.
    mesh_dim:
        The dimension name (default ``"domain"``).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    mesh: DeviceMesh
    mesh_dim: str

    @property
    def group(self) -> ProcessGroup:
        """The process group of the mesh dimension."""
        return self.mesh.get_group(self.mesh_dim)


def default_backend(device: torch.device | str | None = None) -> str:
    """``"nccl"`` for a CUDA device (or, with no device given, when CUDA is
    available), else ``"gloo"``."""
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise ConfigurationError(
            f"environment variable {name}={value!r} is not an integer"
        ) from exc


def init_distributed(
    *,
    backend: str | None = None,
    device: torch.device | str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    mesh_dim: str = DEFAULT_MESH_DIM,
    teardown: bool = True,
) -> DistributedEnv:
    """Initialise the default process group and a 1-D device mesh.

    **Collective** over all processes of the job: every rank must call it.

    Sources, in order: explicit ``rank`` / ``world_size`` / ``init_method``
    arguments; the torchrun environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); otherwise a world of one
    rank with a private file rendezvous. An already initialised default group is
    reused (its backend wins).

    Parameters
    ----------
    backend:
        ``"gloo"`` or ``"nccl"``; default from ``device`` (NCCL for CUDA).
    device:
        Default: ``cuda:<local_rank>`` when CUDA is available and the backend is
        NCCL, else ``cpu``.
    timeout_s:
        Collective timeout passed to ``init_process_group``.
    mesh_dim:
        Name of the mesh's single dimension.
    teardown:
        Let nvdd destroy the process group when the process ends, also after an
        exception or SIGTERM (:func:`nvdd.core.install_teardown`), so no rank
        aborts at exit and the launcher never kills a rank that is still
        writing. On by default.

    Notes
    -----
    When this call creates a CPU (gloo) group and ``OMP_NUM_THREADS`` is not
    set, each rank uses :func:`nvdd.core.cpu_threads_per_rank` intra-op threads
    (the node's cores shared by its ranks) instead of torch's default of every
    core per rank, which oversubscribes the machine.

    Raises
    ------
    ConfigurationError
        On inconsistent arguments (rank outside the world, unknown backend,
        NCCL without CUDA).
    """
    if timeout_s <= 0:
        raise ConfigurationError(f"timeout_s must be positive, got {timeout_s}")
    local_rank = _env_int("LOCAL_RANK") or 0
    if backend is None:
        backend = default_backend(device)
    if backend not in ("gloo", "nccl"):
        raise ConfigurationError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigurationError("backend 'nccl' needs CUDA, which is not available")
    if device is None:
        device = torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
        if rank is None and world_size is None and env_rank is not None and env_world is not None:
            rank, world_size = env_rank, env_world
            init_method = init_method or "env://"
        elif rank is None and world_size is None:
            rank, world_size = 0, 1
            fd, path = tempfile.mkstemp(prefix="nvdd-rdzv-")
            os.close(fd)
            os.unlink(path)
            init_method = init_method or f"file://{path}"
        if rank is None or world_size is None or init_method is None:
            raise ConfigurationError(
                "init_distributed: pass rank, world_size and init_method together "
                f"(got rank={rank}, world_size={world_size}, init_method={init_method!r})"
            )
        if not 0 <= rank < world_size:
            raise ConfigurationError(f"rank {rank} is outside a world of size {world_size}")
        # NCCL: bind the group to this rank's GPU (without it NCCL guesses the
        # device from the global rank and warns that a guess can hang)
        bound = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        try:
            dist.init_process_group(
                backend=backend,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=timeout,
                device_id=bound,
            )
        except Exception as exc:
            raise CommunicationError(
                f"rank {rank}: init_process_group({backend!r}, {init_method!r}) failed: {exc}"
            ) from exc
        if device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(cpu_threads_per_rank(_env_int("LOCAL_WORLD_SIZE") or world_size))
    if teardown:
        install_teardown()
    mesh = make_mesh(device.type, dim_name=mesh_dim)
    return DistributedEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        backend=str(dist.get_backend()),
        device=device,
        mesh=mesh,
        mesh_dim=mesh_dim,
    )


def make_mesh(
    device_type: str, *, dim_name: str = DEFAULT_MESH_DIM, group: ProcessGroup | None = None
) -> DeviceMesh:
    """A 1-D device mesh named ``dim_name`` over ``group`` (default: the world).

    **Collective** over ``group``.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if not dist.is_initialized():
        raise CommunicationError("make_mesh: torch.distributed is not initialised")
    if group is None:
        mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=(dim_name,))
    else:
        mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=(dim_name,))
    track_mesh(mesh)
    return mesh


def shutdown_distributed(*, barrier: bool = False) -> None:
    """Stop nvdd's watchdogs and destroy the default process group if one exists.

    **Collective** (all ranks). Calling it is optional: with
    :func:`init_distributed` (or ``DomainParallel``) the same teardown runs at
    interpreter exit.

    Parameters
    ----------
    barrier:
        First wait until every rank of the default group has called it (one
        all-reduce of one integer), so that no rank destroys its group, and then
        ends, while a peer still works or exchanges: the way to end a job that
        finished (``nvdd run`` ends so). Without it the teardown is local (the
        test plugin's clean-up of a group a test left behind, whose peers may
        be gone).
    """
    if barrier and dist.is_available() and dist.is_initialized():
        any_rank(False)
    teardown()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (0 without torch.distributed)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Size of ``group`` (1 without torch.distributed)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def comm_device(group: ProcessGroup | None = None) -> torch.device:
    """The device collectives of ``group`` take tensors on (CUDA under NCCL)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool | torch.Tensor, group: ProcessGroup | None = None) -> bool:
    """True on every rank if ``flag`` is true on any rank of ``group``.

    **Collective** over ``group`` (one all-reduce of a single int): every rank must
    call it. Synchronises with the host.
    """
    if get_world_size(group) == 1:
        return bool(flag)
    t = torch.as_tensor(flag, device=comm_device(group)).to(torch.int32).reshape(1)
    _comm.all_reduce(t, "max", group)
    return bool(t.item())


def raise_if_any_rank(
    message: str | None,
    group: ProcessGroup | None = None,
    *,
    exc_type: type[NvddError] = ValidationError,
) -> None:
    """Raise the same error on every rank if any rank has a ``message``.

    **Collective** over ``group``: every rank must call it, with ``None`` when it
    found nothing wrong. One all-reduce of a flag; only when some rank failed, one
    more all-gather of the messages. The raised error (``exc_type``) names every
    failing rank with its message, so no rank is left hanging in a later
    collective.
    """
    world = get_world_size(group)
    if world == 1:
        if message is not None:
            raise exc_type(f"rank {get_rank(group)}: {message}")
        return
    if not any_rank(message is not None, group):
        return
    messages: list[str | None] = _comm.all_gather_object(message, group)
    lines = [f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None]
    raise exc_type("; ".join(lines))
