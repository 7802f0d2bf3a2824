"""Where a halo step goes on one device (``DomainConfig(halo_on_one_rank=True)``):
per-phase times with synchronised timers, then a torch.profiler table.

    python benchmarks/profile_halo.py --device cuda --cells 63 --dtype float32
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--cells", type=int, default=10)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    import torch.distributed as dist
    from bench_dp import CUTOFF, DT_FS, SKIN, _model, _system

    from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    dev = "cuda:0" if cuda else "cpu"
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warnings.simplefilter("ignore")
    dyn = VelocityVerlet(_model(dev, dtype), _system(args.cells, dev, dtype), dt_fs=DT_FS)
    dp = DomainParallel(dyn, DomainConfig(cutoff=CUTOFF["lj"], skin=SKIN, halo_on_one_rank=True))
    dp.partition()
    dp.run(20)
    sync()
    t0 = time.perf_counter()
    dp.run(args.steps)
    sync()
    ms = 1000 * (time.perf_counter() - t0) / args.steps
    calls0, rebuilds0 = dp.stats.calls, dp.stats.rebuilds
    dp.model.sync_timings = True
    for k in dp.stats.seconds:
        dp.stats.seconds[k] = 0.0
    t0 = time.perf_counter()
    dp.run(args.steps)
    sync()
    total = time.perf_counter() - t0
    print(f"{dp.sharded.n_atoms:,d} atoms, {dp.stats.n_ghost:,d} ghost rows: {ms:.2f} ms/step; "
          f"synchronised: {1000 * total / args.steps:.2f} ms/step, rebuilds "
          f"{dp.stats.rebuilds - rebuilds0} in {dp.stats.calls - calls0} calls")  # fmt: skip
    for k, v in dp.stats.seconds.items():
        print(f"  {k:<10}{1000 * v / args.steps:8.3f} ms/step  {100 * v / total:5.1f} %")
    dp.model.sync_timings = False
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        dp.run(10)
        sync()
    for key in ("self_cpu_time_total", "self_cuda_time_total" if cuda else None):
        if key is None:
            continue
        table = prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=55)
        print("\n".join(line[:150] for line in table.splitlines()))
    dp.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
