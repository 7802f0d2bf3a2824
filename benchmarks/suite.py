"""Named benchmark suites, run by the shared harness.

    python -m benchmarks.suite list
    python -m benchmarks.suite lj-step                     # full sizes (a GPU host)
    python -m benchmarks.suite lj-step --quick             # small CPU sizes (seconds)
    python -m benchmarks.suite lj-step --ab 8ce5cd3        # A/B: that commit against this tree
    python -m benchmarks.suite lj-step --device cuda --out /tmp/res

Each benchmark of a suite is a script of ``benchmarks/`` run in a fresh process
with a JSON output; the suite wraps its rows into a result file (the command,
the commit, the machine and the library versions inside) in ``--out``
(default ``benchmarks/results/``), which ``benchmarks/render.py`` turns into
the benchmarks page.

``--ab COMMIT`` runs every benchmark of the suite in two source trees, in
alternation (base, this tree, base, this tree, ... ``--rounds`` times), in one
call on one machine: the script is this tree's (the same measurement), the
packages on ``PYTHONPATH`` are the base commit's (``git archive``) or this
tree's. Each row says its ``leg`` and ``round``. Compare legs of one file only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = harness.ROOT


@dataclass(frozen=True)
class Bench:
    """One script invocation of a suite: full and ``--quick`` arguments."""

    name: str
    script: str
    args: str
    quick: str
    title: str
    json_flag: str = "--json"
    device_flag: bool = True


@dataclass(frozen=True)
class Suite:
    """A named list of benchmarks."""

    description: str
    benches: tuple[Bench, ...] = field(default_factory=tuple)


_LJ_QUICK = "--cells 4 --steps 5 --warmup 2 --no-peer --dtype float64"

SUITES: dict[str, Suite] = {
    "lj-step": Suite(
        "LJ argon: the raw integrator and DomainParallel on one device against the peer loop,"
        " CUDA graphs on and off",
        (
            Bench(
                "lj-1gpu-graphs",
                "bench_dp.py",
                "--cells 32 63 100 --dtype float32 float64 --graphs on off --steps 200 --warmup 30"
                " --worlds 1",
                f"{_LJ_QUICK} --worlds 1 --graphs on off",
                "LJ argon on one device: nvdd against the peer loop, graphs on and off",
            ),
        ),
    ),
    "lj-scaling": Suite(
        "LJ argon and the reference MPNN on one and two devices (strong scaling)",
        (
            Bench(
                "lj-2gpu-strong",
                "bench_dp.py",
                "--cells 63 100 --dtype float32 float64 --steps 50 --warmup 10 --worlds 1 2",
                f"{_LJ_QUICK} --worlds 1 2",
                "LJ argon on one and two devices: strong scaling",
            ),
            Bench(
                "mpnn-2gpu-strong",
                "bench_dp.py",
                "--model mpnn --cells 29 46 --dtype float32 --steps 20 --warmup 5 --worlds 1 2",
                "--model mpnn --cells 3 --dtype float64 --steps 3 --warmup 1 --worlds 1 2",
                "Reference MPNN on one and two devices: strong scaling",
            ),
        ),
    ),
    "lj-largest": Suite(
        "The largest LJ argon fp32 system one device holds (doubling until out of memory)",
        (
            Bench(
                "lj-1gpu-largest",
                "bench_dp.py",
                "--largest --dtype float32 --start-cells 150",
                "--largest --dtype float32 --start-cells 4 --no-peer",
                "The largest LJ argon fp32 system on one device",
            ),
        ),
    ),
    "neighbors": Suite(
        "Device neighbour-list builds against the peer's cell list",
        (
            Bench(
                "neighbors-row-order",
                "bench_neighbors.py",
                "--cells 32 63 100 --dtype float32 float64 --per-cutoff 1",
                "--cells 3 --dtype float64 --per-cutoff 1",
                "Device neighbour list build: cell order against row order",
            ),
        ),
    ),
    "ensembles": Suite(
        "Integrator step times (NVE, NVT-NH, NPT), captured and eager",
        (
            Bench(
                "ensembles-timing",
                "bench_ensembles.py",
                "timing --cells 10 32 63 --steps 200",
                "timing --cells 3 --steps 5",
                "Integrator step times, LJ argon fp64",
            ),
        ),
    ),
    "mace": Suite(
        "MACE medium: the plain model and DomainParallel, doubling until out of memory",
        (
            Bench(
                "mace-1gpu",
                "bench_mace.py",
                "--modes plain dd1 --start-cells 24 --doublings 6 --steps 5 --warmup 2"
                " --dtypes float32",
                "--modes plain dd1 --start-cells 2 --doublings 0 --steps 1 --warmup 1"
                " --dtypes float64",
                "MACE medium fp32: plain and DomainParallel on one device",
            ),
        ),
    ),
}


def _pythonpath(tree: Path) -> str:
    srcs = [str(p) for p in sorted((tree / "packages").glob("*/src"))]
    return os.pathsep.join([*srcs, str(ROOT), os.environ.get("PYTHONPATH", "")])


def base_tree(commit: str, into: Path) -> Path:
    """The packages of ``commit`` (``git archive``) under ``into``; returns ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "base.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "archive", commit, "packages"], cwd=ROOT, stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    archive.unlink()
    return into


def _rows(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text()) if path.exists() else []
    if isinstance(data, dict):  # {key: {...}} (bench_ensembles): one row per key
        return [{"key": k, **(v if isinstance(v, dict) else {"value": v})} for k, v in data.items()]
    return list(data)


def run_bench(bench: Bench, args: Sequence[str], tree: Path, workdir: Path) -> list[dict[str, Any]]:
    """Run one benchmark script with the packages of ``tree``; its JSON rows."""
    out = workdir / f"{bench.name}.rows.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / bench.script),
        *args,
        bench.json_flag,
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=_pythonpath(tree), PYTHONUNBUFFERED="1")
    print("$", shlex.join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return _rows(out)


def command_line(bench: Bench, args: Sequence[str]) -> str:
    return shlex.join(["python", f"benchmarks/{bench.script}", *args])


def run_suite(
    name: str,
    *,
    quick: bool = False,
    device: str | None = None,
    ab: str | None = None,
    rounds: int = 2,
    out_dir: Path = harness.RESULTS,
) -> list[Path]:
    """Run the suite ``name``; the result files written."""
    suite = SUITES[name]
    written = []
    with tempfile.TemporaryDirectory(prefix="nvdd-bench-") as tmp:
        work = Path(tmp)
        base = base_tree(ab, work / "base") if ab else None
        for bench in suite.benches:
            args = shlex.split(bench.quick if quick else bench.args)
            if device and bench.device_flag:
                args += ["--device", device]
            command = command_line(bench, args)
            provenance = harness.environment()
            if base is None:
                rows = run_bench(bench, args, ROOT, work)
                result, note = bench.name, None
            else:
                rows = []
                for r in range(rounds):
                    for leg, tree in (("base", base), ("new", ROOT)):
                        for row in run_bench(bench, args, tree, work):
                            rows.append({"leg": leg, "round": r, **row})
                result = f"{bench.name}-ab"
                provenance["base_commit"] = ab
                note = (
                    f"A/B in one call: base = {ab}, new = {provenance['commit']}, {rounds} rounds"
                )
                command = (
                    f"python -m benchmarks.suite {name} --ab {ab} --rounds {rounds}  # {command}"
                )
            if quick:
                result += "-quick"
            written.append(
                harness.write_result(
                    result,
                    title=bench.title,
                    command=command,
                    rows=rows,
                    benchmark=bench.script,
                    out_dir=out_dir,
                    provenance=provenance,
                    note=note,
                )
            )
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("suite", help="a suite name, or 'list'")
    p.add_argument("--quick", action="store_true", help="small sizes (a CPU smoke run)")
    p.add_argument("--device", default=None, help="passed to every benchmark (cpu, cuda)")
    p.add_argument("--ab", default=None, metavar="COMMIT", help="alternate with this commit")
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds (each: base, new)")
    p.add_argument("--out", type=Path, default=harness.RESULTS, help="where result files go")
    args = p.parse_args(argv)
    if args.suite == "list":
        for name, suite in SUITES.items():
            benches = ", ".join(b.script for b in suite.benches)
            print(f"{name:12} {suite.description} ({benches})")
        return 0
    if args.suite not in SUITES:
        p.error(f"unknown suite {args.suite!r}; one of: {', '.join(SUITES)}")
    for path in run_suite(
        args.suite,
        quick=args.quick,
        device=args.device,
        ab=args.ab,
        rounds=args.rounds,
        out_dir=args.out,
    ):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
