"""The ``nvdd`` command line.

``nvdd run``: a domain-decomposed MD run of a built-in argon box (Lennard-Jones;
Langevin NVT equilibration, then NVE) or of any structure ``ase.io.read`` reads.
It launches N ranks with torch's own launcher (``torch.distributed.run``): CPU
ranks over gloo by default, one rank per GPU over NCCL with ``--device cuda``.
Under an existing torchrun environment it runs as one of its ranks instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``nvdd`` (``run`` and its options)."""
    p = argparse.ArgumentParser(prog="nvdd", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="domain-decomposed MD on a built-in argon box or a structure file",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument("--nproc", type=int, default=2, help="ranks to launch (CPU) or GPUs to use")
    run.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: ranks over gloo; cuda: one rank per GPU over NCCL",
    )
    run.add_argument(
        "--cells",
        type=int,
        default=20,
        help="FCC unit cells per edge of the argon box (4 atoms each: 20 -> 32000)",
    )
    run.add_argument(
        "--structure",
        default=None,
        help="read the system with ase.io.read instead of building argon",
    )
    run.add_argument(
        "--model",
        choices=("lj", "mace"),
        default="lj",
        help="lj: argon Lennard-Jones; mace: a mace-torch MACE (--model-file, or a built-in "
        "small random one on an O/Si box of --cells**3 atoms)",
    )
    run.add_argument(
        "--model-file",
        default=None,
        help="a saved mace-torch model (.model; unpickled: trusted files only)",
    )
    run.add_argument("--nvt-steps", type=int, default=100, help="Langevin equilibration steps")
    run.add_argument("--nve-steps", type=int, default=100, help="velocity-Verlet steps after it")
    run.add_argument("--dt", type=float, default=4.0, help="time step, fs")
    run.add_argument("--temperature", type=float, default=94.0, help="NVT temperature, K")
    run.add_argument("--friction", type=float, default=0.02, help="Langevin friction, 1/fs")
    run.add_argument("--cutoff", type=float, default=8.5, help="LJ cutoff, Angstrom")
    run.add_argument("--skin", type=float, default=1.0, help="Verlet skin, Angstrom")
    run.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    run.add_argument(
        "--grid",
        type=int,
        nargs=3,
        default=None,
        metavar=("PX", "PY", "PZ"),
        help="rank grid (default: the smallest halo for the cell)",
    )
    run.add_argument("--load-balance", action="store_true", help="cut boxes at atom quantiles")
    run.add_argument("--thermo-every", type=int, default=10, help="thermo table period, steps")
    run.add_argument(
        "--traj-every", type=int, default=50, help="extxyz frame period, steps (0: no trajectory)"
    )
    run.add_argument(
        "--compare",
        choices=("forces", "trajectory", "none"),
        default="forces",
        help="at the end, compare with a 1-rank run: the final forces, or the "
        "whole trajectory (small systems)",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", default="runs/nvdd-run", help="output directory")
    return p


_ARGS_ENV = "NVDD_RUN_ARGV"


def _under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nvdd`` console script."""
    if argv is None and _ARGS_ENV in os.environ and _under_launcher():
        # Started by our own launch below: the arguments travel in the environment,
        # so torch.distributed.run's parser never sees (and mistakes) them.
        argv = json.loads(os.environ[_ARGS_ENV])
    args = build_parser().parse_args(argv)
    if args.command != "run":  # pragma: no cover - argparse enforces the choice
        return 2
    if args.nproc < 1:
        print(f"nvdd run: --nproc must be >= 1, got {args.nproc}", file=sys.stderr)
        return 2
    from nvalchemi.distributed._model_args import model_args_problem

    problem = model_args_problem(args)
    if problem is not None:
        print(f"nvdd run: {problem}", file=sys.stderr)
        return 2
    if _under_launcher():
        from nvalchemi.distributed._demo import run_rank

        return run_rank(args)
    env = dict(os.environ)
    env[_ARGS_ENV] = json.dumps(list(argv if argv is not None else sys.argv[1:]))
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "-m",
        "nvalchemi.distributed.cli",
    ]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
