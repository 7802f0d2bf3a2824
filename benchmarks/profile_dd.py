"""Where a DomainParallel LJ step goes on N ranks: steady steps against rebuild steps.

Every rank times each step on its own (device synchronised around it), so the
table separates the steady step (no migration) from the steps that migrate and
build a new halo plan; then synchronised phase timers; then a torch.profiler
table of rank 0 over a window that holds a rebuild.

    python benchmarks/profile_dd.py --device cuda --world 2 --cells 63 --dtype float32
    python benchmarks/profile_dd.py --world 2 --cells 8            # CPU smoke check
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))


def _rank(
    cells: int,
    device: str,
    dtype_name: str,
    steps: int,
    halo: bool,
    shapes: bool = False,
    python: bool = False,
) -> dict[str, Any]:
    import torch.distributed as dist
    from bench_dp import CUTOFF, DT_FS, SKIN, _model, _system

    from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet

    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    cuda = device == "cuda"
    dev = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = getattr(torch, dtype_name)
    batch = _system(cells, dev, dtype) if rank == 0 else _system(1, dev, dtype)
    dyn = VelocityVerlet(_model(dev, dtype), batch, dt_fs=DT_FS)
    config = DomainConfig(cutoff=CUTOFF["lj"], skin=SKIN, halo_on_one_rank=halo)
    out: dict[str, Any] = {}
    with DomainParallel(dyn, config) as dp:
        dp.partition()
        dp.run(20)
        sync()
        dist.barrier()
        steady, rebuild = [], []
        for _ in range(steps):
            before = dp.stats.rebuilds
            t0 = time.perf_counter()
            dp.run(1)
            sync()
            ms = 1000 * (time.perf_counter() - t0)
            (rebuild if dp.stats.rebuilds != before else steady).append(ms)
        out["steady_ms"] = statistics.median(steady) if steady else float("nan")
        out["rebuild_ms"] = statistics.mean(rebuild) if rebuild else float("nan")
        out["rebuilds"] = len(rebuild)
        out["steps"] = steps
        dp.model.sync_timings = True
        for k in dp.stats.seconds:
            dp.stats.seconds[k] = 0.0
        t0 = time.perf_counter()
        dp.run(steps)
        sync()
        total = time.perf_counter() - t0
        out["phases_ms"] = {k: 1000 * v / steps for k, v in dp.stats.seconds.items()}
        out["synced_ms"] = 1000 * total / steps
        dp.model.sync_timings = False
        dp.model.request_rebuild()  # the window below holds one rebuild and steady steps
        acts = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(
            activities=acts, record_shapes=shapes, with_stack=python
        ) as prof:
            dp.run(10)
            sync()
        if rank == 0:
            tables = []
            for key in ("self_cpu_time_total", "self_cuda_time_total" if cuda else None):
                if key is None:
                    continue
                t = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=55)
                tables.append("\n".join(line[:150] for line in t.splitlines()))
            if shapes:  # the costliest operators by input shapes (which tensors)
                key = "cuda_time_total" if cuda else "cpu_time_total"
                t = prof.key_averages(group_by_input_shape=True).table(
                    sort_by=key, row_limit=40, max_name_column_width=30, max_shapes_column_width=70
                )
                tables.append(t)
            if python:  # host time of nvdd's Python functions (inclusive), per call site
                rows = [
                    e
                    for e in prof.key_averages()
                    if ("/nvdd/" in e.key or e.key.startswith("nvdd/")) and ".py(" in e.key
                ]
                rows.sort(key=lambda e: -e.cpu_time_total)
                lines = ["nvdd Python functions by inclusive host time (10 steps):"]
                if not rows:  # (seen with torch 2.11+cu130 on the H200: no Python events)
                    lines.append(
                        "  none recorded: this torch build's profiler gave no Python frames"
                    )
                for e in rows[:40]:
                    where = e.key.split("nvdd/", 1)[-1]
                    lines.append(
                        f"  {e.cpu_time_total / 1000:9.2f} ms  {e.count:6d} calls  {where[:100]}"
                    )
                tables.append("\n".join(lines))
            out["profile"] = "\n".join(tables)
        out["owned"], out["ghosts"] = dp.stats.n_owned, dp.stats.n_ghost
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--cells", type=int, default=10)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--halo", action="store_true", help="one rank: the halo path anyway")
    p.add_argument("--shapes", action="store_true", help="also a table by input shapes")
    p.add_argument("--python", action="store_true", help="also host time per nvdd function")
    args = p.parse_args()
    from nvdd.core import spawn_ranks

    backend = "nccl" if args.device == "cuda" else "gloo"
    res = spawn_ranks(
        _rank, args.world, args.cells, args.device, args.dtype, args.steps, args.halo, args.shapes, args.python,
        backend=backend, timeout_s=900, start_method="spawn",
    )  # fmt: skip
    print(f"### profile_dd.py --device {args.device} --world {args.world} --cells {args.cells} "
          f"--dtype {args.dtype} --steps {args.steps}{' --halo' if args.halo else ''}")  # fmt: skip
    for r, out in enumerate(res):
        print(f"rank {r}: {out['owned']:,d} owned, {out['ghosts']:,d} ghosts; steady step "
              f"{out['steady_ms']:.2f} ms (median), rebuild step {out['rebuild_ms']:.2f} ms "
              f"({out['rebuilds']} in {out['steps']}); synchronised phases "
              f"{out['synced_ms']:.2f} ms/step:")  # fmt: skip
        print("   " + ", ".join(f"{k} {v:.3f}" for k, v in out["phases_ms"].items()))
    print(res[0]["profile"])


if __name__ == "__main__":
    main()
