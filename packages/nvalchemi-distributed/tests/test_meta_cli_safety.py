"""`nvdd run` never mixes runs: output directories, restarts with changed options,
late checks, run-file paths (issue 39, items 1, 2, 4 and 7).

Most checks are pre-launch and run in-process (``main`` / ``validate``); one
test launches three tiny 2-rank runs for what only a run can show.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nvalchemi.distributed._checks import restart_notes, system_options, validate
from nvalchemi.distributed._outputs import ThermoLog, TrajectoryLog, remove_outputs
from nvalchemi.distributed.cli import build_parser, main

TINY = ["--cells", "3", "--cutoff", "6.0", "--skin", "0.5", "--nproc", "2", "--compare", "none"]
_LATTICE = 'Lattice="8 0 0 0 8 0 0 0 8" Properties=species:S:1:pos:R:3 pbc="T T T"'


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv])


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``nvdd run ARGV`` in-process: refused before launch with exactly one line."""
    assert main(["run", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvdd run: error: "), lines
    return lines[0]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # (the default --out is relative)


# ------------------------------------------------------------------ item 1
def test_a_non_empty_out_is_refused_unless_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old"
    (old / "checkpoint").mkdir(parents=True)
    (old / "thermo.csv").write_text("step\n1\n")
    line = _refused(capsys, "--out", str(old))
    assert f"--out {old}: not empty (holds checkpoint, thermo.csv)" in line
    assert "--overwrite" in line
    assert validate(_args("--out", str(old), "--overwrite")) == []
    assert validate(_args("--out", str(tmp_path / "new"))) == []
    (tmp_path / "empty").mkdir()
    assert validate(_args("--out", str(tmp_path / "empty"))) == []
    # never deletes the restart's own checkpoint, nor the working directory
    restart = ["--restart", str(old / "checkpoint"), "--overwrite"]
    assert f"--out {old}: --overwrite would delete the --restart checkpoint" in "".join(
        validate(_args("--out", str(old), *restart))  # (an empty checkpoint: 2 problems)
    )
    assert "will not delete the working" in _refused(capsys, "--out", ".", "--overwrite")
    # an --out that cannot be created, before launch
    (tmp_path / "file").write_text("x")
    line = _refused(capsys, "--out", str(tmp_path / "file" / "run"))
    assert f"cannot be created ({tmp_path / 'file'} is not a directory)" in line
    assert "exists and is not a directory" in _refused(capsys, "--out", str(tmp_path / "file"))
    # --overwrite: renamed aside in one step, then deleted
    remove_outputs(old)
    assert not old.exists() and sorted(os.listdir(tmp_path)) == ["empty", "file"]


def test_a_restart_cuts_the_streams_back_only_after_its_first_step(tmp_path: Path) -> None:
    """Rows and frames after the checkpoint's step stay on disk until the restart's
    first step succeeded; a restart that ends before leaves the files as they were."""
    pytest.importorskip("ase")
    import ase

    row = dict.fromkeys(("T", "E_pot", "E_kin", "E_tot", "n_atoms", "atoms_min"), 1.0)
    row.update(atoms_max=2.0, ms_per_step=3.0)
    thermo, traj = tmp_path / "thermo.csv", tmp_path / "trajectory.extxyz"
    log, frames = ThermoLog(thermo), TrajectoryLog(traj)
    for step in (2, 4, 6):
        log.append({**row, "step": float(step)})
        frames.append([ase.Atoms("Ar", positions=[[0, 0, step]], cell=[5] * 3, pbc=True)], step)
    log.close()
    frames.close()
    before = thermo.read_bytes(), traj.read_bytes()
    failed, failed_traj = ThermoLog(thermo, keep_until=4), TrajectoryLog(traj, keep_until=4)
    failed.append({**row, "step": 5.0})  # a row before the first step: held
    failed_traj.append([ase.Atoms("Ar", cell=[5] * 3, pbc=True)], 5)
    failed.close()
    failed_traj.close()
    assert (thermo.read_bytes(), traj.read_bytes()) == before
    again, again_traj = ThermoLog(thermo, keep_until=4), TrajectoryLog(traj, keep_until=4)
    again.append({**row, "step": 5.0})
    again.start()  # the first step succeeded
    again_traj.start()
    again.append({**row, "step": 6.0})
    again.close()
    again_traj.close()
    steps = [line.split(",")[0] for line in thermo.read_text().splitlines()[1:]]
    assert steps == ["2", "4", "5", "6"]
    assert re.findall(r"step=(\d+)", traj.read_text()) == ["2", "4"] and again_traj.frames == 2


# ------------------------------------------------------------------ item 2
def _checkpoint(path: Path, *, cls: str = "Langevin", metadata: dict[str, object]) -> Path:
    """A small checkpoint directory as ``nvdd.dynamics.save_checkpoint`` writes it."""
    path.mkdir(parents=True)
    fields = [{"name": "positions", "key": "positions", "extra": False}]
    np.savez(path / "shard-000001-00000.npz", positions=np.zeros((2, 3)))
    np.savez(path / "systems-000001.npz", cell=np.eye(3)[None])
    manifest = {
        "format": "nvdd-checkpoint",
        "version": 1,
        "shards": [{"file": "shard-000001-00000.npz", "rank": 0, "n_atoms": 2}],
        "atom_fields": fields,
        "systems_file": "systems-000001.npz",
        "system_fields": [{"name": "cell", "key": "cell", "extra": False}],
        "integrator": {"class": cls, "state": {"step_count": 6, "dt_fs": 4.0}},
        "metadata": metadata,
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_a_restart_with_other_system_options_is_refused_naming_each(tmp_path: Path) -> None:
    saved = system_options(_args("--cells", "3"))
    ck = _checkpoint(tmp_path / "ck", metadata={"phase": "NVT", "step": 6, "system": saved})
    assert validate(_args("--cells", "3", "--restart", str(ck), "--dt", "1")) == []
    problems = validate(_args("--cells", "6", "--dtype", "float32", "--restart", str(ck)))
    assert problems == [
        f"--restart {ck}: --cells is 6 here but was 3 in the run that wrote the checkpoint",
        f"--restart {ck}: --dtype is float32 here but was float64 in the run that wrote "
        "the checkpoint",
    ]
    (tmp_path / "x.xyz").write_text(f"1\n{_LATTICE}\nAr 0 0 0\n")
    problems = validate(_args("--structure", str(tmp_path / "x.xyz"), "--restart", str(ck)))
    assert [p.split(": ")[1].split(" is ")[0] for p in problems] == ["--structure", "--cells"]
    nh = validate(_args("--cells", "3", "--ensemble", "nvt-nh", "--restart", str(ck)))
    assert nh == [
        f"--restart {ck}: written in an --ensemble langevin phase (Langevin), this run "
        "has --ensemble nvt-nh"
    ]
    nve = _checkpoint(tmp_path / "nve", cls="VelocityVerlet", metadata={"step": 106})
    assert validate(_args("--restart", str(nve))) == []  # 100 NVT steps, then 6 NVE
    assert validate(_args("--restart", str(nve), "--nvt-steps", "50")) == [
        f"--restart {nve}: written in the NVE phase after 100 steps of the first phase, "
        "this run has --nvt-steps 50"
    ]
    # a checkpoint of before: what cannot be checked is said
    (note,) = restart_notes(_args("--restart", str(nve)))
    assert "does not store the options that define the system" in note and "--cells" in note
    assert restart_notes(_args("--cells", "3", "--restart", str(ck))) == []


# ------------------------------------------------------------------ item 4
def test_damaged_checkpoint_files_are_named_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = _checkpoint(tmp_path / "ck", metadata={"step": 6})
    shard = ck / "shard-000001-00000.npz"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])  # truncated
    line = _refused(capsys, "--restart", str(ck))
    assert f"{shard} is damaged: not a readable .npz archive, truncated or overwritten" in line
    assert "BadZipFile" not in line
    shard.write_bytes(b"\x80\x04garbage" * 20)  # garbage (np.load would talk of pickles)
    assert f"{shard} is damaged" in _refused(capsys, "--restart", str(ck))
    from nvdd.dynamics import CheckpointError, read_checkpoint

    with pytest.raises(CheckpointError, match=r"not an \.npz archive") as info:
        read_checkpoint(ck)
    assert str(shard) in str(info.value) and "allow_pickle" not in str(info.value)
    np.savez(shard, velocities=np.zeros((2, 3)))  # a zip, but not of these arrays
    assert "lacks the array(s) ['positions']" in _refused(capsys, "--restart", str(ck))
    shard.unlink()
    assert f"{shard} is missing" in _refused(capsys, "--restart", str(ck))


def test_model_files_that_are_no_model_are_refused_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Opened without running anything: the unpickler resolves no class of the file."""
    import collections

    import torch

    junk, weights, other = tmp_path / "junk.model", tmp_path / "w.model", tmp_path / "c.model"
    junk.write_bytes(b"\x80\x04\x95 not a model at all" * 10)
    torch.save({"w": torch.zeros(2)}, weights)
    torch.save(collections.Counter(a=1), other)
    mace = ["--model", "mace", "--model-file"]
    line = _refused(capsys, *mace, str(junk))
    assert f"--model-file {junk}: not a model saved with torch.save" in line
    line = _refused(capsys, *mace, str(weights))
    assert f"--model-file {weights}: holds a dict, not a mace-torch model" in line
    line = _refused(capsys, *mace, str(other))
    assert f"--model-file {other}: holds a collections.Counter, not a mace-torch model" in line


def test_singular_cells_and_coincident_atoms_are_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flat = 'Lattice="8 0 0 8 0 0 0 0 8" Properties=species:S:1:pos:R:3 pbc="T T T"'
    (tmp_path / "flat.xyz").write_text(f"2\n{flat}\nAr 0 0 0\nAr 3.8 0 0\n")
    line = _refused(capsys, "--structure", str(tmp_path / "flat.xyz"))
    assert "are linearly dependent (a cell of zero volume)" in line
    # atoms 0 and 2 are 0.1 A apart through the periodic boundary
    (tmp_path / "close.xyz").write_text(f"3\n{_LATTICE}\nAr 0 0 0\nAr 3.8 0 0\nAr 7.9 0 0\n")
    line = _refused(capsys, "--structure", str(tmp_path / "close.xyz"))
    assert "atoms 0 and 2 are 0.1 A apart, closer than 0.5 A (coincident" in line
    (tmp_path / "twice.xyz").write_text(f"2\n{_LATTICE}\nAr 1 1 1\nAr 1 1 1\n")
    line = _refused(capsys, "--structure", str(tmp_path / "twice.xyz"))
    assert "atoms 0 and 1 are 0 A apart" in line


# ------------------------------------------------------------------ item 7
def test_run_file_paths_are_relative_to_the_run_file(tmp_path: Path) -> None:
    from nvalchemi.distributed._runfile import load_run_file

    folder = tmp_path / "inputs"
    folder.mkdir()
    (folder / "nacl.xyz").write_text(f"2\n{_LATTICE}\nNa 0 0 0\nCl 2.8 0 0\n")
    (folder / "run.toml").write_text(
        '[system]\nstructure = "nacl.xyz"\ncharges = { 11 = 1.0, 17 = -1.0 }\n'
        '[[model]]\nkind = "lj"\ncutoff = 4.5\nspecies = { 11 = [0.05, 2.35], 17 = [0.05, 4.0] }\n'
    )
    assert validate(_args("--run-file", "inputs/run.toml")) == []  # cwd: tmp_path
    assert load_run_file("inputs/run.toml")["system"]["structure"] == "inputs/nacl.xyz"


# ---------------------------------------------------- launches (3 tiny runs)
def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")


def _nvdd(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "nvalchemi.distributed.cli", "run", *TINY, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())


@pytest.mark.gloo
def test_overwrite_then_a_failed_and_a_changed_restart(tmp_path: Path) -> None:
    """1: --overwrite leaves no earlier run's file (its checkpoint/ included).
    2: a restart that fails after launch leaves thermo.csv and the trajectory as
    they were. 3: a restart applies the new --dt / --temperature / --friction
    (its next checkpoint holds them), appends after the checkpoint's step, and
    reports the steps it ran."""
    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "manifest.json").write_text("{}")
    (out / "notes.txt").write_text("an earlier run")
    ck = out / "checkpoint"
    common = ["--nve-steps", "0", "--checkpoint-every", "2", "--thermo-every", "1"]
    common += ["--traj-every", "1", "--out", str(out)]
    res = _nvdd("--nvt-steps", "5", *common, "--overwrite")
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint",
        "energies.png",
        "thermo.csv",
        "trajectory.extxyz",
    ]
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest["metadata"]["step"] == 4 and manifest["metadata"]["system"]["cells"] == 3
    files = (out / "thermo.csv", out / "trajectory.extxyz")
    before = [f.read_bytes() for f in files]
    assert b"\n5," in before[0]  # a row after the checkpoint's step
    good = shutil.copytree(ck, tmp_path / "good")
    shard = next(ck.glob("shard-*-00001.npz"))
    arrays = dict(np.load(shard))
    arrays["positions"][0] = np.nan  # damaged inside: found only by the ranks
    np.savez(shard, **arrays)
    res = _nvdd("--nvt-steps", "8", *common, "--restart", str(ck), "--watchdog", "30")
    assert res.returncode != 0 and "non-finite" in res.stderr, res.stderr[-3000:]
    assert [f.read_bytes() for f in files] == before
    shutil.rmtree(ck)
    shutil.copytree(good, ck)
    changed = ["--dt", "2", "--temperature", "50", "--friction", "0.05"]
    res = _nvdd("--nvt-steps", "8", *common, "--restart", str(ck), *changed)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"of 2.0 fs; restart from {ck} at step 4: 4 steps to run" in res.stdout
    assert re.search(r"^done: 4 steps \(restart from step 4\) in ", res.stdout, re.M), res.stdout
    state = json.loads((ck / "manifest.json").read_text())["integrator"]["state"]
    assert (state["step_count"], state["dt_fs"]) == (8, 2.0)
    assert (state["temperature_K"], state["friction_per_fs"]) == (50.0, 0.05)
    old_rows = before[0].decode().splitlines()
    kept = [r for r in old_rows[1:] if int(r.split(",")[0]) <= 4]
    rows = files[0].read_text().splitlines()
    assert rows[: len(kept)] == old_rows[:1] + kept[:-1]  # before the checkpoint: kept
    # the checkpoint's own step is recorded again from it: the same state, no timing
    at, was = rows[len(kept)].split(","), kept[-1].split(",")
    assert at[0] == "4" and at[:8] + at[9:] == was[:8] + was[9:]
    new = [int(r.split(",")[0]) for r in rows[1 + len(kept) :]]
    assert new == sorted(set(new)) and new[0] > 4 and new[-1] == 8  # then this run's
    assert not set(old_rows[1:]) - set(kept) & set(rows)  # the old run's later rows: gone
    frames = [int(s) for s in re.findall(r"step=(\d+)", files[1].read_text())]
    assert frames == sorted(frames) and len(set(frames)) == len(frames) and frames[-1] == 8
