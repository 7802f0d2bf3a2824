"""Validate the one-GPU scaling prediction against the real P-GPU run.

One command, on a host with P GPUs: for each rank grid, the P-GPU step is
predicted on GPU 0 (``benchmarks/predict_scaling.py``: each rank's real rows run
in turn, exchanges as device copies, a stated communication term) and then
measured: ``DomainParallel`` on P ranks over NCCL (one process per GPU, through
``nvdd.core.spawn_ranks``), the same system, model, dtype, grid (passed as
``DomainConfig.grid_dims``), steps and warm-up. The measured step is what a
run pays: after the warm-up (which includes one forced rebuild, so one-time
kernel loads are not timed), each rank times its ``steps`` steps between a
barrier and its own device synchronisation; the measured step is the maximum
over ranks. Those steps include the halo rebuilds that fall due (counted:
``rebuilds``), which the prediction, a steady step, leaves out
(``benchmarks/halo_rebuilds.py`` measures a rebuild step's cost on one GPU). The per-phase times of both sides come
from a second, shorter run with synchronised phase timers (the runtime's
``DDStats.seconds``) and from the prediction's slowest rank.

    python benchmarks/validate_scaling.py --device cuda --model lj --cells 63 \\
        --dtype float32 --ranks 2 4 8
    python benchmarks/validate_scaling.py --device cuda --model mace --cells 48 \\
        --dtype float32 --ranks 2 4 8 --cueq              # MACE medium, 110k atoms
    python benchmarks/validate_scaling.py --device cpu --cells 4 --ranks 2 \\
        --steps 3 --warmup 1                                # gloo CPU ranks, seconds

The grid of P ranks is 2x1x1, 2x2x1, 2x2x2 for P = 2, 4, 8 (``--grids``
overrides); the ghost layout is the runtime's default (``faces``), or with
``--layout split`` the whole axes left to the model
(``DomainConfig(wrap_whole_axes=True)``, predicted and measured). Rows go to
``benchmarks/results/scaling-validated-MODEL.json`` (``--out``, ``--name``); the
benchmarks page renders them (``benchmarks/render.py``) and the command prints
the same comparison as a table.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import harness
from benchmarks import predict_scaling as ps

#: The grid of P ranks (the runtime's default for a cube splits x, then y, then z).
GRID_OF = {1: "1x1x1", 2: "2x1x1", 4: "2x2x1", 8: "2x2x2", 16: "4x2x2"}
#: Phases both sides time: the prediction's key -> the runtime's ``DDStats.seconds`` key.
PHASES = {"model_ms": "model", "exchange_ms": "exchange", "fold_ms": "fold", "check_ms": "check"}


def measure_rank(
    cells: int,
    dtype_name: str,
    kind: str,
    grid: Sequence[int],
    steps: int,
    warmup: int,
    device: str,
    graphs: bool,
    mace: dict[str, Any] | None = None,
    wrap: bool = False,
) -> dict[str, Any]:
    """One rank of the measured run (called on every rank of the process group):
    its steady ms per step, its phases (ms per step, synchronised timers) and its
    owned and ghost rows. ``mace``: :data:`predict_scaling.MACE` of the caller;
    ``wrap``: ``DomainConfig(wrap_whole_axes=True)`` (the ``split`` layout)."""
    import torch.distributed as dist

    from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet

    rank = dist.get_rank()
    if device.startswith("cuda"):
        device = f"cuda:{torch.cuda.current_device()}"
    dtype = getattr(torch, dtype_name)
    ps.MACE.update(mace or {})
    # rank 0 holds the system; partition() scatters it
    batch = ps.system(kind, cells if rank == 0 else 1, device, dtype)
    model = ps._model(device, dtype, kind)
    if kind == "mace":  # as the prediction runs it
        graphs, dt_fs = False, ps.MACE_DT_FS
    else:
        dt_fs = ps.DT_FS
    dyn = VelocityVerlet(model, batch, dt_fs=dt_fs, cuda_graphs=graphs)
    config = DomainConfig(
        cutoff=float(model.cutoff),
        skin=ps.SKIN,
        grid_dims=(grid[0], grid[1], grid[2]),
        wrap_whole_axes=wrap,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp = DomainParallel(dyn, config)
        with dp:
            dp.partition()
            dp.run(warmup)
            if warmup > 0:  # one rebuild in the warm-up: its one-time costs are not timed
                dp.model.request_rebuild()
                dp.run(1)
            harness.sync(device)
            dist.barrier()
            rebuilds = dp.stats.rebuilds
            t0 = time.perf_counter()
            dp.run(steps)
            harness.sync(device)
            ms = 1000.0 * (time.perf_counter() - t0) / steps
            rebuilds = dp.stats.rebuilds - rebuilds
            dist.barrier()
            dp.model.sync_timings = True
            for k in dp.stats.seconds:
                dp.stats.seconds[k] = 0.0
            n_phase = max(3, min(steps, 20))
            dp.run(n_phase)
            harness.sync(device)
            phases = {k: 1000.0 * v / n_phase for k, v in dp.stats.seconds.items()}
            owned = [int(c) for c in dp.sharded.owned_counts]
            ghost = int(dp.stats.n_ghost)
    return {
        "rank": rank,
        "ms_per_step": ms,
        "rebuilds": rebuilds,
        "phases_ms": phases,
        "owned": owned[rank],
        "owned_all": owned,
        "ghost": ghost,
    }


def compare(predicted: dict[str, Any], measured: list[dict[str, Any]]) -> dict[str, Any]:
    """One result row: the prediction of a grid and its measured counterpart."""
    slow = max(measured, key=lambda r: r["ms_per_step"])
    measured_ms = slow["ms_per_step"]
    phases = {
        ours: {"predicted": predicted["slowest"][ours], "measured": slow["phases_ms"].get(theirs)}
        for ours, theirs in PHASES.items()
    }
    keep = (
        "model", "cells", "dtype", "atoms", "ranks", "grid", "layout", "raw_ms", "comm_ms",
        "exchanges",
    )  # fmt: skip
    return {
        **{k: predicted[k] for k in keep},
        "predicted_ms": predicted["predicted_ms"],
        "measured_ms": measured_ms,
        # halo rebuilds in the measured steps (the same on every rank: one decision)
        "measured_rebuilds": slow["rebuilds"],
        "ratio": measured_ms / predicted["predicted_ms"],
        "predicted_speedup": predicted["speedup"],
        "measured_speedup": predicted["raw_ms"] / measured_ms,
        "phases": phases,
        "predicted_per_rank": [
            {k: r[k] for k in ("owned", "ghost", "total_ms", "step_ms", "folds")}
            for r in predicted["per_rank"]
        ],
        "measured_per_rank": [
            {k: r[k] for k in ("rank", "owned", "ghost", "ms_per_step", "rebuilds", "phases_ms")}
            for r in measured
        ],
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The comparison as printed text: one line per grid, then its phases and rows."""

    def f(x: float | None) -> str:
        return "-" if x is None or not math.isfinite(x) else f"{x:.3f}"

    head = f"{'system':<22}{'grid':>7}{'P':>3}{'predicted ms':>14}{'measured ms':>13}{'ratio':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        system = f"{r['model']} {r['atoms']} {r['dtype']}"
        lines.append(
            f"{system:<22}{r['grid']:>7}{r['ranks']:>3}{f(r['predicted_ms']):>14}"
            f"{f(r['measured_ms']):>13}{f(r['ratio']):>7}"
        )
        lines.append(f"    halo rebuilds in the measured steps: {r['measured_rebuilds']}")
        lines.append(
            "    phases ms (predicted / measured): "
            + ", ".join(
                f"{k.removesuffix('_ms')} {f(v['predicted'])} / {f(v['measured'])}"
                for k, v in r["phases"].items()
            )
        )
        for side in ("predicted", "measured"):
            per = r[f"{side}_per_rank"]
            lines.append(
                f"    owned/ghost per rank, {side}: "
                + " ".join(f"{p['owned']}/{p['ghost']}" for p in per)
            )
    return "\n".join(lines)


def validate(
    cells: int,
    dtype_name: str,
    grids: Sequence[str],
    *,
    kind: str,
    layout: str,
    steps: int,
    warmup: int,
    device: str,
    graphs: bool,
    bandwidth_gbs: float,
    latency_us: float,
    allreduce_us: float,
    timeout_s: float,
) -> list[dict[str, Any]]:
    """Predict every grid on this process's device, then measure each on its ranks."""
    from nvdd.core import spawn_ranks

    tol = 1e-9 if dtype_name == "float64" else 1e-4
    predicted = ps.predict(
        cells,
        dtype_name,
        grids,
        [layout],
        steps=steps,
        warmup=warmup,
        device=device,
        graphs=graphs,
        bandwidth_gbs=bandwidth_gbs,
        latency_us=latency_us,
        allreduce_us=allreduce_us,
        tol=tol,
        kind=kind,
    )
    harness.reset_memory(device)  # free GPU 0 for its rank
    cuda = device.startswith("cuda")
    rows = []
    for p in predicted:
        if p.get("grid") is None:
            continue
        grid = [int(x) for x in p["grid"].split("x")]
        measured = spawn_ranks(
            measure_rank,
            p["ranks"],
            cells,
            dtype_name,
            kind,
            grid,
            steps,
            warmup,
            "cuda" if cuda else device,
            graphs,
            dict(ps.MACE),
            layout == "split",
            backend="nccl" if cuda else "gloo",
            start_method="spawn" if cuda else "forkserver",
            timeout_s=timeout_s,
        )
        rows.append(compare(p, measured))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ps.add_options(p, cells=[63], dtypes=["float32"], name="validated")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--grids", nargs="+", default=None, help="rank grids (default: from --ranks)")
    p.add_argument("--layout", choices=ps.LAYOUTS, default="faces", help="ghost layout predicted")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="collective timeout")
    args = p.parse_args(argv)
    grids = args.grids or [GRID_OF[n] for n in args.ranks]
    ps.MACE.update(size=args.mace_size, cueq=args.cueq)
    if args.device.startswith("cuda"):
        need = max(math.prod(int(x) for x in g.split("x")) for g in grids)
        if torch.cuda.device_count() < need:
            p.error(f"{need} ranks need {need} GPUs, this host has {torch.cuda.device_count()}")
    rows: list[dict[str, Any]] = []
    for cells in args.cells:
        for dt in args.dtype:
            rows += validate(
                cells,
                dt,
                grids,
                kind=args.model,
                layout=args.layout,
                steps=args.steps,
                warmup=args.warmup,
                device=args.device,
                graphs=not args.no_graphs,
                bandwidth_gbs=args.bandwidth_gbs,
                latency_us=args.latency_us,
                allreduce_us=args.allreduce_us,
                timeout_s=args.timeout_s,
            )
    print(table(rows), flush=True)
    command = "python benchmarks/validate_scaling.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    what = {
        "lj": "LJ argon",
        "mpnn": "The reference MPNN on argon",
        "mace": f"MACE ({args.mace_size} shape) on silica",
    }[args.model]
    path = harness.write_result(
        args.name or f"scaling-validated-{args.model}",
        title=f"{what}: the P-GPU step predicted from one GPU and measured on P",
        command=command.strip(),
        rows=rows,
        benchmark="benchmarks/validate_scaling.py",
        out_dir=Path(args.out),
        note=(
            f"prediction on device 0 (layout {args.layout}; communication term: "
            f"{args.bandwidth_gbs:g} GB/s per direction, {args.latency_us:g} us per exchange, "
            f"{args.allreduce_us:g} us per all-reduce); measured: DomainParallel on P ranks "
            f"({'NCCL' if args.device.startswith('cuda') else 'gloo'}), the slowest rank's "
            f"steady step; {args.steps} steps after {args.warmup} warm-up"
        ),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
