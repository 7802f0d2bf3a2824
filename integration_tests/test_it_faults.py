"""Fault injection: every fault ends the job quickly, names the rank, loses no good file.

Each case runs a small job under torchrun (2 CPU ranks over gloo), as a user
would, and reads what the job printed.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from it_restart import save_twice_second_fails

from nvdd.dynamics import read_checkpoint
from nvdd.testing import run_ranks

pytestmark = pytest.mark.gloo

HERE = Path(__file__).parent


def _torchrun(fault: str, **env: str) -> tuple[int, str, float]:
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    full_env["PYTHONPATH"] = os.pathsep.join([str(HERE), *sys.path])
    t0 = time.monotonic()
    res = subprocess.run(
        [*cmd, str(HERE / "fault_job.py"), fault],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return res.returncode, res.stdout + res.stderr, time.monotonic() - t0


def test_the_job_without_a_fault_finishes() -> None:
    rc, out, _ = _torchrun("none")
    assert rc == 0 and "finished 64 atoms" in out, out[-3000:]


def test_an_exception_in_one_rank_forward_names_that_rank() -> None:
    rc, out, took = _torchrun("raise")
    assert rc != 0 and took < 120, out[-3000:]
    assert "nvdd: rank 1 failed: RuntimeError: injected fault in the model forward" in out
    assert "nvdd: rank 0 failed in a collective because rank 1 failed first" in out, out[-3000:]


def test_a_rank_killed_mid_step_is_named() -> None:
    rc, out, took = _torchrun("kill")
    assert rc != 0 and took < 120, out[-3000:]
    ours = "nvdd: rank 0 failed in a collective; rank(s) [1] stopped responding" in out
    launcher = "rank      : 1 (local_rank: 1)\n  exitcode  : -9" in out
    assert ours or launcher, out[-3000:]


def test_a_rank_that_stops_responding_is_named_within_the_watchdog_timeout() -> None:
    rc, out, took = _torchrun("hang", NVDD_WATCHDOG_S="3")
    assert rc != 0, out[-3000:]
    assert took < 120  # the job ends after ~3 s of silence, not the 600 s timeout
    assert "nvdd watchdog: rank 0 made no progress for 3." in out, out[-3000:]
    assert "silent rank(s): [1]." in out
    assert "rank 1: behind: last progress 'step 3 before_compute'" in out, out[-3000:]
    assert "main thread at hook (fault_job.py:" in out


def test_a_full_disk_while_writing_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    messages = run_ranks(save_twice_second_fails, 2, str(path), 1, timeout_s=120)
    assert all("rank 1: writing" in m and "No space left on device" in m for m in messages)
    batch, manifest = read_checkpoint(path)
    assert manifest["serial"] == 1 and batch.n_atoms == 108
    assert not [p for p in path.iterdir() if p.name.startswith(".")]  # no temporaries
