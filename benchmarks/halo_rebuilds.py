"""What the halo's rebuild steps cost a decomposed LJ run, on one device.

The scaling prediction (``predict_scaling.py``) times each rank's *steady* step;
the runtime also rebuilds its halo (migration, a new plan, the model's list on
the new rows, the steady step captured again) whenever some atom moved more
than half the halo's skin. This script measures both on one rank with the halo
forced (``DomainConfig(halo_on_one_rank=True)``), LJ argon as in ``bench_dp.py``
(model skin ``SKIN``), for each ``--halo-skin`` (the ``DomainConfig.skin``; the
model keeps its own):

- ``ms_per_step``: ``--steps`` steps after a warm-up with one rebuild, one
  device synchronisation around them (the rebuilds that fell due included),
  ``rebuilds`` and ``list_builds`` (the model's own neighbour builds) among them;
- ``steady_ms`` / ``rebuild_ms``: the same number of steps again, each step
  synchronised and classified: a replayed steady step, or a step that rebuilt;
- ``forced_rebuild_ms`` / ``after_rebuild_ms``: five rebuilds requested on
  purpose, each with the step after it (where the step is captured again);
- ``raw_ms``: the single-process integrator on the same system (no halo).

``rebuild_share`` is the part of the synchronised steps' time (``synced_ms`` per
step) that their rebuild steps add over steady ones (:func:`rebuild_share`).

A halo skin thicker than the model's is exact (the model checks its own list
every step, as in one process; the halo only has to hold every atom the list
may reach): the halo is rebuilt less often, its ghost rows are more.

    python benchmarks/halo_rebuilds.py --device cuda --cells 63 100 --steps 100
    python benchmarks/halo_rebuilds.py --cells 6 --steps 40 --halo-skin 1.0 2.0   # CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import bench_dp, harness

#: Rebuilds requested on purpose (each timed with the step after it).
FORCED = 5


def _rank(cells: int, dtype_name: str, halo_skin: float, steps: int, device: str) -> dict[str, Any]:
    """One rank's measurements (module notes); runs inside ``spawn_ranks``."""
    from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet

    cuda = device == "cuda"
    dev = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    dtype = getattr(torch, dtype_name)

    def sync() -> None:
        harness.sync(dev)

    model = bench_dp._model(dev, dtype)
    dyn = VelocityVerlet(model, bench_dp._system(cells, dev, dtype), dt_fs=bench_dp.DT_FS)
    config = DomainConfig(cutoff=bench_dp.CUTOFF["lj"], skin=halo_skin, halo_on_one_rank=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp = DomainParallel(dyn, config)
    out: dict[str, Any] = {}
    with dp:
        dp.partition()
        dp.run(20)
        dp.model.request_rebuild()  # (the rebuild path's one-time costs, untimed)
        dp.run(1)
        sync()
        r0, b0 = dp.stats.rebuilds, model.device_neighbors.n_builds
        t0 = time.perf_counter()
        dp.run(steps)
        sync()
        out["ms_per_step"] = 1000 * (time.perf_counter() - t0) / steps
        out["rebuilds"] = dp.stats.rebuilds - r0
        out["list_builds"] = model.device_neighbors.n_builds - b0
        kinds: dict[str, list[float]] = {"steady": [], "rebuild": [], "other": []}
        for _ in range(steps):
            r, p = dp.stats.rebuilds, dyn.graphs.replays
            t = time.perf_counter()
            dp.run(1)
            sync()
            ms = 1000 * (time.perf_counter() - t)
            if dp.stats.rebuilds != r:
                kinds["rebuild"].append(ms)
            elif dyn.graphs.replays != p or not cuda:  # (nothing is replayed on a CPU)
                kinds["steady"].append(ms)
            else:  # an eager step on CUDA: e.g. the capture after a rebuild
                kinds["other"].append(ms)
        out["synced_ms"] = sum(sum(v) for v in kinds.values()) / steps
        for kind, times in kinds.items():
            out[f"{kind}_steps"] = len(times)
            out[f"{kind}_ms"] = sum(times) / len(times) if times else None
        forced, after = [], []
        for _ in range(FORCED):
            dp.model.request_rebuild()
            for into in (forced, after):
                t = time.perf_counter()
                dp.run(1)
                sync()
                into.append(1000 * (time.perf_counter() - t))
        out["forced_rebuild_ms"], out["after_rebuild_ms"] = forced, after
        out["owned"], out["ghosts"] = dp.stats.n_owned, dp.stats.n_ghost
    return out


def rebuild_share(r: dict[str, Any], steps: int) -> float:
    """The part of the synchronised steps' time that the rebuild steps add over
    steady ones: ``rebuild_steps x (rebuild_ms - steady_ms) / (steps x synced_ms)``.

    Below 1 by construction (``synced_ms`` is the mean over every step, rebuild
    steps included); negative when the rebuild steps were timed faster than the
    steady mean, which noise does on a loaded host with few rebuilds."""
    if not r["rebuild_steps"] or r["steady_ms"] is None:
        return 0.0
    return r["rebuild_steps"] * (r["rebuild_ms"] - r["steady_ms"]) / (steps * r["synced_ms"])


def measure(
    cells: int, dtype_name: str, halo_skins: Sequence[float], steps: int, device: str
) -> list[dict[str, Any]]:
    """The raw step and one row per halo skin (module notes)."""
    from nvdd.core import spawn_ranks

    raw = bench_dp.raw(cells, steps, 20, device, dtype_name)
    rows = []
    for skin in halo_skins:
        r = spawn_ranks(
            _rank, 1, cells, dtype_name, skin, steps, device,
            backend="nccl" if device == "cuda" else "gloo", timeout_s=1200,
        )[0]  # fmt: skip
        row = {
            "cells": cells,
            "atoms": r["owned"],
            "dtype": dtype_name,
            "model_skin": bench_dp.SKIN,
            "halo_skin": skin,
            "steps": steps,
            "raw_ms": raw["ms_per_step"],
            **r,
            "rebuild_share": rebuild_share(r, steps),
        }
        print({k: v for k, v in row.items() if not isinstance(v, list)}, flush=True)
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--cells", type=int, nargs="+", default=[6])
    p.add_argument("--dtype", nargs="+", default=["float32"])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument(
        "--halo-skin", type=float, nargs="+", default=[bench_dp.SKIN],
        help="DomainConfig.skin values (the model's skin stays %(default)s)",
    )  # fmt: skip
    p.add_argument("--name", default="halo-rebuilds-lj")
    p.add_argument("--out", default=str(harness.RESULTS))
    args = p.parse_args(argv)
    rows = [
        row
        for cells in args.cells
        for dtype in args.dtype
        for row in measure(cells, dtype, args.halo_skin, args.steps, args.device)
    ]
    command = "python benchmarks/halo_rebuilds.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    path = harness.write_result(
        args.name,
        title="LJ argon, one rank with the halo forced: steady steps and the halo's rebuild steps",
        command=command.strip(),
        rows=rows,
        benchmark="benchmarks/halo_rebuilds.py",
        out_dir=Path(args.out),
        note=f"cutoff {bench_dp.CUTOFF['lj']} A, the model's skin {bench_dp.SKIN} A, "
        f"{bench_dp.DT_FS} fs, argon at 90 K; CUDA graphs where the device captures",
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
