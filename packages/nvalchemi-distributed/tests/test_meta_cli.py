"""`nvdd run`, the main job, end to end on 2 CPU ranks (a tiny argon box).

The first test launches ``nvdd run`` as a user does (the CLI, torchrun, two new
rank processes); the others run what each rank of that job runs
(:func:`~nvalchemi.distributed._demo.run_rank` on the arguments the CLI checked)
in ``run_ranks``' pooled ranks and read rank 0's printout: the same run and the
same checks without three new Python processes per test."""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nvalchemi.distributed._checks import validate
from nvalchemi.distributed._demo import run_rank
from nvalchemi.distributed.cli import build_parser
from nvdd.testing import importorskip_extra, run_ranks


def _rank(argv: list[str]) -> tuple[int, str]:
    """Rank function: one rank of ``nvdd run`` (the group run_ranks made is
    reused); its exit status and what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = run_rank(build_parser().parse_args(argv))
    return status, printed.getvalue()


class _Done:
    """What a job run by :func:`_job` left: rank 0's printout (``stdout``)."""

    def __init__(self, stdout: str) -> None:
        self.stdout = stdout


def _job(*args: str) -> _Done:
    """``nvdd run ARGS`` on 2 pooled ranks, after the CLI's checks of ARGS."""
    argv = ["run", *args]
    assert validate(build_parser().parse_args(argv)) == []
    ranks = run_ranks(_rank, 2, argv, timeout_s=600)
    assert [status for status, _ in ranks] == [0, 0], ranks[0][1][-3000:]
    assert ranks[1][1] == "", ranks[1][1]  # only rank 0 prints
    return _Done(ranks[0][1])


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
    assert [int(s) for _, s in rows] == [0, 3, 6, 9, 12]
    m = re.search(r"max \|dF\| = (\S+) eV/A, \|dE\| = (\S+) eV over 256 atoms", text)
    assert m is not None, text
    assert float(m.group(1)) < 1e-10 and float(m.group(2)) < 1e-9
    assert (out / "thermo.csv").read_text().startswith("step,T,E_pot,E_kin,E_tot")
    assert (out / "energies.png").stat().st_size > 1000
    frames = (out / "trajectory.extxyz").read_text().count("Lattice=")
    assert frames == 3  # steps 0, 6 and 12


@pytest.mark.gloo
def test_nvdd_run_npt_two_ranks_follow_the_one_rank_trajectory(tmp_path: Path) -> None:
    """--ensemble npt: the whole trajectory (cell included) against one rank, the
    NPT columns in thermo.csv and per-atom energies in the extxyz frames."""
    out = tmp_path / "npt"
    args = ["--nproc", "2", "--cells", "3", "--cutoff", "6.0", "--skin", "0.5"]
    args += ["--ensemble", "npt", "--pressure", "2000", "--tau-p", "200", "--tau-t", "50"]
    args += ["--cell-dof", "full", "--nvt-steps", "12", "--nve-steps", "4"]
    args += ["--thermo-every", "4", "--traj-every", "4", "--compare", "trajectory"]
    text = _job(*args, "--out", str(out)).stdout
    assert "108 atoms on 2 cpu rank(s) (gloo); npt 12 + NVE 4" in text
    assert re.findall(r"^\s*(NPT|NVE)\s+(\d+)\s", text, flags=re.M) == [
        ("NPT", "0"),
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
    assert frames.count("Lattice=") == 5 and "energies:R:1" in frames  # steps 0, 4, ..., 16


def test_nvdd_run_with_a_run_file_runs_a_composed_model(tmp_path: Path) -> None:
    """LJ + Ewald on rock salt from a run file: 2 ranks equal 1 rank by atom id."""
    run_file = tmp_path / "nacl.toml"
    run_file.write_text(
        '[system]\nbuiltin = "nacl"\ncells = 2\n'
        '[[model]]\nkind = "lj"\ncutoff = 4.5\n'
        'species = { 11 = [0.05, 2.35], 17 = [0.05, 4.0] }\npairs = { "11-17" = [0.6, 2.45] }\n'
        '[[model]]\nkind = "ewald"\ncutoff = 4.5\naccuracy = 1e-5\n'
    )
    args = ["--nproc", "2"]
    args += ["--run-file", str(run_file), "--nvt-steps", "3", "--nve-steps", "3", "--dt", "1.0"]
    args += ["--thermo-every", "3", "--traj-every", "0", "--temperature", "100"]
    res = _job(*args, "--out", str(tmp_path / "run"))
    assert "64 atoms on 2 cpu rank(s) (gloo)" in res.stdout
    m = re.search(r"max \|dF\| = (\S+) eV/A, \|dE\| = (\S+) eV over 64 atoms", res.stdout)
    assert m is not None, res.stdout
    assert float(m.group(1)) < 1e-10 and float(m.group(2)) < 1e-9


def test_parser_defaults_describe_the_main_job() -> None:
    args = build_parser().parse_args(["run"])
    assert args.cells == 20 and args.nproc == 2 and args.device == "cpu"
    assert 4 * args.cells**3 == 32000


_MACE_RUN = ("--nproc", "2", "--nvt-steps", "2", "--nve-steps", "2", "--thermo-every", "2")


def test_the_built_in_mace_and_its_box() -> None:
    """``--model mace`` without a file: a random MACE on an O/Si box of cells**3 atoms
    (the 2-rank run below covers the DD path with a model file)."""
    importorskip_extra("mace")
    import torch

    from nvalchemi.distributed._models import build_model, builtin_system

    args = build_parser().parse_args(["run", "--model", "mace", "--cells", "4", "--skin", "0.5"])
    batch = builtin_system(args, torch.float64)
    assert batch is not None and batch.n_atoms == 64
    assert set(batch.atomic_numbers.tolist()) == {8, 14} and bool(batch.pbc.all())
    model = build_model(args, torch.device("cpu"), torch.float64)
    assert model.cutoff == 5.0 and model.atomic_numbers == [8, 14]
    out = model(batch)
    assert out["forces"].shape == (64, 3) and bool(torch.isfinite(out["forces"]).all())
    assert builtin_system(build_parser().parse_args(["run"]), torch.float64) is None  # argon


@pytest.mark.gloo
def test_nvdd_run_with_a_mace_model_file_and_a_structure(tmp_path: Path) -> None:
    importorskip_extra("mace")
    import ase
    import ase.io
    import torch

    from nvdd.models import MACEConfig, build_mace

    model_file = tmp_path / "oxide.model"
    torch.save(build_mace(MACEConfig(atomic_numbers=(8, 14), r_max=4.0, seed=5)), model_file)
    g = torch.Generator().manual_seed(0)
    grid = torch.stack(torch.meshgrid(*[torch.arange(5.0)] * 3, indexing="ij"), -1).reshape(-1, 3)
    positions = (grid + 0.5) * 2.5 + 0.05 * torch.randn(125, 3, generator=g)
    numbers = [8 if k % 3 else 14 for k in range(125)]
    atoms = ase.Atoms(numbers=numbers, positions=positions.numpy(), cell=[12.5] * 3, pbc=True)
    ase.io.write(tmp_path / "oxide.xyz", atoms, format="extxyz")
    out = tmp_path / "run"
    res = _job(
        "--model",
        "mace",
        "--model-file",
        str(model_file),
        "--structure",
        str(tmp_path / "oxide.xyz"),
        "--traj-every",
        "0",
        "--out",
        str(out),
        *_MACE_RUN,
    )
    m = re.search(r"max \|dF\| = (\S+) eV/A, \|dE\| = (\S+) eV over 125 atoms", res.stdout)
    assert m is not None and float(m.group(1)) < 1e-10, res.stdout
    assert (out / "thermo.csv").is_file()


def test_model_options_are_checked_before_ranks_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nvalchemi.distributed.cli import main

    assert main(["run", "--model-file", str(tmp_path / "x.model")]) == 2
    assert "use it with --model mace" in capsys.readouterr().err
    assert main(["run", "--model", "mace", "--model-file", str(tmp_path / "missing.model")]) == 2
    assert "missing.model' does not exist" in capsys.readouterr().err
    assert build_parser().parse_args(["run"]).model == "lj"
    # --uma-checkpoint: UMA's only, on / off / a positive number of edges
    assert main(["run", "--uma-checkpoint", "off"]) == 2
    assert "--uma-checkpoint is a setting of --model uma, not of --model lj" in (
        capsys.readouterr().err
    )
    for bad in ("0", "-5", "maybe", "1.5", "\u00b2"):
        assert main(["run", "--model", "uma", "--uma-checkpoint", bad]) == 2, bad
        assert f"positive number of edges per chunk, got {bad!r}" in capsys.readouterr().err
    uma = ["run", "--model", "uma", "--uma-checkpoint"]
    assert validate(build_parser().parse_args([*uma, "OFF"])) == []
    assert validate(build_parser().parse_args([*uma, "65536"])) == []


def test_uma_checkpoint_values_read_as_the_model_takes_them() -> None:
    from nvalchemi.distributed._model_args import uma_checkpointing

    assert uma_checkpointing("on") is True and uma_checkpointing(" Off ") is False
    assert uma_checkpointing("4096") == 4096
    with pytest.raises(ValueError, match="got '0'"):
        uma_checkpointing("0")


@pytest.mark.gloo
def test_nvdd_run_with_the_built_in_mace_on_two_ranks(tmp_path: Path) -> None:
    """``--model mace`` without ``--model-file``: the random O/Si MACE on its own
    box of ``--cells**3`` atoms, 2 ranks against 1 by atom id."""
    importorskip_extra("mace")
    out = tmp_path / "mace"
    res = _job(
        "--model", "mace", "--cells", "3", "--skin", "0.5", "--traj-every", "0",
        "--out", str(out), *_MACE_RUN,
    )  # fmt: skip
    assert "27 atoms on 2 cpu rank(s) (gloo); langevin 2 + NVE 2" in res.stdout
    m = re.search(r"max \|dF\| = (\S+) eV/A, \|dE\| = (\S+) eV over 27 atoms", res.stdout)
    assert m is not None, res.stdout
    assert float(m.group(1)) < 1e-10 and float(m.group(2)) < 1e-9
    rows = (out / "thermo.csv").read_text().splitlines()
    assert rows[0].startswith("step,T,E_pot") and [r.split(",")[0] for r in rows[1:]] == [
        "0",
        "2",
        "4",
    ]


@pytest.mark.gloo
def test_nvdd_run_nose_hoover_two_ranks_follow_the_one_rank_trajectory(tmp_path: Path) -> None:
    """``--ensemble nvt-nh``: a Nose-Hoover chain NVT phase (its extended energy in
    thermo.csv), then NVE; the whole trajectory against one rank."""
    out = tmp_path / "nh"
    res = _job(
        "--nproc", "2", "--cells", "3", "--cutoff", "6.0", "--skin", "0.5",
        "--ensemble", "nvt-nh", "--tau-t", "50", "--nvt-steps", "4", "--nve-steps", "2",
        "--thermo-every", "2", "--traj-every", "0", "--compare", "trajectory",
        "--out", str(out),
    )  # fmt: skip
    assert "108 atoms on 2 cpu rank(s) (gloo); nvt-nh 4 + NVE 2" in res.stdout
    m = re.search(r"max \|dx\| = (\S+) A", res.stdout)
    assert m is not None and float(m.group(1)) < 1e-8, res.stdout
    m = re.search(r"max \|dF\| = (\S+) eV/A, \|dE\| = (\S+) eV over 108 atoms", res.stdout)
    assert m is not None and float(m.group(1)) < 1e-10 and float(m.group(2)) < 1e-9, res.stdout
    lines = (out / "thermo.csv").read_text().splitlines()
    table = [
        dict(zip(lines[0].split(","), map(float, r.split(",")), strict=True)) for r in lines[1:]
    ]
    assert [int(r["step"]) for r in table] == [0, 2, 4, 6]
    # the Nose-Hoover phase carries its extended energy (Langevin leaves it NaN)
    assert all(math.isfinite(r["E_ext"]) for r in table[1:3]), table  # steps 2, 4
    assert math.isnan(table[3]["E_ext"]), table  # NVE
