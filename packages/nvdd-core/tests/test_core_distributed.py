"""Process-group helpers over gloo: init, mesh, rank-consistent failure."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nvdd.core import (
    CommunicationError,
    ConfigurationError,
    ValidationError,
    any_rank,
    comm_device,
    default_backend,
    get_rank,
    get_world_size,
    init_distributed,
    raise_if_any_rank,
)
from nvdd.testing import run_ranks


def _init_inside_ranks() -> tuple[int, int, str, str, tuple[str, ...] | None, float]:
    env = init_distributed()  # the group run_ranks created is reused
    t = torch.ones(1)
    dist.all_reduce(t, group=env.group)
    return (
        env.rank,
        env.world_size,
        env.backend,
        str(env.device),
        env.mesh.mesh_dim_names,
        float(t),
    )


@pytest.mark.gloo
def test_init_distributed_reuses_group_and_builds_named_mesh() -> None:
    out = run_ranks(_init_inside_ranks, 3, timeout_s=60)
    assert out == [(r, 3, "gloo", "cpu", ("domain",), 3.0) for r in range(3)]


def _flags(bad_ranks: list[int]) -> bool:
    return any_rank(dist.get_rank() in bad_ranks)


@pytest.mark.gloo
def test_any_rank_agrees_on_every_rank() -> None:
    assert run_ranks(_flags, 3, [2], timeout_s=60) == [True] * 3
    assert run_ranks(_flags, 3, [], timeout_s=60) == [False] * 3


def _consistent_failure(bad_ranks: list[int]) -> str:
    r = dist.get_rank()
    msg = f"positions[{r}] is nan" if r in bad_ranks else None
    try:
        raise_if_any_rank(msg)
    except ValidationError as exc:
        # Every rank must still be able to run a collective afterwards: nobody hangs.
        dist.barrier()
        return str(exc)
    dist.barrier()
    return "no error"


@pytest.mark.gloo
def test_raise_if_any_rank_raises_the_same_error_everywhere() -> None:
    out = run_ranks(_consistent_failure, 4, [1, 3], timeout_s=60)
    assert out == ["rank 1: positions[1] is nan; rank 3: positions[3] is nan"] * 4
    assert run_ranks(_consistent_failure, 2, [], timeout_s=60) == ["no error"] * 2


def test_single_process_helpers_without_a_group() -> None:
    assert not dist.is_initialized()
    assert get_rank() == 0 and get_world_size() == 1
    assert comm_device() == torch.device("cpu")
    assert any_rank(True) and not any_rank(False)
    raise_if_any_rank(None)
    with pytest.raises(ValidationError, match="rank 0: bad"):
        raise_if_any_rank("bad")
    assert default_backend("cpu") == "gloo" and default_backend("cuda:0") == "nccl"


def test_init_distributed_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigurationError, match="backend must be"):
        init_distributed(backend="mpi")
    with pytest.raises(ConfigurationError, match="timeout_s must be positive"):
        init_distributed(timeout_s=0)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigurationError, match="needs CUDA"):
            init_distributed(backend="nccl")


_SCRIPT = textwrap.dedent(
    """
    import sys
    from nvdd.core import init_distributed, shutdown_distributed
    import torch, torch.distributed as dist
    kw = {}
    if len(sys.argv) > 1:
        kw = dict(rank=int(sys.argv[1]), world_size=int(sys.argv[2]), init_method=sys.argv[3])
    env = init_distributed(timeout_s=30, **kw)
    t = torch.ones(1)
    dist.all_reduce(t)
    print(env.rank, env.world_size, env.backend, env.mesh.mesh_dim_names[0], int(t))
    shutdown_distributed()
    """
)


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return env


def test_init_distributed_alone_is_a_world_of_one() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split() == ["0", "1", "gloo", "domain", "1"]


def test_init_distributed_from_explicit_arguments(tmp_path: Path) -> None:
    rdzv = f"file://{tmp_path / 'rdzv'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, str(r), "2", rdzv],
            env=_child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1] for o in outs]
    assert sorted(o[0].split()[0] for o in outs) == ["0", "1"]
    assert all(o[0].split()[1:] == ["2", "gloo", "domain", "2"] for o in outs)


def test_init_distributed_from_torchrun_environment() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = _child_env()
    env.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "gloo", "domain", "1"]


def test_init_distributed_failure_names_backend_and_method() -> None:
    env = _child_env()
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")  # no MASTER_ADDR: env:// must fail
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert (
        f"{CommunicationError.__name__}: rank 0: init_process_group('gloo', 'env://') failed"
        in out.stderr
    )


@pytest.mark.parametrize(("backend", "bound"), [("nccl", torch.device("cuda", 3)), ("gloo", None)])
def test_an_nccl_group_is_bound_to_this_ranks_gpu(
    monkeypatch: pytest.MonkeyPatch, backend: str, bound: torch.device | None
) -> None:
    """NCCL groups get ``device_id`` (this rank's GPU), so NCCL never guesses the
    device from the global rank (a guess that can hang); gloo gets none. The
    CUDA calls are stubbed: this runs without a GPU, and the stubbed
    ``init_process_group`` stops the call once it has seen its arguments."""
    import nvdd.core._distributed as nd

    seen: dict[str, object] = {}

    def fake_init(**kwargs: object) -> None:
        seen.update(kwargs)
        raise RuntimeError("stopped after init_process_group")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(nd.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(nd.dist, "init_process_group", fake_init)
    device = "cuda:3" if backend == "nccl" else "cpu"
    with pytest.raises(CommunicationError, match="stopped after init_process_group"):
        init_distributed(
            backend=backend, device=device, rank=0, world_size=1,
            init_method="file:///nonexistent-nvdd-rdzv", teardown=False,
        )  # fmt: skip
    assert seen["backend"] == backend
    assert seen["device_id"] == bound


def _shut_down_after(delay_s: float) -> tuple[float, bool]:
    import time

    from nvdd.core import shutdown_distributed

    t0 = time.perf_counter()
    if dist.get_rank() == 1:  # the last rank to finish
        time.sleep(delay_s)
    shutdown_distributed(barrier=True)
    return time.perf_counter() - t0, dist.is_initialized()


@pytest.mark.gloo
def test_shutdown_with_a_barrier_waits_for_every_rank_then_destroys_the_group() -> None:
    from nvdd.core import spawn_ranks

    (waited, alive0), (_, alive1) = spawn_ranks(_shut_down_after, 2, 0.5, backend="gloo")
    assert waited >= 0.45, waited  # rank 0 waited for rank 1 before destroying its group
    assert not alive0 and not alive1
