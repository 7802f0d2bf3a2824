"""Benchmark: DomainParallel step time on N ranks vs 1 rank vs the raw integrator.

Lennard-Jones argon (FCC, cutoff 8.5 A, skin 1 A), velocity-Verlet NVE. In ONE
run it times: the raw single-process integrator (no DD wrapper), DomainParallel
on 1 rank (the wrapper's overhead), and DomainParallel on each N given; then
prints ms/step, speed-up and efficiency relative to the raw run, and the share
of each step spent in halo exchange, fold, migration and plan builds (rank 0).

Usage::

    python benchmarks/bench_dp.py --cells 10 --steps 40 --worlds 1 2
    python benchmarks/bench_dp.py --device cuda --cells 40 --worlds 1   # one GPU

CPU ranks share the machine's cores: on a 2-core host, 2 ranks can at best
halve the time. Ratios within one run are the result; this is not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _system(cells: int, device: str, dtype: torch.dtype) -> Any:
    from nvalchemi.distributed._demo import argon_box

    return argon_box(cells, dtype=dtype, temperature_K=90.0, seed=0).to(device)


MODEL = "lj"
CUTOFF = {"lj": 8.5, "mpnn": 5.0}


def _model(device: str, dtype: torch.dtype) -> Any:
    from nvdd.models import LennardJones, LJConfig, MPNNConfig, ReferenceMPNN

    if MODEL == "mpnn":
        cfg = MPNNConfig(cutoff=CUTOFF["mpnn"], species=(18,), hidden=32, n_layers=2, skin=1.0)
        return ReferenceMPNN(cfg, dtype=dtype, device=device)
    return LennardJones(LJConfig(cutoff=8.5, epsilon=0.0104, sigma=3.40, skin=1.0)).to(
        device=device, dtype=dtype
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def raw(
    cells: int, steps: int, warmup: int, device: str, dtype_name: str, model: str = "lj"
) -> dict[str, float]:
    """The single-process integrator without any DD wrapper."""
    from nvdd.dynamics import VelocityVerlet

    global MODEL
    MODEL = model
    dtype = getattr(torch, dtype_name)
    dyn = VelocityVerlet(_model(device, dtype), _system(cells, device, dtype), dt_fs=4.0)
    dyn.run(warmup)
    _sync(device)
    t0 = time.perf_counter()
    dyn.run(steps)
    _sync(device)
    return {"ms_per_step": 1000 * (time.perf_counter() - t0) / steps, "atoms": dyn.batch.n_atoms}


def dd(
    cells: int, steps: int, warmup: int, device: str, dtype_name: str, model: str = "lj"
) -> dict[str, Any]:
    """DomainParallel on the ranks of the current process group."""
    import torch.distributed as dist

    global MODEL
    MODEL = model
    from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet

    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    batch = _system(cells, device, dtype) if rank == 0 else _system(1, device, dtype)
    dyn = VelocityVerlet(_model(device, dtype), batch, dt_fs=4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DomainConfig(cutoff=CUTOFF[MODEL], skin=1.0)
        dp = DomainParallel(dyn, config, sync_timings=True)
        with dp:
            dp.partition()
            dp.run(warmup)
            for k in dp.stats.seconds:
                dp.stats.seconds[k] = 0.0
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            dp.run(steps)
            _sync(device)
            dist.barrier()
            elapsed = time.perf_counter() - t0
            shares = {k: v / elapsed for k, v in dp.stats.seconds.items()}
            counts = dp.sharded.owned_counts
            ghosts = dp.stats.n_ghost
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    return {
        "ms_per_step": 1000 * elapsed / steps,
        "shares": shares,
        "owned": counts,
        "ghosts_rank0": ghosts,
        "peak_bytes": peak,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", type=int, default=10, help="FCC cells per edge (4 atoms each)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    p.add_argument(
        "--model",
        choices=["lj", "mpnn"],
        default="lj",
        help="LJ argon, or the reference MPNN (2 layers, cutoff 5 A) on the same box",
    )
    p.add_argument("--quick", action="store_true", help="--cells 8 --steps 20")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.cells, args.steps = 8, 20
    from nvdd.core import spawn_ranks

    rows: list[dict[str, Any]] = []
    threads = max(1, (os.cpu_count() or 1))
    torch.set_num_threads(threads)
    base = raw(args.cells, args.steps, args.warmup, args.device, args.dtype, args.model)
    rows.append({"run": "raw integrator", "ranks": 1, **base})
    backend = "nccl" if args.device == "cuda" else "gloo"
    for world in args.worlds:
        per_rank = max(1, threads // world)
        res = spawn_ranks(
            dd,
            world,
            args.cells,
            args.steps,
            args.warmup,
            args.device,
            args.dtype,
            args.model,
            backend=backend,
            timeout_s=1800,
            threads_per_rank=per_rank,
            start_method="spawn",
        )[0]
        rows.append({"run": "DomainParallel", "ranks": world, **res})
    print(
        f"\n{args.model.upper()} on argon, {base['atoms']} atoms, {args.dtype}, {args.device}, {args.steps} steps "
        f"(one run; {threads} CPU threads shared by the ranks)"
    )
    cols = ("exchange", "fold", "migrate", "plan")
    print(
        f"{'run':<16}{'ranks':>6}{'ms/step':>10}{'speed-up':>10}{'efficiency':>11}"
        + "".join(f"{c:>10}" for c in cols)
    )
    for r in rows:
        speed = base["ms_per_step"] / r["ms_per_step"]
        shares = r.get("shares", {})
        print(
            f"{r['run']:<16}{r['ranks']:>6}{r['ms_per_step']:>10.1f}{speed:>10.2f}"
            f"{speed / r['ranks']:>11.2f}"
            + "".join(f"{100 * shares.get(c, 0.0):>9.1f}%" for c in cols)
        )
    one = next((r for r in rows if r["run"] == "DomainParallel" and r["ranks"] == 1), None)
    if one is not None:
        print(
            f"DD wrapper overhead at 1 rank: {100 * (one['ms_per_step'] / base['ms_per_step'] - 1):+.1f}%"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
