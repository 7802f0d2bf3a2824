"""The ``nvdd`` command line.

``nvdd run``: a domain-decomposed MD run of a built-in argon box (Lennard-Jones;
Langevin NVT equilibration, then NVE) or of any structure ``ase.io.read`` reads.
It launches N ranks with torch's own launcher (``torch.distributed.run``): CPU
ranks over gloo by default, one rank per GPU over NCCL with ``--device cuda``.
Under an existing torchrun environment it runs as one of its ranks instead.

Every argument and the structure file are checked before any rank starts: a bad
one gets one line on stderr and exit status 2. SIGTERM or SIGINT to ``nvdd`` is
forwarded to torchrun (which stops its workers; the job ends with one line and
status 128 + signal); whatever is still running after a grace period is killed.
torchrun and the ranks end when ``nvdd`` dies, however it dies
(:mod:`nvalchemi.distributed._stop`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any, NoReturn

from nvalchemi.distributed.__about__ import __version__

__all__ = ["build_parser", "console", "main"]

#: Seconds torchrun gets to stop its workers after a forwarded signal.
STOP_GRACE_S = 40.0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``nvdd`` (``run`` and its options, in groups)."""
    p = argparse.ArgumentParser(prog="nvdd", description=__doc__.splitlines()[0])
    p.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__} (nvalchemi-distributed)"
    )
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="domain-decomposed MD on a built-in argon box or a structure file",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ranks = run.add_argument_group("ranks and decomposition")
    ranks.add_argument("--nproc", type=int, default=2, help="ranks to launch (CPU) or GPUs to use")
    ranks.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: ranks over gloo; cuda: one rank per GPU over NCCL",
    )
    ranks.add_argument(
        "--grid",
        type=int,
        nargs=3,
        default=None,
        metavar=("PX", "PY", "PZ"),
        help="rank grid (default: the smallest halo for the cell)",
    )
    ranks.add_argument(
        "--strategy",
        choices=("halo", "graph-partition"),
        default="halo",
        help="halo: spatial boxes with ghost atoms, atoms migrate; graph-partition: fixed "
        "blocks of atoms by index, the model builds its own neighbour list (lj, mace, mpnn; "
        "not with --grid, --load-balance or Ewald / PME / D3)",
    )
    ranks.add_argument("--load-balance", action="store_true", help="cut boxes at atom quantiles")
    ranks.add_argument("--skin", type=float, default=1.0, help="Verlet skin, Angstrom")

    system = run.add_argument_group("system and model")
    system.add_argument(
        "--cells",
        type=int,
        default=20,
        help="FCC unit cells per edge of the argon box (4 atoms each: 20 -> 32000)",
    )
    system.add_argument(
        "--structure",
        default=None,
        help="read the system with ase.io.read instead of building argon",
    )
    system.add_argument(
        "--model",
        choices=("lj", "mace", "sevenn", "uma", "aimnet2"),
        default="lj",
        help="lj: Lennard-Jones (argon built in, --lj for other elements); mace: a mace-torch "
        "MACE (--model-file, or a built-in small random one on an O/Si box of --cells**3 atoms); "
        "sevenn: a SevenNet (--model-file, or a built-in small random one on the same box; "
        "the nvdd-models[sevenn] extra); uma: a fairchem UMA (--model-file, or a built-in small "
        "random one on the same box; the nvdd-models[uma] extra); aimnet2: an AIMNet2 "
        "(--model-file, or a built-in small random one on the same box; the "
        "nvdd-models[aimnet2] extra)",
    )
    system.add_argument(
        "--model-file",
        default=None,
        help="--model mace: a saved mace-torch model (.model); --model sevenn: a SevenNet "
        "checkpoint (.pth); --model uma: a fairchem inference checkpoint (.pt); all unpickled: "
        "trusted files only; --model aimnet2: an aimnet v2 model file (.pt, read by aimnet's "
        "load_model: restricted torch.load)",
    )
    system.add_argument(
        "--task",
        default=None,
        help="--model uma: the fairchem task (dataset) to predict for, e.g. omat, omol, oc20 "
        "(default: the checkpoint's only energy task)",
    )
    system.add_argument(
        "--uma-checkpoint",
        default=None,
        metavar="on|off|EDGES",
        help="--model uma: fairchem's activation checkpointing (on, the default: its chunk of "
        "edges, activations recomputed for less memory; off: every activation kept; a positive "
        "number: edges per chunk). The same numbers either way, up to the order of per-chunk sums",
    )
    system.add_argument("--cutoff", type=float, default=8.5, help="LJ cutoff, Angstrom")
    system.add_argument(
        "--lj",
        action="append",
        default=None,
        metavar="EL:EPS:SIGMA",
        help="Lennard-Jones epsilon (eV) and sigma (A) of an element, e.g. Cu:0.415:2.28; "
        "repeat per element (argon is built in); every element of --structure needs one",
    )
    system.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float64",
        help="floating-point precision of positions, forces and the model",
    )

    dyn = run.add_argument_group("dynamics")
    system.add_argument(
        "--run-file",
        default=None,
        help="TOML run file: a system and a (composed) model, e.g. LJ + Ewald on NaCl "
        "(see nvalchemi.distributed._runfile); replaces the argon box and LJ",
    )
    dyn.add_argument(
        "--ensemble",
        choices=("langevin", "nvt-nh", "npt"),
        default="langevin",
        help="the first phase: Langevin NVT, Nose-Hoover chain NVT or MTK NPT",
    )
    dyn.add_argument("--pressure", type=float, default=1.0, help="NPT target pressure, bar")
    dyn.add_argument("--tau-t", type=float, default=100.0, help="Nose-Hoover time scale, fs")
    dyn.add_argument("--tau-p", type=float, default=1000.0, help="NPT barostat time scale, fs")
    dyn.add_argument(
        "--cell-dof",
        choices=("isotropic", "full"),
        default="isotropic",
        help="NPT cell freedom: one strain rate, or every axis and shear",
    )
    dyn.add_argument(
        "--nvt-steps", type=int, default=100, help="steps of the first phase (--ensemble)"
    )
    dyn.add_argument("--nve-steps", type=int, default=100, help="velocity-Verlet steps after it")
    dyn.add_argument("--dt", type=float, default=4.0, help="time step, fs")
    dyn.add_argument("--temperature", type=float, default=94.0, help="NVT temperature, K")
    dyn.add_argument("--friction", type=float, default=0.02, help="Langevin friction, 1/fs")
    dyn.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed of the initial velocities and of the Langevin noise",
    )

    out = run.add_argument_group("outputs")
    out.add_argument(
        "--out",
        default="runs/nvdd-run",
        help="output directory (relative to the current directory): new or empty, or "
        "the run directory of --restart",
    )
    out.add_argument(
        "--overwrite",
        action="store_true",
        help="delete a non-empty --out (an earlier run's outputs) before launch",
    )
    out.add_argument(
        "--verbose",
        action="store_true",
        help="also show Warp's banner and module-load lines and every rank's warnings "
        "(as NVDD_VERBOSE=1 does)",
    )
    out.add_argument("--thermo-every", type=int, default=10, help="thermo table period, steps")
    out.add_argument(
        "--traj-every", type=int, default=50, help="extxyz frame period, steps (0: no trajectory)"
    )
    out.add_argument(
        "--compare",
        choices=("forces", "trajectory", "none"),
        default="forces",
        help="at the end, compare with a 1-rank run: the final forces, or the "
        "whole trajectory (small systems)",
    )

    robust = run.add_argument_group("checkpoints and faults")
    robust.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="write OUT/checkpoint/ every N steps (0: never)",
    )
    robust.add_argument(
        "--restart",
        default=None,
        metavar="DIR",
        help="continue from a checkpoint directory (OUT/checkpoint; any number of ranks): "
        "the system options must be the checkpoint's, the dynamics options are this run's",
    )
    robust.add_argument(
        "--watchdog",
        type=float,
        default=120.0,
        help="seconds without progress before the silent rank is named and the job ends (0: off)",
    )
    return p


_ARGS_ENV = "NVDD_RUN_ARGV"


def _under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv: Sequence[str] | None = None) -> int:
    """The ``nvdd`` command; returns its exit status.

    A script that is itself one rank of an outside launcher's job may call it and
    go on; the command line (:func:`console`) exits with the status.
    """
    if argv is None and _ARGS_ENV in os.environ and _under_launcher():
        # Started by our own launch below: the arguments travel in the environment,
        # so torch.distributed.run's parser never sees (and mistakes) them.
        argv = json.loads(os.environ[_ARGS_ENV])
    args = build_parser().parse_args(argv)
    if args.command != "run":  # pragma: no cover - argparse enforces the choice
        return 2
    world = os.environ.get("WORLD_SIZE", "")
    if _under_launcher() and world.isdigit():  # a rank of a job: its size is the launcher's
        args.nproc = int(world)
    if args.verbose:  # the ranks inherit it
        os.environ["NVDD_VERBOSE"] = "1"
    ours = _ARGS_ENV in os.environ  # started by our launcher: already checked there
    if not (ours and _under_launcher()):
        from nvalchemi.distributed._checks import validate

        problems = validate(args)
        for line in problems:
            print(f"nvdd run: error: {line}", file=sys.stderr)
        if problems:
            return 2
        from nvalchemi.distributed._checks import restart_notes

        for line in restart_notes(args):
            print(f"nvdd run: note: {line}", file=sys.stderr)
        if args.overwrite and os.environ.get("RANK", "0") == "0":
            from nvalchemi.distributed._outputs import remove_outputs

            try:
                remove_outputs(args.out)
            except OSError as exc:
                print(
                    f"nvdd run: error: --out {args.out}: cannot delete it ({exc})", file=sys.stderr
                )
                return 2
    if _under_launcher():
        from nvalchemi.distributed._demo import run_rank

        return run_rank(args)
    env = dict(os.environ)
    env[_ARGS_ENV] = json.dumps(list(argv if argv is not None else sys.argv[1:]))
    if args.device == "cpu" and not env.get("OMP_NUM_THREADS"):
        from nvdd.core import cpu_threads_per_rank

        env["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(args.nproc))
    cmd = [
        sys.executable,
        "-m",
        "nvalchemi.distributed._stop",  # torchrun, tied to this process (see _stop.py)
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "-m",
        "nvalchemi.distributed.cli",
    ]
    return launch(cmd, env)


def _stat(pid: int | str) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def _descendants(pid: int) -> list[tuple[int, int]]:
    """``(pid, start time)`` of every live descendant of ``pid`` (empty without /proc)."""
    children: dict[int, list[tuple[int, int]]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:  # pragma: no cover - not Linux
        return []
    for entry in entries:
        st = _stat(entry) if entry.isdigit() else None
        if st is not None:
            children.setdefault(st[0], []).append((int(entry), st[1]))
    out: list[tuple[int, int]] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def launch(cmd: list[str], env: dict[str, Any], grace_s: float = STOP_GRACE_S) -> int:
    """Run the launcher ``cmd``, tied to this process; forward SIGTERM / SIGINT to it.

    ``cmd`` starts in its own session and gets SIGTERM when this process dies,
    however it dies (Linux ``PR_SET_PDEATHSIG``). A forwarded signal is first
    written to the file ``$NVDD_STOP_NOTE`` names, so ranks tell a user's stop
    from the end of a job after a failure.

    After a forwarded signal torchrun stops its workers (SIGTERM, then SIGKILL
    after its own timeout); if anything of the job still runs ``grace_s``
    seconds later, it is killed. Returns torchrun's exit status, or
    ``128 + signal`` when stopped by a signal.
    """
    from nvalchemi.distributed._stop import (
        PARENT_ENV,
        STOP_NOTE_ENV,
        die_with_parent,
        write_stop_note,
    )

    me = os.getpid()
    note = os.path.join(tempfile.gettempdir(), f"nvdd-stop-{me}-{time.monotonic_ns()}")
    env = {**env, PARENT_ENV: str(me), STOP_NOTE_ENV: note}

    def tie_to_me() -> None:  # in the child, before exec: SIGTERM when this process dies
        if not die_with_parent(me):
            os._exit(128 + signal.SIGTERM)

    # Its own session: a Ctrl-C reaches this process only, which passes it on once.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=tie_to_me)
    stop: dict[str, Any] = {}

    def forward(signum: int, frame: FrameType | None) -> None:
        if "signum" not in stop:
            stop["signum"], stop["at"] = signum, time.monotonic()
            stop["family"] = _descendants(proc.pid)
            write_stop_note(note, signum)  # before the signal: the ranks read it
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if "at" in stop and time.monotonic() - stop["at"] > grace_s:
                    _kill_all([*_descendants(proc.pid), *stop["family"]])
                    proc.kill()
                    proc.wait()
                    rc = 128 + int(stop["signum"])
                    break
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        with contextlib.suppress(OSError):
            os.unlink(note)
    if "signum" in stop:
        _kill_all(stop["family"])  # workers torchrun left behind, if any
        return 128 + int(stop["signum"])
    return rc


def _kill_all(procs: list[tuple[int, int]]) -> None:
    """SIGKILL each ``(pid, start time)`` that is still that same process."""
    for pid, started in procs:
        st = _stat(pid)
        if st is None or st[1] != started:
            continue  # gone, or the pid now belongs to another process
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def console() -> NoReturn:
    """The ``nvdd`` console script and ``python -m nvalchemi.distributed.cli``:
    :func:`main`, then exit with its status.

    A rank of a job (started by a launcher: ``RANK`` and ``WORLD_SIZE`` set)
    that returns ends through
    :func:`~nvalchemi.distributed._stop.end_finished_rank`: exit handlers,
    flushed streams, then ``os._exit``, without the interpreter's finalisation,
    where a daemon thread caught inside a native call would abort a rank whose
    job finished (record 0091). A rank that raises exits as usual.
    """
    status = main()
    if _under_launcher():
        from nvalchemi.distributed._stop import end_finished_rank

        end_finished_rank(status)
    raise SystemExit(status)


if __name__ == "__main__":
    console()
