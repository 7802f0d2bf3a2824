"""Benchmark: steady steps replayed from a CUDA graph against eager steps, per integrator.

Single process, LJ argon as in ``bench_dp.py`` (cutoff 8.5 A, skin 1 A, 4 fs),
velocity Verlet and Langevin (300 K), graphs on and off, in one run::

    python benchmarks/bench_graphs.py --device cuda --cells 32 --dtype float32

Ratios within one run are the result; this is not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--cells", type=int, nargs="+", default=[8])
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=30)
    args = p.parse_args()
    from bench_dp import DT_FS, _model, _system

    from nvdd.dynamics import Langevin, VelocityVerlet

    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"{'atoms':>10} {'integrator':<16}{'graphs ms':>10}{'eager ms':>10}{'speed-up':>10}")
    for cells in args.cells:
        for name in ("velocity Verlet", "Langevin"):
            ms = {}
            for graphs in (True, False):
                model = _model(args.device, dtype)
                batch = _system(cells, args.device, dtype)
                if name == "Langevin":
                    dyn = Langevin(
                        model, batch, dt_fs=DT_FS, temperature_K=300.0, cuda_graphs=graphs
                    )
                else:
                    dyn = VelocityVerlet(model, batch, dt_fs=DT_FS, cuda_graphs=graphs)
                dyn.run(args.warmup)
                sync()
                t0 = time.perf_counter()
                dyn.run(args.steps)
                sync()
                ms[graphs] = 1000 * (time.perf_counter() - t0) / args.steps
            print(f"{4 * cells**3:>10,d} {name:<16}{ms[True]:>10.3f}{ms[False]:>10.3f}"
                  f"{ms[False] / ms[True]:>10.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
