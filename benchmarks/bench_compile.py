"""Benchmark: compiled vs eager DomainParallel, and recompilations after warm-up.

In ONE run, on every world size given, each rank runs the same dynamics twice:
eager, then with ``DomainConfig(compile=True)`` (the models' padded,
collective-free compiled regions; ``CompilePolicy`` from the flags). It prints
ms/step of both, the speed-up, the warm-up time of the compiled run (it includes
the compilation), the graphs compiled during the warm-up and **after** it
(target 0), the halo rebuilds after the warm-up (how often the counts changed)
and the padding capacities.

Usage::

    python benchmarks/bench_compile.py --quick                      # CPU, a minute or two
    python benchmarks/bench_compile.py --model mpnn --cells 8 --worlds 1 2
    # recompilations over 1000 hot-gas steps (aot_eager: the graphs inductor
    # compiles, traced without code generation):
    python benchmarks/bench_compile.py --model mpnn --temperature 3000 --dt 1 \\
        --steps 1000 --warmup 50 --worlds 2 --backend aot_eager --skip-eager
    # one H200, MPNN on 97,556 atoms:
    python benchmarks/bench_compile.py --device cuda --model mpnn --cells 29 \\
        --dtype float32 --steps 200 --warmup 30 --worlds 1

Ratios within one run are the result; this is not a test.
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

CUTOFF = {"lj": 8.5, "mpnn": 5.0}


def _model(
    name: str, device: str, dtype: torch.dtype, neighbors: str = "auto", lj_backend: str = "auto"
) -> Any:
    from nvdd.models import LennardJones, LJBackend, LJConfig, MPNNConfig, ReferenceMPNN

    if name == "mpnn":
        cfg = MPNNConfig(
            cutoff=CUTOFF["mpnn"], species=(18,), hidden=32, n_layers=2, skin=1.0,
            neighbors=neighbors,
        )  # fmt: skip
        return ReferenceMPNN(cfg, dtype=dtype, device=device)
    lj = LJConfig(
        cutoff=CUTOFF["lj"], epsilon=0.0104, sigma=3.40, skin=1.0, backend=LJBackend(lj_backend)
    )
    return LennardJones(lj).to(device=device, dtype=dtype)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _setup(args: dict[str, Any], device: str, compiled: bool) -> tuple[Any, Any]:
    """A partitioned DomainParallel (eager or compiled) and its model, on this rank."""
    import torch.distributed as dist

    from nvalchemi.distributed._demo import argon_box
    from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet
    from nvdd.spec import CompilePolicy, MLIPSpec, StrategyKind

    dtype = getattr(torch, args["dtype"])
    cells = args["cells"] if dist.get_rank() == 0 else 1
    batch = argon_box(cells, dtype=dtype, temperature_K=args["temperature"], seed=0).to(device)
    model = _model(
        args["model"], device, dtype, args.get("neighbors", "auto"), args.get("lj_backend", "auto")
    )
    strategy = StrategyKind(args["strategy"])
    policy = CompilePolicy(
        enabled=compiled,
        backend=args["backend"],
        mode=args["compile_mode"],
        fullgraph=args["fullgraph"],
        pad_shapes=not args["no_pad"],
    )
    spec = model.distribution_spec(strategy) | MLIPSpec(compile=policy)
    config = DomainConfig(
        cutoff=CUTOFF[args["model"]],
        skin=1.0,
        strategy=strategy,
        compile=compiled,
        # one rank runs the whole batch unless asked for the halo path (--halo)
        halo_on_one_rank=bool(args.get("halo", False)),
    )
    dp = DomainParallel(VelocityVerlet(model, batch, dt_fs=args["dt"]), config, spec=spec)
    dp.partition()
    return dp, model


def _timed(dp: Any, steps: int, device: str) -> float:
    import torch.distributed as dist

    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    dp.run(steps)
    _sync(device)
    dist.barrier()
    return time.perf_counter() - t0


def ranks(args: dict[str, Any]) -> dict[str, Any]:
    """Every rank: an eager and a compiled run of the same system, warmed up, then
    timed in alternating chunks (so both see the same machine load)."""
    device = args["device"]
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    runs = {"compiled": True} if args["skip_eager"] else {"eager": False, "compiled": True}
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dps = {name: _setup(args, device, flag) for name, flag in runs.items()}
        for name, (dp, _model) in dps.items():
            warm_s = _timed(dp, args["warmup"], device)
            out[name] = {
                "warmup_s": warm_s,
                "compiles_warmup": dp.stats.compiles,
                "rebuilds_warmup": dp.stats.rebuilds,
                "seconds": 0.0,
            }
        chunks = max(1, min(args["chunks"], args["steps"]))
        sizes = [
            args["steps"] // chunks + (1 if k < args["steps"] % chunks else 0)
            for k in range(chunks)
        ]
        for size in sizes:
            for name, (dp, _) in dps.items():
                out[name]["seconds"] += _timed(dp, size, device)
        for name, (dp, model) in dps.items():
            o, stats = out[name], dp.stats
            core = getattr(model, "_core", None)
            o.update(
                ms_per_step=1000 * o["seconds"] / args["steps"],
                mode=stats.compile_mode,
                compiles_after=stats.compiles - o["compiles_warmup"],
                rebuilds_after=stats.rebuilds - o["rebuilds_warmup"],
                caps=core.capacities if core is not None else {},
                regrows=getattr(core, "regrows", 0),
                atoms=dp.sharded.n_atoms,
                ghosts=stats.n_ghost,
                replays=dp.dynamics.graphs.replays,
                captures=dp.dynamics.graphs.captures,
            )
            dp.close()
    return out


def _replayed(run: dict[str, Any] | None) -> str:
    """Steps replayed from a CUDA graph over all steps of a run (warm-up included)."""
    return "-" if run is None else str(run.get("replays", 0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["lj", "mpnn"], default="mpnn")
    p.add_argument("--strategy", choices=["halo", "graph_partition"], default="halo")
    p.add_argument(
        "--halo",
        action="store_true",
        help="on one rank, run the halo path (periodic images as ghosts) instead of the whole batch",
    )
    p.add_argument("--cells", type=int, default=8, help="FCC argon cells per edge (4 atoms each)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    p.add_argument("--dt", type=float, default=4.0, help="time step, fs")
    p.add_argument("--temperature", type=float, default=90.0, help="initial K (3000: hot gas)")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--compile-mode", default=None, help="e.g. reduce-overhead (CUDA graphs)")
    p.add_argument("--fullgraph", action="store_true")
    p.add_argument("--no-pad", action="store_true", help="CompilePolicy(pad_shapes=False)")
    p.add_argument("--skip-eager", action="store_true", help="only the compiled run")
    p.add_argument("--chunks", type=int, default=5, help="alternating timed chunks")
    p.add_argument(
        "--quick", action="store_true", help="--cells 5 --steps 20 --warmup 5 --worlds 2"
    )
    p.add_argument(
        "--neighbors",
        default="auto",
        choices=["auto", "device", "verlet"],
        help="MPNNConfig.neighbors (device: capturable steps; verlet: the host-compacted list)",
    )
    p.add_argument(
        "--lj-backend",
        choices=["auto", "torch", "warp"],
        default="auto",
        help="LJConfig.backend (the Warp path compiles nothing; torch compiles its torch path)",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.quick:
        a.cells, a.steps, a.warmup, a.worlds = 5, 20, 5, [2]
    from nvdd.core import spawn_ranks

    args = vars(a)
    threads = max(1, os.cpu_count() or 1)
    backend = "nccl" if a.device == "cuda" else "gloo"
    rows = []
    for world in a.worlds:
        # inductor's CPU kernels parallelise with OpenMP: one team per rank, sized
        # like torch's own threads (2 ranks x all cores spin-wait on each other)
        os.environ["OMP_NUM_THREADS"] = str(max(1, threads // world))
        res = spawn_ranks(
            ranks,
            world,
            args,
            backend=backend,
            timeout_s=3600,
            threads_per_rank=max(1, threads // world),
            start_method="spawn",
        )
        rows.append({"ranks": world, "per_rank": res})
    first = rows[0]["per_rank"][0]["compiled"]
    print(
        f"\n{a.model.upper()} ({a.strategy}) on argon, {first['atoms']} atoms, {a.dtype}, "
        f"{a.device}, T0 {a.temperature:g} K, dt {a.dt:g} fs, {a.steps} steps after "
        f"{a.warmup} warm-up; backend {a.backend}, mode {a.compile_mode}, "
        f"pad_shapes {not a.no_pad}, neighbors {a.neighbors}"
    )
    print(
        f"{'ranks':>5}{'eager ms':>10}{'compiled ms':>13}{'speed-up':>10}{'warm-up s':>11}"
        f"{'compiles':>10}{'after':>7}{'rebuilds':>10}{'regrows':>9}{'replayed e/c':>14}"
        "  caps (rank 0)"
    )
    for r in rows:
        per = r["per_rank"]
        comp = max(per, key=lambda x: x["compiled"]["ms_per_step"])["compiled"]
        after = max(x["compiled"]["compiles_after"] for x in per)
        eager = max((x["eager"]["ms_per_step"] for x in per if "eager" in x), default=float("nan"))
        print(
            f"{r['ranks']:>5}{eager:>10.2f}{comp['ms_per_step']:>13.2f}"
            f"{eager / comp['ms_per_step']:>10.2f}{comp['warmup_s']:>11.1f}"
            f"{comp['compiles_warmup']:>10}{after:>7}{comp['rebuilds_after']:>10}"
            f"{comp['regrows']:>9}"
            f"{_replayed(per[0].get('eager')):>7}/{_replayed(comp):<6}  "
            f"{per[0]['compiled']['caps']}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": args, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
