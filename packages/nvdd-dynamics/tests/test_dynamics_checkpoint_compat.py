"""Checkpoints written by an older nvdd load and continue the run.

Issue 35 rewrote the step and asked that checkpoints written before still
load. ``data/`` holds checkpoints that the packages of commit 031bb92 (the
commit the issue was filed at) wrote at step 4 of the checkpoint test's runs
on 2 gloo ranks, with each uninterrupted run's state at step 10
(``data/make_old_checkpoints.py`` says how they were made). Today's code loads
them on 2 and 3 ranks and runs the 6 steps: it reaches that state, by atom id,
within 1e-10 (fp64: a restart on another version may sum in another order).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_ranks import restart

from nvdd.testing import run_ranks

pytestmark = pytest.mark.gloo

DATA = Path(__file__).parent / "data"


def _by_id(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x[torch.argsort(ids)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["nve", "nvt-nh", "npt-full"])
def test_a_checkpoint_from_before_the_step_rewrite_loads_and_continues(
    tmp_path: Path, kind: str, world: int
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(DATA / f"ckpt-031bb92-{kind}", path)
    want = {
        k: torch.from_numpy(v) for k, v in np.load(DATA / f"ckpt-031bb92-{kind}.final.npz").items()
    }
    final, meta, saved_world = run_ranks(restart, world, kind, 6, str(path), timeout_s=120)[0]
    assert meta == {"note": "test"} and saved_world == 2
    assert final["scalars"]["step_count"] == int(want["step_count"]) == 10
    assert torch.equal(torch.sort(final["atom_ids"]).values, torch.sort(want["atom_ids"]).values)
    cell = want["cell"]
    got_pos = _by_id(final["atom_ids"], final["positions"])
    frac = torch.linalg.solve(cell.T, (got_pos - _by_id(want["atom_ids"], want["positions"])).T).T
    assert float(((frac - torch.round(frac)) @ cell).abs().max()) < 1e-10  # (wrapped alike or not)
    for name in ("velocities", "forces"):
        got = _by_id(final["atom_ids"], final[name])
        ref = _by_id(want["atom_ids"], want[name])
        assert float(ref.abs().max()) > 1e-6, name  # (a state that can differ)
        assert float((got - ref).abs().max()) < 1e-10, name
    for name in ("energy", "cell", *(("conserved",) if "conserved" in want else ())):
        assert float((final[name] - want[name]).abs().max()) < 1e-10, name
    if kind == "npt-full":  # the barostat moved the cell: its state came back too
        first = torch.from_numpy(np.load(path / "systems-000001.npz")["cell"])
        assert float((want["cell"] - first.reshape(3, 3)).abs().max()) > 1e-9
