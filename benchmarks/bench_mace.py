"""Benchmark: MACE (mace-torch, random weights) as a plain model vs under DomainParallel.

The system is silica-like: O and Si (2:1, random) on a jittered simple-cubic
lattice at the density of amorphous SiO2 (0.066 atoms/A^3, spacing 2.47 A),
periodic, 300 K velocities, velocity-Verlet NVE. The model is mace-torch's
ScaleShiftMACE with random weights (no checkpoint is needed):

- ``--size medium``: the public "medium" foundation models' shape:
  128x0e+128x1o, 2 interactions, max_ell 3, correlation 3, r_max 6 A,
  8 Bessel functions, radial MLP 64-64-64;
- ``--size small``: 32x0e+32x1o, max_ell 2, correlation 2, r_max 5 A;
- ``--size tiny``: 8x0e+8x1o, max_ell 1, correlation 2, r_max 4 A (CPU checks).

Modes (each measurement runs in fresh processes, one per rank):

- ``plain``: the model in the raw single-process integrator (no DD wrapper);
- ``dd1``: DomainParallel on 1 rank (the wrapper's own cost);
- ``dd2``: DomainParallel on 2 ranks (2 GPUs over NCCL, or 2 CPU ranks);
- ``dd1halo``: DomainParallel on 1 rank with the halo path forced
  (``DomainConfig(halo_on_one_rank=True)``: the rank's ghost rows are its own
  periodic images), what a multi-GPU rank runs, on one GPU.

For each mode, dtype and cuEquivariance setting the system size doubles from
``--start-cells``^3 atoms (one axis at a time) for ``--doublings`` steps or until
``--max-atoms``; an out-of-memory error is caught and reported as a row, and
ends that scan. Reported: ms/step, peak memory per rank
(``torch.cuda.max_memory_allocated``; max RSS on CPU), and at the end the
issue's targets: the largest size per mode, DD-2 / plain atoms, the speed-up of
DD-2 over plain at the plain model's largest size, and the DD-1 overhead.

Usage::

    # CPU check (minutes): tiny model, small systems, 1 and 2 gloo ranks
    python benchmarks/bench_mace.py --quick
    # one H200: plain vs DD on 1 GPU, fp32 and fp64, scan until OOM
    python benchmarks/bench_mace.py --device cuda --modes plain dd1 \\
        --dtypes float32 float64 --start-cells 24 --doublings 8 --json mace_1gpu.json
    # two H200s: add DD on 2 GPUs
    python benchmarks/bench_mace.py --device cuda --modes plain dd1 dd2 \\
        --dtypes float32 --start-cells 24 --doublings 9 --json mace_2gpu.json
    # cuEquivariance (when cuequivariance-torch is installed): --cueq on (or both)

This is not a test; ratios measured within one run are the result.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SPACING = 2.47  # A: simple-cubic spacing at 0.066 atoms/A^3 (amorphous SiO2)
SIZES: dict[str, dict[str, Any]] = {
    "medium": {
        "hidden_irreps": "128x0e+128x1o",
        "num_interactions": 2,
        "max_ell": 3,
        "correlation": 3,
        "r_max": 6.0,
        "num_bessel": 8,
        "radial_mlp": (64, 64, 64),
        "mlp_irreps": "16x0e",
        "avg_num_neighbors": 60.0,
    },
    "small": {
        "hidden_irreps": "32x0e+32x1o",
        "max_ell": 2,
        "correlation": 2,
        "r_max": 5.0,
        "radial_mlp": (32, 32),
        "mlp_irreps": "16x0e",
        "avg_num_neighbors": 35.0,
    },
    "tiny": {
        "hidden_irreps": "8x0e+8x1o",
        "max_ell": 1,
        "correlation": 2,
        "r_max": 4.0,
        "radial_mlp": (16,),
        "avg_num_neighbors": 17.0,
    },
}


def dims_of(start: int, doubling: int) -> tuple[int, int, int]:
    """Lattice repeats after ``doubling`` doublings of ``start**3`` (one axis at a time)."""
    dims = [start, start, start]
    for k in range(doubling):
        dims[k % 3] *= 2
    return dims[0], dims[1], dims[2]


def silica(dims: tuple[int, int, int], dtype: torch.dtype, device: str, seed: int = 0) -> Any:
    """The silica-like periodic system (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    positions = jittered_grid(dims, SPACING, g)
    z = torch.where(torch.rand(positions.shape[0], generator=g) < 2 / 3, 8, 14)
    return periodic_box(
        positions, z, torch.tensor(dims, dtype=torch.float64) * SPACING, g, dtype, device
    )


def jittered_grid(dims: tuple[int, int, int], spacing: float, g: torch.Generator) -> torch.Tensor:
    """Simple-cubic sites at ``spacing`` (the cell's centres), each moved by 0.1 A noise."""
    axes = [torch.arange(d, dtype=torch.float64) for d in dims]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    return (grid + 0.5) * spacing + 0.1 * torch.randn(
        grid.shape[0], 3, generator=g, dtype=torch.float64
    )


def periodic_box(
    positions: torch.Tensor,
    z: torch.Tensor,
    lengths: torch.Tensor,
    g: torch.Generator,
    dtype: torch.dtype,
    device: str,
) -> Any:
    """A periodic orthorhombic Batch of ``positions`` (float64) and numbers ``z``, box
    ``lengths``, 300 K velocities from ``g`` (zero momentum), in ``dtype`` on ``device``."""
    from nvdd.core import Batch, maxwell_boltzmann

    batch = Batch(
        positions=positions,
        atomic_numbers=z,
        cell=torch.diag(lengths.to(torch.float64)),
        pbc=[True, True, True],
    )
    v = maxwell_boltzmann(batch.masses, 300.0, generator=g)
    return batch.replace(velocities=v).to(dtype=dtype, device=device)


def build(size: str, dtype: torch.dtype) -> torch.nn.Module:
    from nvdd.models import MACEConfig, build_mace

    return build_mace(MACEConfig(atomic_numbers=(8, 14), seed=0, **SIZES[size]), dtype=dtype)


def _peak_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prepare(device: str, memory_limit_mb: int = 0) -> str:
    """Before a measurement: cap the heap (``memory_limit_mb``, the CPU check of the
    out-of-memory path), reset the GPU's peak-memory counter; return the device
    with its index (``cuda`` -> ``cuda:N``)."""
    if memory_limit_mb:
        limit = memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
        torch.cuda.reset_peak_memory_stats()
    return device


def measure(
    mode: str,
    mace: torch.nn.Module,
    dims: tuple[int, int, int],
    dtype_name: str,
    cueq: bool,
    steps: int,
    warmup: int,
    device: str,
    skin: float,
    memory_limit_mb: int = 0,
    freeze: bool = True,
) -> dict[str, Any]:
    """One measurement on the ranks of this process group (rank 0 returns it); the
    model's weights frozen unless ``freeze`` is false (record 0089)."""
    import torch.distributed as dist

    device = prepare(device, memory_limit_mb)
    from nvdd.models import MACEModel

    rank = dist.get_rank()
    dtype = getattr(torch, dtype_name)
    model = MACEModel(mace, dtype=dtype, device=device, cueq=cueq, skin=skin, freeze=freeze)
    whole = rank == 0 or mode == "plain"
    batch = silica(dims, dtype, device) if whole else silica((1, 1, 1), dtype, device)
    row = run_md(mode, model, batch, steps, warmup, device, skin)
    return {**row, "cueq": model.uses_cueq, "freeze": freeze}


def run_md(
    mode: str, model: Any, batch: Any, steps: int, warmup: int, device: str, skin: float
) -> dict[str, Any]:
    """``warmup`` then ``steps`` timed NVE steps of ``model`` on ``batch`` (0.5 fs), plain
    or under ``DomainParallel`` on this process group (rank 0's result is the run's)."""
    import torch.distributed as dist

    from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet

    world = dist.get_world_size()
    n_atoms = batch.n_atoms
    dyn = VelocityVerlet(model, batch, dt_fs=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "plain":
            dyn.run(warmup)
            _sync(device)
            t0 = time.perf_counter()
            dyn.run(steps)
            _sync(device)
            elapsed = time.perf_counter() - t0
            ghosts = 0
            peak_mb = _peak_mb(device)
            ke_end = _kinetic(dyn.batch)
        else:
            config = DomainConfig(
                cutoff=model.cutoff, skin=skin, halo_on_one_rank=mode == "dd1halo"
            )
            with DomainParallel(dyn, config) as dp:
                dp.partition()
                dp.run(warmup)
                _sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                dp.run(steps)
                _sync(device)
                dist.barrier()
                elapsed = time.perf_counter() - t0
                ghosts = dp.stats.n_ghost
                peak_mb = _peak_mb(device)  # before the gather below
                ke_end = _kinetic(dp.gather(0))  # after the timed steps (a collective)
    peaks: list[Any] = [None] * world
    extra = {} if ke_end is None else {"ke_end": ke_end}
    dist.all_gather_object(peaks, (peak_mb, ghosts))
    return {
        "atoms": n_atoms,
        "ms_per_step": 1000.0 * elapsed / steps,
        "peak_mb": [p[0] for p in peaks],
        "ghosts": [p[1] for p in peaks],
        **extra,
    }


def _kinetic(batch: Any) -> float | None:
    """Kinetic energy (eV) of a whole batch (None off the gathering rank): legs that
    ran the same trajectory agree on it."""
    if batch is None:
        return None
    return float(0.5 * (batch.masses[:, None] * batch.velocities**2).sum())


_OOM = ("OutOfMemoryError", "CUDA out of memory", "MemoryError", "can't allocate memory")


def _is_oom(text: str) -> bool:
    return any(s in text for s in _OOM)


def scan(args: argparse.Namespace, mode: str, dtype_name: str, cueq: bool) -> list[dict[str, Any]]:
    from nvdd.core import RankFailedError, RankTimeoutError, spawn_ranks

    world = 2 if mode == "dd2" else 1
    backend = "nccl" if args.device == "cuda" else "gloo"
    # CPU ranks get one thread each: on a shared machine more threads per rank spin
    # and oversubscribe the cores (ms/step then measures the contention).
    threads = 1 if args.device == "cpu" else max(1, (os.cpu_count() or 1) // world)
    mace = build(args.size, getattr(torch, dtype_name))
    rows: list[dict[str, Any]] = []
    for k in range(args.doublings + 1):
        dims = dims_of(args.start_cells, k)
        n = dims[0] * dims[1] * dims[2]
        if n > args.max_atoms:
            break
        row: dict[str, Any] = {"mode": mode, "ranks": world, "dtype": dtype_name, "atoms": n}
        t0 = time.perf_counter()
        try:
            res = spawn_ranks(
                measure,
                world,
                mode,
                mace,
                dims,
                dtype_name,
                cueq,
                args.steps,
                args.warmup,
                args.device,
                args.skin,
                args.memory_limit_mb,
                backend=backend,
                timeout_s=args.timeout,
                threads_per_rank=threads,
                start_method="spawn",
            )[0]
            row.update(res, status="ok")
        except RankFailedError as exc:
            row.update(status="OOM" if _is_oom(str(exc)) else "error", cueq=cueq)
            row["error"] = str(exc).strip().splitlines()[-1]
        except RankTimeoutError as exc:
            row.update(status="timeout", error=str(exc), cueq=cueq)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        _print_row(row)
        if row["status"] != "ok":
            break
    return rows


def _print_row(r: dict[str, Any]) -> None:
    ms = f"{r['ms_per_step']:10.1f}" if "ms_per_step" in r else f"{'-':>10}"
    peak = f"{max(r['peak_mb']):12.0f}" if "peak_mb" in r else f"{'-':>12}"
    cueq = "on" if r.get("cueq") else "off"
    extra = f"  {r.get('error', '')}" if r["status"] != "ok" else ""
    if any(r.get("ghosts", ())):
        extra += f"  (ghost rows per rank: {r['ghosts']})"
    print(
        f"{r['mode']:<6}{r['ranks']:>6}  {r['dtype']:<8}{cueq:>5}{r['atoms']:>10}{ms}{peak}"
        f"  {r['status']}{extra}",
        flush=True,
    )


def _targets(rows: list[dict[str, Any]]) -> None:
    """The issue's targets from the scans (per dtype and cuEquivariance setting)."""
    keys = sorted({(r["dtype"], bool(r.get("cueq"))) for r in rows})
    for dtype, cueq in keys:
        sel = [r for r in rows if r["dtype"] == dtype and bool(r.get("cueq")) == cueq]
        ok = {
            m: [r for r in sel if r["mode"] == m and r["status"] == "ok"]
            for m in ("plain", "dd1", "dd2", "dd1halo")
        }
        largest = {m: max((r["atoms"] for r in v), default=0) for m, v in ok.items()}
        oom = {m: any(r["mode"] == m and r["status"] == "OOM" for r in sel) for m in ok}
        print(f"\n{dtype}, cuEquivariance {'on' if cueq else 'off'}:")
        for m in ("plain", "dd1", "dd2", "dd1halo"):
            if largest[m]:
                bound = "(next size: OOM)" if oom[m] else "(no OOM reached)"
                print(f"  largest system, {m}: {largest[m]} atoms {bound}")
        if largest["plain"] and largest["dd2"]:
            print(
                f"  DD on 2 ranks holds {largest['dd2'] / largest['plain']:.2f}x the atoms of plain"
            )
        at = {m: {r["atoms"]: r["ms_per_step"] for r in v} for m, v in ok.items()}
        n1 = largest["plain"]
        if n1 and n1 in at["dd2"]:
            print(
                f"  at {n1} atoms: DD-2 is {at['plain'][n1] / at['dd2'][n1]:.2f}x faster than plain"
            )
        common = sorted(set(at["plain"]) & set(at["dd1"]))
        if common:
            n = common[-1]
            print(
                f"  DD-1 overhead at {n} atoms: {100 * (at['dd1'][n] / at['plain'][n] - 1):+.1f}%"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--size", default="medium", choices=sorted(SIZES))
    p.add_argument(
        "--modes", nargs="+", default=["plain", "dd1"], choices=["plain", "dd1", "dd2", "dd1halo"]
    )
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "float64"])
    p.add_argument("--cueq", default="off", choices=["off", "on", "both"])
    p.add_argument("--start-cells", type=int, default=16, help="lattice repeats per axis at first")
    p.add_argument("--doublings", type=int, default=8, help="size doublings after the first")
    p.add_argument("--max-atoms", type=int, default=1 << 24)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--skin", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    p.add_argument("--quick", action="store_true", help="CPU check: tiny model, 64-128 atoms")
    p.add_argument(
        "--memory-limit-mb",
        type=int,
        default=0,
        help="cap each CPU rank's heap (RLIMIT_DATA) to exercise the out-of-memory row",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.size, args.start_cells, args.doublings, args.steps, args.warmup = "tiny", 4, 1, 3, 1
        args.modes = ["plain", "dd1", "dd2"]
        args.dtypes = ["float32", "float64"]
    if args.device == "cuda" and "dd2" in args.modes and torch.cuda.device_count() < 2:
        print(f"dd2 needs 2 GPUs, {torch.cuda.device_count()} visible: dropped", flush=True)
        args.modes = [m for m in args.modes if m != "dd2"]
    cueqs = {"off": [False], "on": [True], "both": [False, True]}[args.cueq]
    print(
        f"MACE {args.size} ({SIZES[args.size]['hidden_irreps']}, r_max {SIZES[args.size]['r_max']} A) "
        f"on silica-like O/Si, {args.device}, {args.steps} NVE steps after {args.warmup}"
    )
    print(
        f"{'mode':<6}{'ranks':>6}  {'dtype':<8}{'cueq':>5}{'atoms':>10}{'ms/step':>10}{'peak MB':>12}  status"
    )
    rows: list[dict[str, Any]] = []
    for dtype_name in args.dtypes:
        for cueq in cueqs:
            for mode in args.modes:
                rows += scan(args, mode, dtype_name, cueq)
    _targets(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
