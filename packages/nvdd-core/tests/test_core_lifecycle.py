"""The runtime owns the process group's teardown: clean exits, signals, threads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nvdd.core import cpu_threads_per_rank


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
    }
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    env.update(extra)
    return env


# A script written as users write them: no shutdown call at the end, rank 0 still
# busy when the others leave.
_NO_SHUTDOWN = textwrap.dedent(
    """
    import time, torch, torch.distributed as dist
    from nvdd.core import init_distributed
    env = init_distributed(backend="gloo")
    t = torch.ones(8)
    for _ in range(20):
        dist.all_reduce(t)
    if env.rank == 0:
        time.sleep(0.3)
        print("rank 0 wrote its outputs", flush=True)
    """
)


@pytest.mark.gloo
def test_ranks_that_exit_without_shutdown_never_abort(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_NO_SHUTDOWN)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    for attempt in range(2):  # at 451ab6f 5 of 6 such runs aborted
        res = subprocess.run(
            [*cmd, str(script)],
            env=_env(OMP_NUM_THREADS="1"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        out = res.stdout + res.stderr
        assert res.returncode == 0, f"run {attempt}: {out[-3000:]}"
        assert "terminate called" not in out and "SIGABRT" not in out
        assert "rank 0 wrote its outputs" in res.stdout


_SIGTERM_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from nvdd.core import atomic_write, init_distributed
    init_distributed()
    target = Path(sys.argv[1])
    try:
        with atomic_write(target) as f:
            f.write("partial")
            print("writing", flush=True)
            time.sleep(60)
    finally:
        Path(sys.argv[2]).write_text("finally ran")
    """
)


def test_sigterm_unwinds_and_never_leaves_a_partial_file(tmp_path: Path) -> None:
    target, marker = tmp_path / "thermo.csv", tmp_path / "marker"
    target.write_text("good")
    with subprocess.Popen(
        [sys.executable, "-c", _SIGTERM_WRITER, str(target), str(marker)],
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert target.read_text() == "good"
    assert marker.read_text() == "finally ran"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker", "thermo.csv"]


_STUCK_IN_NATIVE = textwrap.dedent(
    """
    import ctypes
    from nvdd.core import init_distributed, install_teardown
    install_teardown(grace_s=1.0)
    init_distributed()
    print("stuck", flush=True)
    ctypes.CDLL(None).system(b"sleep 8")  # blocks in C: Python handlers cannot run
    """
)


def test_sigterm_ends_a_rank_stuck_in_native_code() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _STUCK_IN_NATIVE], env=_env(), stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "stuck\n"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 6.0  # the grace of 1 s, not the 8 s sleep


def test_cpu_threads_per_rank_shares_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads_per_rank(1) == cores
    assert cpu_threads_per_rank(10 * cores) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_threads_per_rank() == max(1, cores // 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert cpu_threads_per_rank() == max(1, cores // 3)
    with pytest.raises(ValueError, match="local_world_size"):
        cpu_threads_per_rank(0)


_THREADS = textwrap.dedent(
    """
    import torch
    from nvdd.core import cpu_threads_per_rank, init_distributed
    init_distributed()
    print(torch.get_num_threads(), cpu_threads_per_rank())
    """
)


def test_init_distributed_does_not_oversubscribe_cpu_ranks() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # One rank of a node running 64: torch's default (every core) would oversubscribe.
    env = _env(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="64",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    out = subprocess.run(
        [sys.executable, "-c", _THREADS], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got, expected = map(int, out.stdout.split())
    assert got == expected == max(1, len(os.sched_getaffinity(0)) // 64)
    # OMP_NUM_THREADS set by the user wins (here over the cores of a 1-rank node).
    env.update(OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE="1")
    out = subprocess.run(
        [sys.executable, "-c", _THREADS], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[0]) == 1
