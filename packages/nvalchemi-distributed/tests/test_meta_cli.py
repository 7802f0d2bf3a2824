"""`nvdd run`, the main job, end to end on 2 CPU ranks (a tiny argon box)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nvalchemi.distributed.cli import build_parser


@pytest.mark.gloo
def test_nvdd_run_two_ranks_matches_one_rank_and_writes_outputs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "nvalchemi.distributed.cli",
        "run",
        "--nproc",
        "2",
        "--cells",
        "4",
        "--cutoff",
        "6.0",
        "--skin",
        "0.5",
        "--nvt-steps",
        "6",
        "--nve-steps",
        "6",
        "--thermo-every",
        "3",
        "--traj-every",
        "6",
        "--out",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = res.stdout
    assert "256 atoms on 2 cpu rank(s) (gloo)" in text
    rows = re.findall(r"^\s*(NVT|NVE)\s+(\d+)\s", text, flags=re.M)
    assert [int(s) for _, s in rows] == [3, 6, 9, 12]
    m = re.search(r"max \|dF\| = (\S+) eV/A, \|dE\| = (\S+) eV over 256 atoms", text)
    assert m is not None, text
    assert float(m.group(1)) < 1e-10 and float(m.group(2)) < 1e-9
    assert (out / "thermo.csv").read_text().startswith("step,T,E_pot,E_kin,E_tot")
    assert (out / "energies.png").stat().st_size > 1000
    frames = (out / "trajectory.extxyz").read_text().count("Lattice=")
    assert frames == 2  # steps 6 and 12


@pytest.mark.gloo
def test_nvdd_run_npt_two_ranks_follow_the_one_rank_trajectory(tmp_path: Path) -> None:
    """--ensemble npt: the whole trajectory (cell included) against one rank, the
    NPT columns in thermo.csv and per-atom energies in the extxyz frames."""
    out = tmp_path / "npt"
    args = ["run", "--nproc", "2", "--cells", "3", "--cutoff", "6.0", "--skin", "0.5"]
    args += ["--ensemble", "npt", "--pressure", "2000", "--tau-p", "200", "--tau-t", "50"]
    args += ["--cell-dof", "full", "--nvt-steps", "12", "--nve-steps", "4"]
    args += ["--thermo-every", "4", "--traj-every", "4", "--compare", "trajectory"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run(
        [sys.executable, "-m", "nvalchemi.distributed.cli", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = res.stdout
    assert "108 atoms on 2 cpu rank(s) (gloo); npt 12 + NVE 4" in text
    assert re.findall(r"^\s*(NPT|NVE)\s+(\d+)\s", text, flags=re.M) == [
        ("NPT", "4"),
        ("NPT", "8"),
        ("NPT", "12"),
        ("NVE", "16"),
    ]
    m = re.search(r"max \|dx\| = (\S+) A, \|dcell\| = (\S+) A", text)
    assert m is not None, text
    assert float(m.group(1)) < 1e-8 and float(m.group(2)) < 1e-10
    header = (out / "thermo.csv").read_text().splitlines()[0].split(",")
    assert {"E_ext", "V", "P_bar"} <= set(header)
    frames = (out / "trajectory.extxyz").read_text()
    assert frames.count("Lattice=") == 4 and "energies:R:1" in frames  # steps 4, 8, 12, 16


def test_nvdd_run_with_a_run_file_runs_a_composed_model(tmp_path: Path) -> None:
    """LJ + Ewald on rock salt from a run file: 2 ranks equal 1 rank by atom id."""
    run_file = tmp_path / "nacl.toml"
    run_file.write_text(
        '[system]\nbuiltin = "nacl"\ncells = 2\n'
        '[[model]]\nkind = "lj"\ncutoff = 4.5\n'
        'species = { 11 = [0.05, 2.35], 17 = [0.05, 4.0] }\npairs = { "11-17" = [0.6, 2.45] }\n'
        '[[model]]\nkind = "ewald"\ncutoff = 4.5\naccuracy = 1e-5\n'
    )
    cmd = [sys.executable, "-m", "nvalchemi.distributed.cli", "run", "--nproc", "2"]
    cmd += ["--run-file", str(run_file), "--nvt-steps", "3", "--nve-steps", "3", "--dt", "1.0"]
    cmd += ["--thermo-every", "3", "--traj-every", "0", "--temperature", "100"]
    cmd += ["--out", str(tmp_path / "run")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "64 atoms on 2 cpu rank(s) (gloo)" in res.stdout
    m = re.search(r"max \|dF\| = (\S+) eV/A, \|dE\| = (\S+) eV over 64 atoms", res.stdout)
    assert m is not None, res.stdout
    assert float(m.group(1)) < 1e-10 and float(m.group(2)) < 1e-9


def test_parser_defaults_describe_the_main_job() -> None:
    args = build_parser().parse_args(["run"])
    assert args.cells == 20 and args.nproc == 2 and args.device == "cpu"
    assert 4 * args.cells**3 == 32000
