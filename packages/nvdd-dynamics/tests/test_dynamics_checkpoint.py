"""Checkpoint and restart under DomainParallel, on the same and other world sizes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_ranks import (
    gas,
    load_problem,
    restart,
    run_and_save,
    run_plain,
    save_twice_second_fails,
    sleepy_hook,
)

from nvdd.core import WATCHDOG_EXIT_CODE, RankFailedError
from nvdd.dynamics import CheckpointError, read_checkpoint
from nvdd.testing import run_ranks

pytestmark = pytest.mark.gloo

FIELDS = ("atom_ids", "positions", "velocities", "forces", "masses", "tag", "energy")


def _wrapped(a: torch.Tensor, b: torch.Tensor, cell: torch.Tensor) -> float:
    frac = torch.linalg.solve(cell.T, (a - b).T).T
    return float(((frac - torch.round(frac)) @ cell).abs().max())


@pytest.mark.parametrize("kind", ["nve", "nvt", "fire", "nvt-nh", "npt-iso", "npt-full"])
def test_restart_continues_the_run_bit_for_bit_or_within_1e10(tmp_path: Path, kind: str) -> None:
    path = str(tmp_path / "ckpt")
    at_save, whole = run_ranks(run_and_save, 2, kind, 4, 6, path, timeout_s=120)[0]
    same, meta, saved_world = run_ranks(restart, 2, kind, 6, path, timeout_s=120)[0]
    assert meta == {"note": "test"} and saved_world == 2
    assert same["scalars"] == whole["scalars"] and whole["scalars"]["step_count"] == 10
    for name in FIELDS:  # the same world size: exactly the uninterrupted run
        assert torch.equal(same[name], whole[name]), name
    assert torch.equal(same["cell"], whole["cell"])  # (NPT moves it)
    if "conserved" in whole:  # Nose-Hoover chains and the barostat's momentum came back
        assert torch.equal(same["conserved"], whole["conserved"])
    other, _, _ = run_ranks(restart, 3, kind, 6, path, timeout_s=120)[0]
    assert torch.equal(other["atom_ids"], whole["atom_ids"])
    assert _wrapped(other["positions"], whole["positions"], whole["cell"]) < 1e-10
    for name in ("velocities", "forces", "energy", "cell") + ("conserved",) * (
        "conserved" in whole
    ):
        assert float((other[name] - whole[name]).abs().max()) < 1e-10, name
    assert other["scalars"] == whole["scalars"]
    # Against a run that never checkpointed: saving rebuilds the halo at the next
    # step (so that the restart, which must build one, sums forces in the same
    # order as the saving run); the run without a save keeps its older halo and
    # the model its older neighbour list, whose order a restart cannot recreate,
    # so the two differ in the last bits (forces by ~1e-17 here): 1e-10, not bits.
    plain = run_ranks(run_plain, 2, kind, 10, timeout_s=120)[0]
    assert plain["scalars"] == whole["scalars"]
    assert torch.equal(plain["atom_ids"], same["atom_ids"])
    assert _wrapped(same["positions"], plain["positions"], plain["cell"]) < 1e-10
    for name in ("velocities", "forces", "energy", "cell") + ("conserved",) * (
        "conserved" in whole
    ):
        assert float((same[name] - plain[name]).abs().max()) < 1e-10, name
    # The checkpoint held the state at the save, readable whole in this process.
    batch, manifest = read_checkpoint(path)
    assert manifest["integrator"]["state"]["step_count"] == 4
    for name in ("atom_ids", "positions", "velocities", "forces", "tag"):
        assert torch.equal(batch.atom_fields()[name], at_save[name]), name


def test_checkpoint_is_readable_with_numpy_and_json_alone(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    at_save, _ = run_ranks(run_and_save, 2, "nve", 3, 0, str(path), timeout_s=120)[0]
    manifest = json.loads((path / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"], manifest["world_size"]) == (
        "nvdd-checkpoint",
        1,
        2,
    )
    ids, pos = [], []
    for shard in manifest["shards"]:
        with np.load(path / shard["file"]) as data:
            assert data["positions"].shape == (shard["n_atoms"], 3)
            ids.append(data["atom_ids"])
            pos.append(data["positions"])
            assert "extra.tag" in data.files
    order = np.argsort(np.concatenate(ids))
    assert np.array_equal(np.concatenate(pos)[order], at_save["positions"].numpy())
    with np.load(path / manifest["systems_file"]) as systems:
        assert np.array_equal(systems["cell"][0], gas().cell[0].numpy())
    assert sorted(p.name for p in path.iterdir() if p.suffix == ".tmp") == []


def test_a_full_disk_on_one_rank_fails_every_rank_and_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ckpt"
    # fresh ranks: the culprit rank patches numpy.savez and never puts it back
    out = run_ranks(save_twice_second_fails, 3, str(path), 1, timeout_s=120, fresh=True)
    assert all(o.startswith(f"checkpoint {path} not written (rank 1: ") for o in out), out
    assert all("No space left on device" in o and "previous checkpoint" in o for o in out)
    batch, manifest = read_checkpoint(path)  # the first checkpoint, whole and readable
    assert manifest["serial"] == 1 and manifest["integrator"]["state"]["step_count"] == 2
    assert batch.n_atoms == 64
    names = sorted(p.name for p in path.iterdir())
    assert names == [
        "manifest.json",
        "shard-000001-00000.npz",
        "shard-000001-00001.npz",
        "shard-000001-00002.npz",
        "systems-000001.npz",
    ]


def test_load_errors_reach_every_rank(tmp_path: Path) -> None:
    missing = run_ranks(load_problem, 2, str(tmp_path / "nothing"), "nve", timeout_s=120)
    assert all(m.startswith("CheckpointError: rank 0: no checkpoint in") for m in missing)
    path = str(tmp_path / "ckpt")
    run_ranks(run_and_save, 2, "nve", 1, 0, path, timeout_s=120)
    wrong = run_ranks(load_problem, 2, path, "nvt", timeout_s=120)
    assert all("written by a VelocityVerlet integrator" in m for m in wrong), wrong
    (tmp_path / "ckpt" / "shard-000001-00001.npz").unlink()
    lost = run_ranks(load_problem, 2, path, "nve", timeout_s=120)
    assert all(m.startswith("CheckpointError: rank 1: cannot read") for m in lost), lost
    with pytest.raises(CheckpointError, match="cannot read"):
        read_checkpoint(path)


def test_domain_parallel_watchdog_names_a_rank_stuck_in_a_hook(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match=f"code {WATCHDOG_EXIT_CODE}"):
        run_ranks(sleepy_hook, 2, str(tmp_path), 2.0, timeout_s=90)
    assert time.monotonic() - t0 < 30
    text = (tmp_path / "rank0.txt").read_text()
    assert "silent rank(s): [1]." in text, text
    # rank 0 waits in the agreement after the hook (every rank registered it)
    assert "rank 1: stuck outside the collective the others wait in: at 'step 3 after_step'" in (
        text
    ), text
