"""Diagnose DomainParallel(compile=True) against eager on one device (the compiled
MPNN's GPU numbers in docs/benchmarks.md). Single process, a world of one.

    python benchmarks/profile_compile.py --device cuda --cells 29 [--halo] [--profile]
        [--mode reduce-overhead] [--alternate]

``--alternate`` keeps the eager and the compiled runs alive together and times
them in alternating chunks, as ``bench_compile.py`` does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))


def _profile(dp: Any, dev: str) -> None:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        dp.run(2)
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60
    )
    print("\n".join(line[:160] for line in table.splitlines()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--cells", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--halo", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--mode", default=None)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--alternate", action="store_true")
    args = p.parse_args()
    import torch.distributed as dist
    from bench_compile import _setup
    from torch._dynamo.utils import counters

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dev = args.device
    dist.init_process_group("nccl" if dev == "cuda" else "gloo", rank=0, world_size=1)
    if dev == "cuda":
        dev = "cuda:0"
    conf = {"dtype": args.dtype, "cells": args.cells, "temperature": 90.0, "model": "mpnn",
            "strategy": "halo", "backend": "inductor", "compile_mode": args.mode,
            "fullgraph": False, "no_pad": False, "dt": 4.0, "halo": args.halo}  # fmt: skip
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)

    def timed(dp: Any, n: int) -> float:
        sync()
        t0 = time.perf_counter()
        dp.run(n)
        sync()
        return 1000 * (time.perf_counter() - t0) / n

    warnings.simplefilter("ignore")
    dps = {}
    for compiled in (False, True):
        dp, _ = _setup(conf, dev, compiled)
        t0 = time.perf_counter()
        dp.run(3)
        sync()
        print(f"compiled={compiled} mode={args.mode}: warm-up {time.perf_counter() - t0:.1f} s, "
              f"{dp.stats.compile_mode}, compiles {dp.stats.compiles}", flush=True)  # fmt: skip
        if not args.alternate:
            print(f"  {timed(dp, args.steps):.2f} ms/step, compiles {dp.stats.compiles}, "
                  f"rebuilds {dp.stats.rebuilds}", flush=True)  # fmt: skip
            if args.profile:
                _profile(dp, dev)
            dp.close()
        else:
            dps[compiled] = dp
    if args.alternate:
        for chunk in range(3):
            line = [f"{'compiled' if c else 'eager'} {timed(dp, args.steps):.2f}"
                    for c, dp in dps.items()]  # fmt: skip
            print(f"  chunk {chunk}: " + ", ".join(line) + " ms/step", flush=True)
        for dp in dps.values():
            dp.close()
    print("dynamo stats:", dict(counters["stats"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
