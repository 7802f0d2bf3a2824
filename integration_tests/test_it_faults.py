"""Fault injection: every fault ends the job quickly, names the rank, loses no good file.

Each case runs a small job under torchrun (2 CPU ranks over gloo), as a user
would, and reads what the job printed.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
from it_restart import resume_checkpointed, run_checkpointed, save_twice_second_fails

from nvdd.core import RankFailedError
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
    """A SIGKILLed rank can print nothing: the survivor's collective fails, and
    nvdd's note on the survivor names the silent rank (from the watchdog's store
    entries), not only the launcher's report. (Should the launcher's SIGTERM reach
    the survivor before its collective fails, its SIGTERM note names rank 1: see
    the next test.)"""
    rc, out, took = _torchrun("kill")
    assert rc != 0 and took < 120, out[-3000:]
    named = re.search(
        r"^nvdd: rank 0 (failed in a collective|was stopped by SIGTERM); rank\(s\) \[1\] "
        r"stopped responding without reporting an error \(killed, out of memory, or crashed "
        r"in native code\)$",
        out,
        flags=re.M,
    )
    assert named is not None, out[-3000:]


def test_a_rank_killed_while_the_other_is_busy_is_named() -> None:
    """Rank 0 is outside any collective when rank 1 dies, so the launcher's SIGTERM
    reaches it first (no collective fails on it): it still names rank 1 before it
    exits with 143, instead of ending silently."""
    rc, out, took = _torchrun("kill-busy")
    assert rc != 0 and took < 60, out[-3000:]  # not the 30 s of rank 0's busy hook
    assert (
        "nvdd: rank 0 was stopped by SIGTERM; rank(s) [1] stopped responding without "
        "reporting an error (killed, out of memory, or crashed in native code)"
    ) in out, out[-3000:]
    assert "exitcode  : 143" in out  # rank 0 ended by the signal, as the launcher asked


def test_a_rank_that_stops_responding_is_named_within_the_watchdog_timeout() -> None:
    rc, out, took = _torchrun("hang", NVDD_WATCHDOG_S="3")
    assert rc != 0, out[-3000:]
    assert took < 120  # the job ends after ~3 s of silence, not the 600 s timeout
    assert "nvdd watchdog: rank 0 made no progress for 3." in out, out[-3000:]
    assert "silent rank(s): [1]." in out
    # rank 0 waits after its hooks (in their agreement), rank 1 sleeps in one
    stuck = r"rank 1: (behind: last progress|stuck outside the collective the others wait in: at)"
    assert re.search(stuck + r" 'step 3 before_compute'", out), out[-3000:]
    assert "main thread at hook (fault_job.py:" in out


def test_a_full_disk_while_writing_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    # fresh ranks: the culprit rank patches numpy.savez and never puts it back
    messages = run_ranks(save_twice_second_fails, 2, str(path), 1, timeout_s=120, fresh=True)
    assert all("rank 1: writing" in m and "No space left on device" in m for m in messages)
    batch, manifest = read_checkpoint(path)
    assert manifest["serial"] == 1 and batch.n_atoms == 108
    assert not [p for p in path.iterdir() if p.name.startswith(".")]  # no temporaries


def test_a_hard_kill_then_a_restart_continues_bit_for_bit(tmp_path: Path) -> None:
    """SIGKILL of rank 1 at step 6 of a 10-step NVE run that checkpoints every 4
    steps; restarted on the same 2 ranks from the last checkpoint (step 4), the run
    ends bit for bit where the uninterrupted run (same cadence) ends. (Against a
    run that never checkpoints it is 1e-10, not bits: a save rebuilds the halo;
    see test_dynamics_checkpoint.)"""
    import torch

    whole = run_ranks(run_checkpointed, 2, str(tmp_path / "whole"), 10, 4, timeout_s=180)[0]
    path = tmp_path / "killed"
    with pytest.raises(RankFailedError, match="rank 1"):
        run_ranks(run_checkpointed, 2, str(path), 10, 4, 6, timeout_s=180)
    batch, manifest = read_checkpoint(path)  # the last complete checkpoint is intact
    assert manifest["metadata"] == {"step": 4} and batch.n_atoms == 108
    assert not [p for p in path.iterdir() if p.name.startswith(".")]  # no temporaries
    again = run_ranks(resume_checkpointed, 2, str(path), 10, 4, timeout_s=180)[0]
    assert again["restarted_at"] == 4
    for name in ("ids", "positions", "velocities", "forces", "energy", "cell"):
        assert torch.equal(again[name], whole[name]), name
