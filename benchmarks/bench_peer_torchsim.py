"""Benchmark: MACE on one GPU, nvdd against the peer torch-sim, steady state (issue 37 item 3).

One run, every leg in its own process (so peak memory and out-of-memory are per leg),
the same system, model weights, initial velocities and time step in each:

- ``plain``: nvdd's ``VelocityVerlet`` with ``MACEModel``, one process, no DD wrapper;
- ``dd1``: the same under ``DomainParallel`` on one GPU;
- ``peer``: torch-sim's (``torch-sim-atomistic``) NVE velocity-Verlet loop
  (``nve_init`` once, then ``nve_step`` per step: the inner loop of
  ``torch_sim.integrate`` without a trajectory reporter) with torch-sim's MACE
  wrapper (``torch_sim.models.mace.MaceModel``, forces only, no stress) and its
  default neighbour list (``torchsim_nl``: nvalchemiops' O(N^2) list when installed);
- ``peer-cell``: the same with nvalchemiops' cell list (``alchemiops_nl_cell_list``),
  what a torch-sim user picks for large systems.

The system and model are those of ``bench_mace.py``: silica-like O/Si at the density
of amorphous SiO2, 300 K velocities from one seed, mace-torch's ScaleShiftMACE with
random weights from one seed (``--size medium``: the public "medium" shape), 0.5 fs.

Two phases:

1. timed: every leg at ``--cells``^3 atoms (default 24^3 = 13,824), ``--warmup``
   steps, then ``--steps`` (>= 50) steps timed between two device synchronisations;
   ms/step and peak memory (``torch.cuda.max_memory_allocated``).
2. largest system: ``dd1`` and ``peer-cell`` (``--search-legs``) double the system
   (one axis at a time) from the timed size, a few steps each, until out of memory
   (caught, reported as a row), ``--doublings``, or ``--search-budget-s`` seconds per
   leg, whichever comes first.

The targets of issue 37 are printed at the end (DomainParallel on one GPU <= 1.1x
the faster peer leg's ms/step; its largest system >= the peer's) and a result file
``<out-dir>/<name>.json`` is written in the schema of ``benchmarks/render.py``.

torch-sim-atomistic needs Python >= 3.12; it is imported lazily, in the peer legs
only, and a missing install is reported as a row (``status: missing``), never a crash.

Usage::

    # one GPU (the lead's run; about 5 minutes on an H100)
    python benchmarks/bench_peer_torchsim.py --device cuda --out-dir $OUT
    # CPU check of every leg (tiny model, 64 to 128 atoms, seconds per leg)
    python benchmarks/bench_peer_torchsim.py --device cpu --quick --out-dir /tmp/tsim
    # MACE's trainable weights of before record 0089 (its peak memory per atom)
    python benchmarks/bench_peer_torchsim.py --device cuda --legs plain dd1 --search-legs dd1 \
        --mace-freeze off --name mace-1gpu-trainable --out-dir $OUT

This is not a test; ratios measured within one run are the result.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import harness
from benchmarks.bench_mace import SIZES, _is_oom, _peak_mb, _sync, build, dims_of, prepare, silica
from benchmarks.bench_mace import measure as measure_nvdd

NVDD_LEGS = ("plain", "dd1")
PEER_LEGS = ("peer", "peer-cell")
DT_FS = 0.5
MISSING = (
    "torch-sim-atomistic is not importable (it needs Python >= 3.12): "
    "pip install torch-sim-atomistic==0.6.2 (offline: the wheels of .whl/c)"
)


def peer_available() -> str | None:
    """None when torch-sim imports; else why not (one line)."""
    try:
        import torch_sim  # noqa: F401
    except Exception as exc:  # ImportError, or SyntaxError on Python < 3.12
        return f"{MISSING} [{type(exc).__name__}: {exc}]"
    return None


def measure_peer(
    leg: str,
    mace: torch.nn.Module,
    dims: tuple[int, int, int],
    dtype_name: str,
    cueq: bool,
    steps: int,
    warmup: int,
    device: str,
    memory_limit_mb: int = 0,
) -> dict[str, Any]:
    """One measurement of torch-sim's NVE loop with its MACE wrapper (one process)."""
    device = prepare(device, memory_limit_mb)
    from torch_sim.models.mace import MaceModel
    from torch_sim.neighbors import alchemiops_nl_cell_list, torchsim_nl

    dtype = getattr(torch, dtype_name)
    nl = alchemiops_nl_cell_list if leg == "peer-cell" else torchsim_nl
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MaceModel(
            mace,
            device=torch.device(device),
            dtype=dtype,
            neighbor_list_fn=nl,
            compute_forces=True,
            compute_stress=False,
            enable_cueq=cueq,
        )
    # the same positions and velocities as nvdd's legs
    return {**run_torchsim(model, silica(dims, dtype, device), steps, warmup), "cueq": cueq}


def run_torchsim(model: Any, batch: Any, steps: int, warmup: int) -> dict[str, Any]:
    """``warmup`` then ``steps`` timed steps of torch-sim's NVE loop (``nve_init`` with
    ``batch``'s velocities, then ``nve_step``, 0.5 fs) with the torch-sim ``model`` on
    ``batch`` (an nvdd Batch: one periodic system)."""
    import torch_sim as ts

    dtype, device = batch.positions.dtype, str(batch.positions.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = ts.SimState(
            positions=batch.positions.clone(),
            masses=batch.masses.clone(),
            cell=batch.cell.reshape(1, 3, 3).mT.contiguous(),  # torch-sim: columns
            pbc=bool(batch.pbc.all()),
            atomic_numbers=batch.atomic_numbers.to(torch.long),
        )
        md = ts.nve_init(state, model, kT=0.0)
        md.momenta = batch.masses[:, None] * batch.velocities
        dt = torch.as_tensor(DT_FS * 1e-3 * ts.units.MetalUnits.time, dtype=dtype, device=device)

        def run(n: int) -> None:
            nonlocal md
            for _ in range(n):
                md = ts.nve_step(md, model, dt=dt)

        run(warmup)
        _sync(device)
        t0 = time.perf_counter()
        run(steps)
        _sync(device)
        elapsed = time.perf_counter() - t0
    return {
        "atoms": batch.n_atoms,
        "ms_per_step": 1000.0 * elapsed / steps,
        "peak_mb": [_peak_mb(device)],
        "ke_end": float(0.5 * (md.momenta**2 / md.masses[:, None]).sum()),
    }


def one(args: argparse.Namespace, leg: str, mace: Any, cells_k: int, phase: str) -> dict[str, Any]:
    """One leg at one size, in a fresh process; failures become the row's status."""
    dims = dims_of(args.cells, cells_k)
    steps, warmup = (
        (args.steps, args.warmup) if phase == "timed" else (args.search_steps, args.search_warmup)
    )
    if leg in PEER_LEGS:
        fn: Any = measure_peer
        fargs: tuple[Any, ...] = (leg, mace, dims, args.dtype, args.cueq, steps, warmup)
        fargs += (args.device, args.memory_limit_mb)
    else:
        fn = measure_nvdd
        fargs = (leg, mace, dims, args.dtype, args.cueq, steps, warmup, args.device, args.skin)
        fargs += (args.memory_limit_mb, args.mace_freeze == "on")
    return run_leg(args, leg, phase, dims[0] * dims[1] * dims[2], steps, warmup, fn, fargs)


def run_leg(
    args: argparse.Namespace,
    leg: str,
    phase: str,
    atoms: int,
    steps: int,
    warmup: int,
    fn: Any,
    fargs: tuple[Any, ...],
) -> dict[str, Any]:
    """``fn(*fargs)`` in a fresh process (a world of one: nccl on cuda, else gloo), as a
    result row; a peer leg without torch-sim, a failure, an out-of-memory or a timeout
    become the row's ``status`` (and ``error``)."""
    from nvdd.core import RankFailedError, RankTimeoutError, spawn_ranks

    row: dict[str, Any] = {
        "leg": leg,
        "phase": phase,
        "dtype": args.dtype,
        "atoms": atoms,
        "steps": steps,
        "warmup": warmup,
    }
    if leg in PEER_LEGS and args.peer_missing:
        row.update(status="missing", error=args.peer_missing)
        _print_row(row)
        return row
    threads = 1 if args.device == "cpu" else max(1, os.cpu_count() or 1)
    t0 = time.perf_counter()
    try:
        res = spawn_ranks(
            fn,
            1,
            *fargs,
            backend="nccl" if args.device == "cuda" else "gloo",
            timeout_s=args.timeout,
            threads_per_rank=threads,
            start_method="spawn",
        )[0]
        res.pop("ghosts", None)
        row.update(res, status="ok")
    except RankFailedError as exc:
        row.update(status="OOM" if _is_oom(str(exc)) else "error")
        row["error"] = str(exc).strip().splitlines()[-1]
    except RankTimeoutError as exc:
        row.update(status="timeout", error=str(exc).strip().splitlines()[-1])
    except Exception as exc:  # (the run goes on: the row says what failed)
        row.update(status="error", error=f"{type(exc).__name__}: {exc}".splitlines()[0])
    row["wall_s"] = time.perf_counter() - t0
    _print_row(row)
    return row


def search(args: argparse.Namespace, rows: list[dict[str, Any]], measure: Any) -> None:
    """The largest-system phase: each of ``args.search_legs`` doubles the timed size
    (``measure(leg, k)``: the row at ``k`` doublings) until a failure, ``--doublings``,
    ``--max-atoms`` or ``--search-budget-s``; rows are appended to ``rows``."""
    for leg in args.search_legs:
        first = next((r for r in rows if r["leg"] == leg), None)
        if first is not None and first["status"] != "ok":
            continue  # the timed size already failed: nothing larger fits
        spent = 0.0
        for k in range(1 if first else 0, args.doublings + 1):
            d = dims_of(args.cells, k)
            if d[0] * d[1] * d[2] > args.max_atoms or spent > args.search_budget_s:
                break
            row = measure(leg, k)
            rows.append(row)
            spent += row.get("wall_s", 0.0)  # (none: a peer leg without torch-sim)
            if row["status"] != "ok":
                break


def _print_row(r: dict[str, Any]) -> None:
    ms = f"{r['ms_per_step']:10.1f}" if "ms_per_step" in r else f"{'-':>10}"
    peak = f"{max(r['peak_mb']):12.0f}" if "peak_mb" in r else f"{'-':>12}"
    extra = f"  {r.get('error', '')}" if r["status"] != "ok" else ""
    print(
        f"{r['phase']:<7}{r['leg']:<10}{r['atoms']:>10}{r['steps']:>6}{ms}{peak}"
        f"  {r['status']}{extra}",
        flush=True,
    )


def targets(rows: list[dict[str, Any]], search_legs: list[str]) -> dict[str, Any]:
    """Issue 37's targets from the rows (None where a leg has no number); largest
    systems of the ``search_legs``."""
    timed = {r["leg"]: r for r in rows if r["phase"] == "timed" and r["status"] == "ok"}
    peers = [timed[leg] for leg in PEER_LEGS if leg in timed]
    best_peer = min(peers, key=lambda r: r["ms_per_step"]) if peers else None
    dd = timed.get("dd1")
    out: dict[str, Any] = {"peer_leg": best_peer["leg"] if best_peer else None}
    out["dd1_over_peer"] = (
        dd["ms_per_step"] / best_peer["ms_per_step"] if dd and best_peer else None
    )
    largest: dict[str, int] = {}
    bound: dict[str, str] = {}
    for leg in search_legs:
        ran = [r["atoms"] for r in rows if r["leg"] == leg and r["status"] == "ok"]
        if ran:
            largest[leg] = max(ran)
        failed = [r for r in rows if r["leg"] == leg and r["status"] not in ("ok", "missing")]
        bound[leg] = f"{failed[0]['status']} at {failed[0]['atoms']}" if failed else "not reached"
    out["largest"] = largest
    out["next_size"] = bound
    peer_big = max((largest.get(leg, 0) for leg in PEER_LEGS), default=0)
    out["dd1_largest_over_peer"] = (
        largest["dd1"] / peer_big if largest.get("dd1") and peer_big else None
    )
    return out


def _report(t: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print()
    ke = {r["leg"]: r["ke_end"] for r in rows if r["phase"] == "timed" and "ke_end" in r}
    if len(ke) > 1:  # the same start, dt and step count: the same trajectory
        spread = (max(ke.values()) - min(ke.values())) / max(abs(v) for v in ke.values())
        legs = ", ".join(f"{leg} {v:.6g}" for leg, v in ke.items())
        print(f"  kinetic energy (eV) after the timed steps: {legs}; relative spread {spread:.1e}")
    for leg, n in sorted(t["largest"].items()):
        print(f"  largest system, {leg}: {n} atoms (next size: {t['next_size'][leg]})")
    r = t["dd1_over_peer"]
    if r is not None:
        ok = "met" if r <= 1.1 else "NOT met"
        print(f"  DomainParallel 1 GPU / {t['peer_leg']}: {r:.3f}x step time (target <= 1.1: {ok})")
    r = t["dd1_largest_over_peer"]
    if r is not None:
        ok = "met" if r >= 1.0 else "NOT met"
        print(f"  DomainParallel 1 GPU / peer, largest system: {r:.2f}x (target >= 1: {ok})")


def add_run_options(
    p: argparse.ArgumentParser, legs: list[str], search_legs: list[str], cells: int, name: str
) -> None:
    """The options of a peer benchmark's run: the legs, size, device, dtype, timed
    steps, the largest-system search's bounds, per-measurement timeout, the result."""
    p.add_argument("--cells", type=int, default=cells, help="lattice repeats per axis (timed size)")
    p.add_argument("--legs", nargs="+", default=legs)
    p.add_argument("--search-legs", nargs="*", default=search_legs)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--steps", type=int, default=50, help="timed steps (>= 50 for the issue)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--skin", type=float, default=0.5, help="nvdd's Verlet skin (A)")
    p.add_argument("--doublings", type=int, default=4, help="largest-system search: at most")
    p.add_argument("--search-steps", type=int, default=3)
    p.add_argument("--search-warmup", type=int, default=1)
    p.add_argument("--search-budget-s", type=float, default=100.0, help="per search leg")
    p.add_argument("--max-atoms", type=int, default=1 << 24)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    p.add_argument("--memory-limit-mb", type=int, default=0, help="CPU: cap each leg's heap")
    p.add_argument("--quick", action="store_true", help="CPU check: tiny model and system")
    p.add_argument("--name", default=name, help="result file name")
    p.add_argument("--out-dir", type=Path, default=harness.RESULTS)


def parse_run(
    p: argparse.ArgumentParser, argv: list[str] | None, legs: tuple[str, ...], quick_cells: int
) -> argparse.Namespace:
    """Parsed options (``--quick``: tiny model, ``quick_cells`` per axis, 3 steps after 1,
    one doubling), the legs checked against ``legs``, ``peer_missing`` set (printed)."""
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.cells, args.steps, args.warmup = "tiny", quick_cells, 3, 1
        args.doublings, args.search_budget_s = 1, 120.0
    unknown = set(args.legs + args.search_legs) - set(legs)
    if unknown:
        p.error(f"unknown legs {sorted(unknown)}; choose from {legs}")
    args.peer_missing = peer_available()
    if args.peer_missing:
        print(f"peer legs skipped: {args.peer_missing}", flush=True)
    return args


def finish(
    args: argparse.Namespace,
    argv: list[str] | None,
    rows: list[dict[str, Any]],
    what: str,
    dists: list[str],
) -> Path:
    """The targets printed and the result file written (``what`` begins its title;
    the versions of ``dists`` where installed); its path."""
    _report(targets(rows, args.search_legs), rows)
    env = harness.environment()
    for dist in dists:
        with contextlib.suppress(metadata.PackageNotFoundError):
            env["versions"][dist] = metadata.version(dist)
    gpu = env["machine"].get("gpu", args.device)
    return harness.write_result(
        args.name,
        title=f"{what} on one {gpu}: nvdd plain, DomainParallel, torch-sim",
        command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        rows=rows,
        benchmark="benchmarks/" + os.path.basename(sys.argv[0]),
        out_dir=args.out_dir,
        provenance=env,
        note=None if not args.peer_missing else "peer legs missing: torch-sim not importable",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="medium", choices=sorted(SIZES))
    p.add_argument("--cueq", action="store_true", help="cuEquivariance in every leg")
    p.add_argument(
        "--mace-freeze",
        default="on",
        choices=["on", "off"],
        help="MACEModel(freeze=) in the nvdd legs: on freezes the weights as the peer "
        "does; off keeps them trainable, the wrapper's setting before record 0089",
    )
    add_run_options(p, [*NVDD_LEGS, *PEER_LEGS], ["dd1", "peer-cell"], 24, "mace-1gpu-torchsim")
    args = parse_run(p, argv, NVDD_LEGS + PEER_LEGS, 4)
    spec = SIZES[args.size]
    print(
        f"MACE {args.size} ({spec['hidden_irreps']}, r_max {spec['r_max']} A), {args.dtype}, "
        f"cueq {'on' if args.cueq else 'off'}, silica-like O/Si, {args.device}, NVE {DT_FS} fs; "
        f"timed: {args.steps} steps after {args.warmup}"
    )
    print(f"{'phase':<7}{'leg':<10}{'atoms':>10}{'steps':>6}{'ms/step':>10}{'peak MB':>12}  status")
    mace = build(args.size, getattr(torch, args.dtype))
    rows = [one(args, leg, mace, 0, "timed") for leg in args.legs]
    search(args, rows, lambda leg, k: one(args, leg, mace, k, "search"))
    path = finish(args, argv, rows, f"MACE {args.size} {args.dtype}", ["torch-sim-atomistic"])
    print(f"wrote {path}")
    if args.peer_missing and set(args.legs) & set(PEER_LEGS):
        print(f"peer legs NOT measured: {args.peer_missing}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
