"""`nvdd run`: validation before launch, clean exits, streamed outputs, signals, restart."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvalchemi.distributed._checks import lj_species, validate
from nvalchemi.distributed._outputs import (
    THERMO_KEYS,
    ThermoLog,
    TrajectoryLog,
    next_due,
    nve_drift_per_atom,
    output_due,
)
from nvalchemi.distributed.cli import build_parser, main
from nvdd.testing import importorskip_extra

TINY = ["--cells", "3", "--cutoff", "6.0", "--skin", "0.5", "--thermo-every", "2"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")


def _nvdd(*args: str) -> list[str]:
    return [sys.executable, "-m", "nvalchemi.distributed.cli", "run", *args]


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv])


_NACL_LJ = (
    '[[model]]\nkind = "lj"\ncutoff = 4.5\nspecies = { 11 = [0.05, 2.35], 17 = [0.05, 4.0] }\n'
)
_EWALD = '[[model]]\nkind = "ewald"\ncutoff = 4.5\naccuracy = 1e-5\n'
_RUN_FILES = {
    "typo.toml": '[system]\nbuiltin = "nacl"\ncell = 2\n' + _NACL_LJ,
    "badkey.toml": '[system]\ncells = 1\n[[model]]\nkind = "ewald"\ncutof = 4.5\n',
    "nolj.toml": '[system]\ncells = 1\n[[model]]\nkind = "lj"\ncutoff = 4.5\n'
    "species = { 11 = [0.05, 2.35] }\n",
    "nocharges.toml": '[system]\nstructure = "{d}/nacl.xyz"\n' + _NACL_LJ + _EWALD,
    "fewcharges.toml": '[system]\nstructure = "{d}/nacl.xyz"\ncharges = { 11 = 1.0 }\n'
    + _NACL_LJ
    + _EWALD,
    "nofile.toml": '[system]\nstructure = "{d}/missing.xyz"\n' + _NACL_LJ,
    "slab.toml": '[system]\nstructure = "{d}/slab.xyz"\n[[model]]\nkind = "lj"\n'
    "cutoff = 4.5\nepsilon = 0.01\nsigma = 3.4\n",
    "good.toml": '[system]\nstructure = "{d}/nacl.xyz"\ncharges = { 11 = 1.0, 17 = -1.0 }\n'
    + _NACL_LJ
    + _EWALD,
}


@pytest.fixture
def structures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # (the default --out is relative and must be new or empty)
    (tmp_path / "cu.xyz").write_text("2\n\nCu 0 0 0\nCu 1.8 0 0\n")
    (tmp_path / "xx.xyz").write_text("1\n\nXx 0 0 0\n")
    (tmp_path / "garbage.xyz").write_text("not a structure\n")
    lattice = 'Lattice="8 0 0 0 8 0 0 0 8" Properties=species:S:1:pos:R:3'
    (tmp_path / "slab.xyz").write_text(f'2\n{lattice} pbc="T T F"\nAr 0 0 0\nAr 3.8 0 0\n')
    (tmp_path / "nacl.xyz").write_text(f'2\n{lattice} pbc="T T T"\nNa 0 0 0\nCl 2.8 0 0\n')
    two = f'2\n{lattice} pbc="T T T"\nAr 0 0 0\nAr 3.8 0 0\n'
    (tmp_path / "two.xyz").write_text(two + two.replace("3.8", "3.9"))  # two frames
    (tmp_path / "oxide.xyz").write_text(
        f'3\n{lattice} pbc="T T T"\nO 0 0 0\nO 1.6 0 0\nSi 0 1.6 0\n'
    )
    for name, text in _RUN_FILES.items():
        (tmp_path / name).write_text(text.replace("{d}", str(tmp_path)))
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cutoff", "0"], "--cutoff must be > 0 A, got 0.0"),
        (["--temperature", "-5"], "--temperature must be >= 0 K, got -5.0"),
        (["--dt", "nan"], "--dt must be > 0 fs, got nan"),
        (["--grid", "2", "2", "1"], "--grid 2 2 1 has 4 boxes but --nproc is 2"),
        (["--structure", "{d}/missing.xyz"], "missing.xyz: no such file"),
        (["--structure", "{d}"], ": is a directory; give a structure file"),
        (["--structure", "{d}/two.xyz"], "two.xyz: holds 2 frames; pick one with"),
        (["--structure", "{d}/two.xyz@2"], "two.xyz@2: holds 2 frames, no frame 2"),
        (["--structure", "{d}/garbage.xyz"], "garbage.xyz: ase.io.read cannot read it"),
        (["--structure", "{d}/xx.xyz"], "unknown element symbol 'Xx'"),
        (["--structure", "{d}/cu.xyz"], "no Lennard-Jones parameters for Cu (Z=29)"),
        (["--lj", "Cu:0.4"], "expected SYMBOL:EPSILON:SIGMA"),
        (["--lj", "Cu:0.4:-1"], "need epsilon >= 0 eV and sigma > 0 A"),
        (["--restart", "{d}/none"], "no checkpoint there"),
        (["--watchdog", "-1"], "--watchdog must be >= 0 s"),
        # the thermostat and barostat numbers, whatever the ensemble (never unused)
        (["--tau-t", "0"], "--tau-t must be > 0 fs, got 0.0"),
        (["--ensemble", "nvt-nh", "--tau-t", "nan"], "--tau-t must be > 0 fs, got nan"),
        (["--ensemble", "npt", "--tau-p", "-100"], "--tau-p must be > 0 fs, got -100.0"),
        (["--ensemble", "npt", "--pressure", "inf"], "--pressure must be a finite number of bar"),
        (["--ensemble", "nvt-nh", "--temperature", "0"], "nvt-nh needs --temperature > 0 K"),
        (["--ensemble", "npt", "--structure", "{d}/slab.xyz"], "npt needs a cell periodic on"),
        # --model mace reads and checks the structure before launch too
        (["--model", "mace", "--structure", "{d}/missing.xyz"], "missing.xyz: no such file"),
        (["--model", "mace", "--structure", "{d}/garbage.xyz"], "ase.io.read cannot read it"),
        (
            ["--model", "mace", "--structure", "{d}/cu.xyz"],
            "Cu (Z=29) not among the elements the built-in MACE knows (O (Z=8), Si (Z=14))",
        ),
        # a run file's system and components are built before launch
        (["--run-file", "{d}/typo.toml"], "[system]: unknown key(s) ['cell']"),
        (["--run-file", "{d}/badkey.toml"], "unexpected keyword argument 'cutof'"),
        (["--run-file", "{d}/nolj.toml"], "(kind = 'lj'): no parameters for atomic number(s) [17]"),
        (["--run-file", "{d}/nocharges.toml"], "(kind = 'ewald') needs per-atom charges"),
        (
            ["--run-file", "{d}/fewcharges.toml"],
            "[system]: charges: no charge given for atomic number(s) [17] (given: [11])",
        ),
        (["--run-file", "{d}/nofile.toml"], "missing.xyz': no such file"),
        (["--ensemble", "npt", "--run-file", "{d}/slab.toml"], "npt needs a cell periodic on"),
    ],
)
def test_bad_arguments_fail_before_any_rank_starts(
    structures: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    t0 = time.monotonic()
    rc = main(["run", *(a.format(d=structures) for a in argv)])
    err = capsys.readouterr().err
    assert rc == 2
    assert time.monotonic() - t0 < 10  # no rank was started
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvdd run: error: "), err
    assert message in lines[0], lines[0]


def test_a_frame_of_a_trajectory_is_picked_by_index_and_gets_velocities(
    structures: Path,
) -> None:
    """``FILE@INDEX`` picks one frame; a structure without velocities starts with
    Maxwell-Boltzmann velocities at --temperature (zero momentum), and says so."""
    import torch

    from nvalchemi.distributed._checks import read_structure
    from nvalchemi.distributed._demo import _load

    assert validate(_args("--structure", f"{structures / 'two.xyz'}@-1")) == []
    assert read_structure(f"{structures / 'two.xyz'}@-1").positions[1, 0] == 3.9
    assert read_structure(f"{structures / 'two.xyz'}@0").positions[1, 0] == 3.8
    args = _args("--structure", f"{structures / 'two.xyz'}@0", "--temperature", "300")
    batch = _load(args, torch.float64, torch.device("cpu"))
    assert bool(batch.velocities.abs().gt(0).all())
    assert float((batch.masses[:, None] * batch.velocities).sum(0).abs().max()) < 1e-12
    assert "velocities drawn at 300 K (Maxwell-Boltzmann, seed 0)" in args.velocity_note
    again = _load(
        _args("--structure", str(structures / "oxide.xyz")), torch.float32, torch.device("cpu")
    )
    assert again.velocities.dtype == torch.float32 and bool(again.velocities.abs().gt(0).any())
    # a run file's structure: one frame picked the same way, velocities the same way
    run_file = structures / "frame.toml"
    run_file.write_text(
        f'[system]\nstructure = "{structures / "two.xyz"}@1"\ncharges = {{ 18 = 0.0 }}\n'
        '[[model]]\nkind = "lj"\ncutoff = 3.0\n'
    )
    args = _args("--run-file", str(run_file))
    batch = _load(args, torch.float64, torch.device("cpu"))
    assert float(batch.positions[1, 0]) == 3.9 and bool(batch.velocities.abs().gt(0).all())
    assert "Maxwell-Boltzmann" in args.velocity_note


def test_the_built_in_boxes_draw_velocities_at_zero_momentum_in_either_dtype() -> None:
    """nvdd run's own boxes (argon; the O/Si box of --model mace, sevenn, uma, aimnet2)
    draw velocities with nvdd.core.maxwell_boltzmann: near --temperature, zero total
    momentum mass-weighted (the O/Si box subtracted the plain mean: its centre of mass
    drifted), and the same velocities in float32 as in float64 (argon drew other,
    float32 numbers)."""
    import torch

    from nvalchemi.distributed._demo import argon_box
    from nvalchemi.distributed._models import builtin_system
    from nvdd.dynamics import temperature

    args = _args("--model", "mace", "--cells", "5", "--temperature", "300")
    boxes = {
        dtype: (builtin_system(args, dtype), argon_box(3, dtype=dtype, temperature_K=300.0, seed=0))
        for dtype in (torch.float32, torch.float64)
    }
    for b64, b32 in zip(boxes[torch.float64], boxes[torch.float32], strict=True):
        assert b64 is not None and b32 is not None
        assert len(set(b64.masses.tolist())) == (2 if b64.n_atoms == 125 else 1)
        momentum = (b64.masses[:, None] * b64.velocities).sum(0)
        assert float(momentum.abs().max()) < 1e-12
        # 108 or 125 atoms: the kinetic temperature is 300 K within a few tens of K
        assert abs(float(temperature(b64)) - 300.0) < 60.0
        assert b32.velocities.dtype == torch.float32
        assert torch.allclose(b32.velocities.double(), b64.velocities, rtol=1e-5, atol=1e-7)


def test_parser_has_help_for_every_option_and_a_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    run = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    bare = [a.option_strings for a in run._actions if not a.help and a.option_strings]
    assert bare == []
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("nvdd 0.")


def test_a_valid_run_file_and_mace_structure_pass_the_checks(structures: Path) -> None:
    assert validate(_args("--run-file", str(structures / "good.toml"))) == []
    assert validate(_args("--model", "mace", "--structure", str(structures / "oxide.xyz"))) == []


def test_the_elements_of_a_mace_model_file_are_read_without_loading_it(
    structures: Path, tmp_path: Path
) -> None:
    """--model-file: its atomic_numbers are read with an unpickler that resolves no
    class of the file (mace-torch is not even imported); the structure's elements
    are checked against them before launch. A file that is no model is refused
    before launch, naming it."""
    importorskip_extra("mace")
    import json
    import subprocess

    import torch

    from nvdd.models import MACEConfig, build_mace

    model_file = tmp_path / "oxide.model"
    torch.save(build_mace(MACEConfig(atomic_numbers=(8, 14), r_max=4.0, seed=5)), model_file)
    (tmp_path / "junk.model").write_bytes(b"PK\x03\x04 not a model")
    code = (
        "import json, sys\n"
        "from nvalchemi.distributed._model_peek import mace_file_elements\n"
        f"got = [mace_file_elements({str(model_file)!r}), "
        f"mace_file_elements({str(tmp_path / 'junk.model')!r})]\n"
        "print(json.dumps([got, 'mace' in sys.modules, 'e3nn' in sys.modules]))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [[[8, 14], None], False, False]
    mace = ["--model", "mace", "--model-file", str(model_file), "--structure"]
    problems = validate(_args(*mace, str(structures / "cu.xyz")))
    assert problems == [
        f"--structure {structures / 'cu.xyz'}: Cu (Z=29) not among the elements the model in "
        f"{model_file} knows (O (Z=8), Si (Z=14))"
    ]
    assert validate(_args(*mace, str(structures / "oxide.xyz"))) == []
    junk = ["--model", "mace", "--model-file", str(tmp_path / "junk.model")]
    (problem,) = validate(_args(*junk, "--structure", str(structures / "cu.xyz")))
    assert problem.startswith(f"--model-file {tmp_path / 'junk.model'}: not a model saved")


def test_ranks_started_by_another_launcher_check_the_arguments_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("NVDD_RUN_ARGV", raising=False)
    assert main(["run", "--cutoff", "-1"]) == 2  # before init_distributed
    assert "--cutoff must be > 0 A, got -1.0" in capsys.readouterr().err


def test_cuda_without_gpus_is_refused_up_front(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["run", "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device is available" in capsys.readouterr().err


def test_every_element_needs_lj_parameters(structures: Path) -> None:
    args = _args("--structure", str(structures / "cu.xyz"))
    assert any("pass --lj Cu:EPSILON:SIGMA" in p for p in validate(args))
    args = _args("--structure", str(structures / "cu.xyz"), "--lj", "Cu:0.415:2.28")
    assert validate(args) == []
    species = lj_species(args)
    assert (species[29].epsilon, species[29].sigma) == (0.415, 2.28)
    assert (species[18].epsilon, species[18].sigma) == (0.0104, 3.40)
    assert lj_species(_args("--lj", "29:1:2"))[29].symbol == "Cu"


def test_nve_drift_divides_by_every_atom_of_the_system() -> None:
    rows = [
        {"step": 5.0, "E_tot": -1.0, "n_atoms": 1000.0, "atoms_max": 260.0},
        {"step": 15.0, "E_tot": -2.0, "n_atoms": 1000.0, "atoms_max": 260.0},
        {"step": 25.0, "E_tot": -2.5, "n_atoms": 1000.0, "atoms_max": 260.0},
    ]
    assert nve_drift_per_atom(rows, nvt_steps=10) == pytest.approx(0.5 / 1000)
    assert nve_drift_per_atom(rows[:2], nvt_steps=10) is None


def test_thermo_is_streamed_and_a_restart_keeps_rows_up_to_the_checkpoint(
    tmp_path: Path,
) -> None:
    row = dict.fromkeys(("T", "E_pot", "E_kin", "E_tot", "n_atoms", "atoms_min"), 1.0)
    row.update(atoms_max=2.0, ms_per_step=3.0)
    log = ThermoLog(tmp_path / "thermo.csv")
    for step in (2, 4, 6):
        log.append({**row, "step": float(step)})
        assert (tmp_path / "thermo.csv").read_text().count("\n") == 1 + step // 2  # on disk now
    log.close()
    again = ThermoLog(tmp_path / "thermo.csv", keep_until=4)
    assert [r["step"] for r in again.rows] == [2.0, 4.0]
    again.start()  # (the restart's first step succeeded: cut back, then stream)
    again.append({**row, "step": 6.5})
    again.close()
    text = (tmp_path / "thermo.csv").read_text().splitlines()
    assert text[0].startswith("step,T,E_pot,E_kin,E_tot,n_atoms")
    assert [line.split(",")[0] for line in text[1:]] == ["2", "4", "6.5"]


def _outputs_listed(stdout: str) -> list[str]:
    m = re.search(r"^outputs in .*?/: (.*)$", stdout, flags=re.M)
    assert m is not None, stdout
    return [] if m.group(1) == "none" else m.group(1).split(", ")


@pytest.mark.gloo
def test_runs_on_four_ranks_end_cleanly_with_every_output(tmp_path: Path) -> None:
    for attempt in range(3):  # at 451ab6f 2 of 3 such runs lost their outputs
        out = tmp_path / f"run{attempt}"
        args = [*TINY, "--nproc", "4", "--nvt-steps", "4", "--nve-steps", "4"]
        args += ["--traj-every", "4", "--compare", "none", "--out", str(out)]
        res = subprocess.run(_nvdd(*args), capture_output=True, text=True, timeout=600, env=_env())
        text = res.stdout + res.stderr
        assert res.returncode == 0, text[-3000:]
        assert "terminate called" not in text
        listed = _outputs_listed(res.stdout)
        assert listed == ["thermo.csv", "energies.png", "trajectory.extxyz"]
        assert sorted(p.name for p in out.iterdir()) == sorted(listed)


#: A process whose daemon thread is inside a tensor operation when it ends; its
#: last output is buffered (a pipe) and an exit handler prints one more line.
_BUSY_DAEMON = """
import atexit, sys, threading, time
import torch
from nvalchemi.distributed._stop import end_finished_rank
torch.set_num_threads(1)
a = torch.randn(300, 300)
def spin():
    while True:
        a @ a
threading.Thread(target=spin, daemon=True).start()
time.sleep(0.2)
atexit.register(lambda: print("exit handler ran"))
sys.stdout.write("done, not flushed")
end_finished_rank(3)
"""


def test_a_finished_rank_ends_after_its_exit_handlers_and_a_busy_thread_cannot_abort_it() -> None:
    """``end_finished_rank`` (how every finished rank of ``nvdd run`` ends, record
    0091): the exit handlers run, buffered output is written, the status is kept,
    and a daemon thread caught inside a tensor operation does not abort the
    process (at a normal interpreter exit it does: SIGABRT, 'terminate called
    without an active exception', 5 times of 5 on the development machine)."""
    for _ in range(3):
        res = subprocess.run(
            [sys.executable, "-c", _BUSY_DAEMON], capture_output=True, text=True, timeout=120
        )
        assert res.returncode == 3, res.stderr[-2000:]
        assert res.stdout == "done, not flushedexit handler ran\n"
        assert "terminate called" not in res.stderr


_CONSOLE = """
import atexit
from nvalchemi.distributed import cli
cli.main = lambda: 5
atexit.register(lambda: print("exit handler ran"))
try:
    cli.console()
except SystemExit as exc:
    print("raised", exc.code)
    raise
"""


def test_the_command_ends_a_rank_through_end_finished_rank_and_raises_elsewhere() -> None:
    """``cli.console`` (the ``nvdd`` script, ``python -m nvalchemi.distributed.cli``):
    as a rank of a job (``RANK`` and ``WORLD_SIZE`` set) the process ends with the
    status of ``main`` and its exit handlers run, nothing is raised; otherwise it
    raises ``SystemExit`` with that status, as any command does."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    for rank_env, out in (({"RANK": "0", "WORLD_SIZE": "1"}, ""), ({}, "raised 5\n")):
        res = subprocess.run(
            [sys.executable, "-c", _CONSOLE],
            capture_output=True,
            text=True,
            timeout=120,
            env={**env, **rank_env},
        )
        assert res.returncode == 5, res.stderr[-2000:]
        assert res.stdout == out + "exit handler ran\n", rank_env


@pytest.mark.gloo
def test_rows_and_frames_fall_on_whole_run_steps_and_no_file_is_empty(tmp_path: Path) -> None:
    """Phases of 3 + 4 steps, thermo every 2, frames every 5: rows at steps 0, 2,
    4, 6 and the last (7), frames at 0, 5, 7 (counted over the whole run, not per
    phase); every file listed exists and is non-empty, nothing else is there."""
    out = tmp_path / "short"
    args = ["--cells", "2", "--cutoff", "6.0", "--skin", "0.5", "--nproc", "2"]
    args += ["--nvt-steps", "3", "--nve-steps", "4", "--thermo-every", "2", "--traj-every", "5"]
    args += ["--compare", "none", "--out", str(out)]
    res = subprocess.run(_nvdd(*args), capture_output=True, text=True, timeout=600, env=_env())
    assert res.returncode == 0, res.stderr[-3000:]
    printed = re.findall(r"^\s*(NVT|NVE)\s+(\d+)\s", res.stdout, flags=re.M)
    assert printed == [("NVT", "0"), ("NVT", "2"), ("NVE", "4"), ("NVE", "6"), ("NVE", "7")]
    lines = (out / "thermo.csv").read_text().splitlines()
    assert [int(line.split(",")[0]) for line in lines[1:]] == [0, 2, 4, 6, 7]
    frames = re.findall(r"step=(\d+)", (out / "trajectory.extxyz").read_text())
    assert frames == ["0", "5", "7"]
    listed = _outputs_listed(res.stdout)
    assert listed == ["thermo.csv", "energies.png", "trajectory.extxyz"]
    assert sorted(p.name for p in out.iterdir()) == sorted(listed)
    assert all((out / name).stat().st_size > 0 for name in listed)
    # quiet: no Warp banner or load lines, no progress bar off a terminal, each
    # warning once and without a source path, a summary in words
    text = res.stdout + res.stderr
    assert "Warp " not in text and "load on device" not in text and "\r" not in text, text
    assert text.count("degenerate partition") == 1, text
    assert "nvdd: warning: degenerate partition" in res.stderr
    assert ".py:" not in res.stderr, res.stderr
    assert re.search(r"^done: 7 steps in .* the NVE phase built its halo", res.stdout, re.M)
    assert "collectives" not in res.stdout


def test_output_steps_count_over_the_whole_run_and_logs_start_with_a_record(
    tmp_path: Path,
) -> None:
    assert [s for s in range(12) if output_due(s, 5, 11)] == [0, 5, 10, 11]
    assert not any(output_due(s, 0, 11) for s in range(12))  # 0: never
    assert [next_due(3, 2, 7), next_due(6, 2, 7), next_due(3, 0, 7)] == [4, 7, 7]
    log = ThermoLog(tmp_path / "thermo.csv")
    log.close()
    assert not (tmp_path / "thermo.csv").exists()  # no row, no file
    traj = TrajectoryLog(tmp_path / "trajectory.extxyz")
    traj.close()
    assert not (tmp_path / "trajectory.extxyz").exists()


def _job_processes(token: str) -> list[int]:
    """Live processes whose environment mentions ``token`` (our nvdd job's workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_a_users_stop_is_told_from_the_end_of_a_job_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank side of issue 39 item 5, in process: Ctrl-C and a noted SIGTERM
    are stops (130, 143); an unnoted SIGTERM goes to nvdd.core's handler."""
    import logging

    from nvalchemi.distributed import _stop

    note = tmp_path / "note"
    monkeypatch.setenv(_stop.STOP_NOTE_ENV, str(note))
    state = _stop._State()
    seen: list[int] = []
    state.previous = {signal.SIGTERM: lambda s, f: seen.append(s)}
    monkeypatch.setattr(_stop, "_state", state)
    with pytest.raises(SystemExit) as ended:  # the launcher ends a job after a failure
        _stop._on_stop(signal.SIGTERM, None)
    assert ended.value.code == 143 and seen == [signal.SIGTERM]
    assert _stop.stop_signal() is None
    with pytest.raises(_stop.JobStopped) as stopped:  # Ctrl-C
        _stop._on_stop(signal.SIGINT, None)
    assert 128 + stopped.value.signum == 130 and _stop.stop_signal() == signal.SIGINT
    _stop._on_stop(signal.SIGTERM, None)  # a second signal does not cut the stop short
    monkeypatch.setattr(_stop, "_state", _stop._State())
    # torchrun logs the signal it got before it signals the ranks: noted as a stop
    record = logging.LogRecord(
        "t", logging.WARNING, "", 0, "Received %s death signal, shutting down workers",
        (signal.SIGTERM,), None,
    )  # fmt: skip
    assert not _stop._QuietStop().filter(record) and note.read_text() == "SIGTERM"
    assert _stop.stop_signal() == signal.SIGTERM  # known before this rank's own signal
    with pytest.raises(_stop.JobStopped):
        _stop._on_stop(signal.SIGTERM, None)


@pytest.mark.gloo
def test_sigkill_to_the_launcher_ends_torchrun_and_every_rank(tmp_path: Path) -> None:
    """Issue 39 item 3: torchrun and its ranks ran on unsupervised after the
    ``nvdd`` launcher was killed with SIGKILL (no handler runs)."""
    out = tmp_path / "orphans"
    args = [*TINY, "--nproc", "2", "--nvt-steps", "100000", "--nve-steps", "0"]
    args += ["--traj-every", "0", "--compare", "none", "--out", str(out)]
    proc = subprocess.Popen(
        _nvdd(*args), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 300
        while not (out / "thermo.csv").exists() or (out / "thermo.csv").stat().st_size < 200:
            assert proc.poll() is None and time.monotonic() < deadline, "no thermo rows"
            time.sleep(0.2)
        assert len(_job_processes(str(out))) >= 3  # torchrun and two ranks, running
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while _job_processes(str(out)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _job_processes(str(out)) == []
    finally:
        for pid in _job_processes(str(out)):  # this test's own job, if left behind
            os.kill(pid, signal.SIGKILL)


@pytest.mark.gloo
def test_sigterm_stops_the_job_and_a_restart_on_other_ranks_continues_it(tmp_path: Path) -> None:
    import json

    out = tmp_path / "job"
    common = [*TINY, "--traj-every", "2", "--out", str(out)]
    killed = [*common, "--nproc", "2", "--nvt-steps", "100000", "--nve-steps", "0"]
    killed += ["--checkpoint-every", "2", "--compare", "none"]
    logs = tmp_path / "stdout", tmp_path / "stderr"
    with logs[0].open("w") as so, logs[1].open("w") as se:
        proc = subprocess.Popen(_nvdd(*killed), env=_env(), stdout=so, stderr=se)
    try:
        deadline = time.monotonic() + 300
        manifest = out / "checkpoint" / "manifest.json"
        while time.monotonic() < deadline:  # thermo rows arrive during the run: streamed
            if manifest.exists() and (out / "thermo.csv").read_text().count("\n") >= 3:
                break
            assert proc.poll() is None, "the run ended early"
            time.sleep(0.2)
        else:
            pytest.fail("no checkpoint or no streamed thermo rows")
        assert len(_job_processes(str(out))) >= 3  # torchrun and two workers
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 60
        time.sleep(1.0)
        assert _job_processes(str(out)) == []  # torchrun and every worker are gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # A user's stop, not a crash (issue 39 item 5): one line, no traceback on any
    # rank (nor gloo's "remote worker crashing"), the plot of the rows so far.
    stdout, stderr = logs[0].read_text(), logs[1].read_text()
    stops = re.findall(r"^stopped by SIGTERM at step (\d+); outputs kept: (.*)$", stdout, re.M)
    assert len(stops) == 1, stdout[-3000:]
    assert stops[0][1] == "thermo.csv, energies.png, trajectory.extxyz, checkpoint/"
    assert "Traceback" not in stdout + stderr and "remote worker" not in stderr, stderr[-3000:]
    assert (out / "energies.png").stat().st_size > 0
    last_row = int((out / "thermo.csv").read_text().splitlines()[-1].split(",")[0])
    assert last_row <= int(stops[0][0]) <= last_row + 2  # its row may not be written yet
    lines = (out / "thermo.csv").read_text().splitlines()
    assert all(len(line.split(",")) == len(THERMO_KEYS) for line in lines)  # whole rows only
    step = json.loads(manifest.read_text())["metadata"]["step"]
    assert 2 <= step <= 40 and step % 2 == 0
    # Continue on 3 ranks to step 40 + 4 and compare with an uninterrupted
    # 1-rank run of all 44 steps.
    again = [*common, "--nproc", "3", "--nvt-steps", "40", "--nve-steps", "4"]
    again += ["--compare", "trajectory", "--restart", str(out / "checkpoint")]
    res = subprocess.run(_nvdd(*again), capture_output=True, text=True, timeout=600, env=_env())
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"at step {step}" in res.stdout
    m = re.search(r"max \|dx\| = (\S+) A", res.stdout)
    assert m is not None and float(m.group(1)) < 1e-10, res.stdout
    steps = [int(line.split(",")[0]) for line in (out / "thermo.csv").read_text().splitlines()[1:]]
    assert steps == list(range(0, 45, 2))  # rows after the checkpoint were dropped, then redone
    assert (out / "trajectory.extxyz").read_text().count("Lattice=") == 23  # steps 0, 2, ..., 44
    assert "checkpoint/" in _outputs_listed(res.stdout)


def test_console_shows_each_warning_once_without_its_path_and_no_bar_off_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import warnings

    from nvalchemi.distributed import _console

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # restored after
    monkeypatch.delenv("NVDD_VERBOSE", raising=False)
    _console.install_warning_format(rank=0)
    for _ in range(3):  # e.g. once per phase
        warnings.showwarning(UserWarning("degenerate partition: x"), UserWarning, "/a/b.py", 7)
    assert capsys.readouterr().err == "nvdd: warning: degenerate partition: x\n"
    _console.install_warning_format(rank=1)  # other ranks: quiet unless verbose
    warnings.showwarning(UserWarning("y"), UserWarning, "/a/b.py", 7)
    assert capsys.readouterr().err == ""
    assert _console.progress_bar(10, 0) is None  # stderr is not a terminal here
    real = __import__("importlib").import_module

    def no_mpl(name: str, package: str | None = None) -> object:
        if name == "matplotlib":
            raise ModuleNotFoundError("No module named 'kiwisolver'", name="kiwisolver")
        return real(name, package)

    monkeypatch.setattr(_console.importlib, "import_module", no_mpl)
    assert _console.missing_outputs(trajectory=False) == [
        "nvdd run: no energies.png: it needs matplotlib: pip install "
        "'nvalchemi-distributed[demo]' (the import failed with ModuleNotFoundError: "
        "No module named 'kiwisolver')"
    ]
