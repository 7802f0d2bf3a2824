"""Benchmark: PME (nvdd.models.ParticleMeshEwald) ms/step on one device and under DD,
with the share of the step spent in its collective (the charge-mesh all-reduce).

System: a charge-neutral ionic liquid (ions on a jittered grid at rock-salt density,
charges +1 / -1), velocity-Verlet NVE with PME only (timing, not physics). In ONE
run it times the raw single-process integrator, then DomainParallel on each world
size given, and reports ms/step, the mesh all-reduce's share of the step
(timed inside the call, device-synchronised), the mesh size and its bytes.

Usage::

    python benchmarks/bench_pme.py --quick                       # CPU, 1000 charges
    python benchmarks/bench_pme.py --device cuda --atoms 100000 --worlds 1     # one GPU
    python benchmarks/bench_pme.py --device cuda --atoms 100000 --worlds 1 2   # two GPUs

Ratios within one run are the result; this is not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

DENSITY = 8 / 5.64**3  # ions per A^3 (rock salt)


def _system(n: int, device: str, dtype: torch.dtype) -> Any:
    from nvdd.core import Batch

    side = math.ceil(n ** (1 / 3))
    length = (n / DENSITY) ** (1 / 3)
    g = torch.Generator().manual_seed(0)
    grid = torch.stack(
        torch.meshgrid(*[torch.arange(side, dtype=torch.float64)] * 3, indexing="ij"), -1
    ).reshape(-1, 3)[:n]
    frac = (grid + 0.5 + 0.3 * (torch.rand(n, 3, generator=g, dtype=torch.float64) - 0.5)) / side
    z = torch.where(torch.arange(n) % 2 == 0, 11, 17)[torch.randperm(n, generator=g)]
    q = torch.where(z == 11, 1.0, -1.0).to(torch.float64)
    if n % 2:
        q[-1] = 0.0
    return Batch(
        positions=(frac * length).to(dtype),
        atomic_numbers=z,
        cell=(torch.eye(3, dtype=torch.float64) * length).to(dtype),
        pbc=[True, True, True],
        atom_extras={"charges": q.to(dtype)},
    ).to(device)


def _model(args: argparse.Namespace, device: str, dtype: torch.dtype) -> Any:
    from nvdd.models import ParticleMeshEwald, PMEConfig

    cfg = PMEConfig(
        cutoff=args.cutoff, accuracy=1e-5, mesh_spacing=args.mesh_spacing, skin=args.skin
    )
    return ParticleMeshEwald(cfg).to(device=device, dtype=dtype)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def raw(args: argparse.Namespace) -> dict[str, Any]:
    """The single-process integrator (no DD wrapper)."""
    from nvdd.dynamics import VelocityVerlet

    dtype = getattr(torch, args.dtype)
    device = "cuda" if args.device == "cuda" else "cpu"
    batch = _system(args.atoms, device, dtype)
    model = _model(args, device, dtype)
    dyn = VelocityVerlet(model, batch, dt_fs=args.dt)
    dyn.run(args.warmup)
    _sync(device)
    t0 = time.perf_counter()
    dyn.run(args.steps)
    _sync(device)
    elapsed = time.perf_counter() - t0
    mesh = model.mesh_of(batch.cell[0])
    return {"ms_per_step": 1000 * elapsed / args.steps, "atoms": batch.n_atoms, "mesh": mesh}


def dd(args: argparse.Namespace) -> dict[str, Any]:
    """DomainParallel on the ranks of the current process group; the mesh all-reduce timed."""
    import torch.distributed as dist

    from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet

    dtype = getattr(torch, args.dtype)
    rank = dist.get_rank()
    device = f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu"
    batch = _system(args.atoms if rank == 0 else 2, device, dtype)
    model = _model(args, device, dtype)
    dyn = VelocityVerlet(model, batch, dt_fs=args.dt)
    spent = [0.0, 0]
    original = dist.all_reduce

    def timed(t: torch.Tensor, *a: Any, **k: Any) -> Any:
        if t.numel() < 1000:  # flags and per-system totals: not the mesh
            return original(t, *a, **k)
        _sync(device)
        t0 = time.perf_counter()
        out = original(t, *a, **k)
        _sync(device)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DomainConfig(cutoff=args.cutoff, skin=args.skin)
        with DomainParallel(dyn, config, sync_timings=True) as dp:
            dp.partition()
            dp.run(args.warmup)
            _sync(device)
            dist.barrier()
            dist.all_reduce = timed  # type: ignore[assignment]
            try:
                t0 = time.perf_counter()
                dp.run(args.steps)
                _sync(device)
                dist.barrier()
                elapsed = time.perf_counter() - t0
            finally:
                dist.all_reduce = original  # type: ignore[assignment]
            owned = dp.sharded.owned_counts
            ghosts = dp.stats.n_ghost
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    return {
        "ms_per_step": 1000 * elapsed / args.steps,
        "mesh_share": spent[0] / elapsed,
        "mesh_calls": spent[1],
        "owned": owned,
        "ghosts_rank0": ghosts,
        "peak_bytes": peak,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--atoms", type=int, default=100_000)
    p.add_argument("--cutoff", type=float, default=9.0, help="real-space cutoff, A")
    p.add_argument("--mesh-spacing", type=float, default=1.0, help="A")
    p.add_argument("--skin", type=float, default=1.0)
    p.add_argument("--dt", type=float, default=0.5, help="fs")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--worlds", type=int, nargs="+", default=[1])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    p.add_argument("--quick", action="store_true", help="1000 charges, 5 steps, worlds 1 2 (CPU)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.atoms, args.steps, args.warmup, args.worlds = 1000, 5, 3, [1, 2]
        args.cutoff, args.mesh_spacing = 6.0, 1.5
    from nvdd.core import spawn_ranks

    threads = max(1, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    base = raw(args)
    rows: list[dict[str, Any]] = [{"run": "raw integrator", "ranks": 1, **base}]
    backend = "nccl" if args.device == "cuda" else "gloo"
    for world in args.worlds:
        res = spawn_ranks(
            dd,
            world,
            args,
            backend=backend,
            timeout_s=1800,
            threads_per_rank=max(1, threads // world),
            start_method="spawn",
        )[0]
        rows.append({"run": "DomainParallel", "ranks": world, **res})
    mesh = base["mesh"]
    mb = math.prod(mesh) * (8 if args.dtype == "float64" else 4) / 1e6
    print(
        f"\nPME, {base['atoms']} charges, cutoff {args.cutoff} A, mesh {mesh} ({mb:.1f} MB), "
        f"{args.dtype}, {args.device}, {args.steps} steps (one run)"
    )
    print(f"{'run':<16}{'ranks':>6}{'ms/step':>10}{'vs raw':>8}{'mesh all-reduce':>17}")
    for r in rows:
        share = r.get("mesh_share")
        col = f"{100 * share:>16.1f}%" if share is not None else f"{'-':>17}"
        print(
            f"{r['run']:<16}{r['ranks']:>6}{r['ms_per_step']:>10.2f}"
            f"{r['ms_per_step'] / base['ms_per_step']:>8.2f}{col}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
