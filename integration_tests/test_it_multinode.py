"""Several nodes, tested on one host: two torchrun agents, each started as one
node of ``--nnodes 2`` (one rank each, gloo), meet at a c10d rendezvous on
127.0.0.1 and run ``nvdd run`` (``it_node_job.py`` wraps it to report what each
worker saw). One launch checks:

- the run equals one process by atom id (positions and forces of the last
  step, read back from the run's checkpoint);
- global ranks 0 and 1, each the local rank 0 of its node (``LOCAL_WORLD_SIZE``
  1 of ``WORLD_SIZE`` 2);
- CPU threads per rank from the node's ranks, not the job's: without
  ``OMP_NUM_THREADS`` each rank takes ``cpu_threads_per_rank(1)`` threads;
- the outputs are written once (only global rank 0 writes ``thermo.csv`` and
  ``trajectory.extxyz``: one header, no step twice).

The Slurm script of ``examples/slurm/`` is checked too: its syntax (``bash -n``)
and the torchrun command it builds, against the one docs/multinode.md shows.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nvalchemi.distributed._demo import argon_box
from nvalchemi.distributed._models import build_model
from nvalchemi.distributed.cli import build_parser
from nvdd.core import cpu_threads_per_rank
from nvdd.dynamics import Langevin, VelocityVerlet, read_checkpoint
from nvdd.testing import assert_close_by_id

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SBATCH = ROOT / "examples" / "slurm" / "multinode.sbatch"

STEPS = 3  # per phase: Langevin NVT, then NVE
RUN = [
    "run",
    "--cells", "3",
    "--cutoff", "6.0",
    "--skin", "0.5",
    "--nvt-steps", str(STEPS),
    "--nve-steps", str(STEPS),
    "--thermo-every", "1",
    "--traj-every", "2",
    "--checkpoint-every", str(STEPS),
    "--compare", "none",
    "--watchdog", "120",
]  # fmt: skip
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for name in ("OMP_NUM_THREADS", "NVDD_RUN_ARGV", "MASTER_ADDR", "MASTER_PORT", *_LAUNCHER_VARS):
        env.pop(name, None)  # the per-node thread default is under test
    return env


def _agent(node: int, port: int, report: Path, out: Path, cwd: Path) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "it-nodes",
        str(HERE / "it_node_job.py"), str(report), *RUN, "--out", str(out),
    ]  # fmt: skip


def _launch_two_nodes(tmp: Path) -> tuple[list[dict[str, object]], Path]:
    port, report, out = _free_port(), tmp / "report", tmp / "out"
    report.mkdir()
    procs, logs = [], []
    try:
        for node in (0, 1):
            cwd = tmp / f"node{node}"
            cwd.mkdir()
            log = open(cwd / "agent.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    _agent(node, port, report, out, cwd),
                    cwd=cwd,
                    env=_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            time.sleep(0.5)  # node 0 first: it hosts the rendezvous store
        deadline = time.monotonic() + 300
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    text = "\n".join((tmp / f"node{n}" / "agent.log").read_text()[-3000:] for n in (0, 1))
    assert [p.returncode for p in procs] == [0, 0], text
    workers = [json.loads((report / f"worker-{r}.json").read_text()) for r in (0, 1)]
    return workers, out


def _reference() -> object:
    """The same job on one process: Langevin NVT, then NVE, from the same box."""
    args = build_parser().parse_args(RUN)
    dtype = torch.float64
    model = build_model(args, torch.device("cpu"), dtype)
    start = argon_box(args.cells, dtype=dtype, temperature_K=args.temperature, seed=args.seed)
    nvt = Langevin(
        model,
        start,
        dt_fs=args.dt,
        temperature_K=args.temperature,
        friction_per_fs=args.friction,
        seed=args.seed,
    )
    nvt.run(STEPS)
    nve = VelocityVerlet(model, nvt.batch, dt_fs=args.dt)
    nve.run(STEPS)
    return nve.batch


@pytest.mark.gloo
def test_two_torchrun_nodes_run_nvdd_as_one_job(tmp_path: Path) -> None:
    workers, out = _launch_two_nodes(tmp_path)
    # ranks: global 0 and 1, each the only (local 0) rank of its node
    assert sorted(int(str(w["RANK"])) for w in workers) == [0, 1]
    for w in workers:
        assert (w["LOCAL_RANK"], w["LOCAL_WORLD_SIZE"], w["WORLD_SIZE"]) == ("0", "1", "2"), w
        assert w["GROUP_RANK"] == w["RANK"], w  # one rank per node: node rank = global rank
        assert w["OMP_NUM_THREADS"] is None and w["rc"] == 0, w
        # threads from the node's ranks (LOCAL_WORLD_SIZE 1), not the job's (2)
        assert w["threads"] == cpu_threads_per_rank(1), w
    # outputs written once, by global rank 0
    thermo = (out / "thermo.csv").read_text().splitlines()
    assert sum(line.startswith("step") for line in thermo) == 1, thermo
    steps = [float(line.split(",")[0]) for line in thermo[1:]]
    assert len(steps) >= 2 * STEPS - 1 and len(set(steps)) == len(steps), thermo
    frames = re.findall(r"step=(\d+)", (out / "trajectory.extxyz").read_text())
    assert frames and len(set(frames)) == len(frames), frames
    assert not list(tmp_path.glob("node*/out")) and not list(tmp_path.glob("node*/runs"))
    # the run equals one process, by atom id (the checkpoint of the last step)
    got, manifest = read_checkpoint(out / "checkpoint")
    assert manifest["world_size"] == 2 and manifest["metadata"]["step"] == 2 * STEPS
    ref = _reference()
    assert_close_by_id(
        got.atom_ids, got.forces, ref.atom_ids, ref.forces, atol=1e-10, what="forces"
    )  # type: ignore[attr-defined]
    cell = ref.cell[0]  # type: ignore[attr-defined]
    by_id = ref.sort_by_id()  # type: ignore[attr-defined]
    frac = torch.linalg.solve(cell.T, (got.positions - by_id.positions).T).T
    assert float(((frac - torch.round(frac)) @ cell).abs().max()) < 1e-10


# ----------------------------------------------------------- the Slurm script
def test_the_slurm_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


def _docs_command() -> list[str]:
    """The command docs/multinode.md says the script runs on every node."""
    text = (ROOT / "docs" / "multinode.md").read_text()
    m = re.search(r"<!-- slurm-command -->\s*```bash\n(.*?)```", text, re.S)
    assert m, "docs/multinode.md lost its <!-- slurm-command --> block"
    return shlex.split(m.group(1).replace("\\\n", " "), comments=True)


@pytest.mark.parametrize(
    ("argv", "target"),
    [
        ([], ["-m", "nvalchemi.distributed.cli", "run", "--device", "cuda"]),
        (
            ["nvdd", "run", "--cells", "40"],
            ["-m", "nvalchemi.distributed.cli", "run", "--cells", "40"],
        ),
        (["md.py", "--steps", "10"], ["md.py", "--steps", "10"]),
    ],
    ids=["default", "nvdd-run", "script"],
)
def test_the_slurm_script_builds_the_documented_torchrun(
    argv: list[str], target: list[str], tmp_path: Path
) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    scontrol = fake / "scontrol"  # Slurm's hostlist expansion, faked
    scontrol.write_text('#!/bin/sh\nprintf "gpu-a17\\ngpu-a18\\ngpu-a19\\n"\n')
    scontrol.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{fake}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_NUM_NODES="3",
        SLURM_JOB_NODELIST="gpu-a[17-19]",
        SLURM_GPUS_ON_NODE="4",
        SLURM_JOB_ID="4711",
        NVDD_DRY_RUN="1",
    )
    res = subprocess.run(
        ["bash", str(SBATCH), *argv], env=env, capture_output=True, text=True, check=True
    )
    built = shlex.split(res.stdout.strip().splitlines()[-1])
    values = {
        "SLURM_JOB_NUM_NODES": "3",
        "GPUS_PER_NODE": "4",
        "HEAD_NODE": "gpu-a17",
        "SLURM_JOB_ID": "4711",
    }
    documented = []
    for word in _docs_command():
        for name, value in values.items():
            word = word.replace(f"${{{name}}}", value).replace(f"${name}", value)
        documented.append(word)
    cut = documented.index("...") if "..." in documented else len(documented)
    assert built[:cut] == documented[:cut], (built, documented)
    assert built[cut:] == target
