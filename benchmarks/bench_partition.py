"""Benchmark of nvdd-partition (a script, not a test).

1. Scatter (``ShardedBatch.from_batch``), gather (``gather(0)``) and migration
   (``migrate()`` after a small random displacement, and with nothing to move)
   times against the number of atoms, on 2 and 4 CPU ranks over gloo.
2. Load imbalance (max / mean owned atoms) of even cuts against atom-quantile cuts
   for a slab in a periodic cell with vacuum (with the chosen grid, and with cuts
   forced across the slab) and an off-centre droplet in a large periodic box, on
   2, 4 and 8 ranks.

Usage (from the repository root, with every package importable)::

    python benchmarks/bench_partition.py            # full run (about a minute)
    python benchmarks/bench_partition.py --quick    # smaller sizes

Times are wall-clock seconds, the slowest rank's, median of ``--repeats`` runs.
Ranks run with one intra-op thread each; on a machine with fewer cores than ranks
the ranks share cores, so compare ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["imbalance_table", "main", "time_ranks"]


def _uniform_batch(n: int, seed: int = 0) -> Any:
    from nvdd.core import Batch

    gen = torch.Generator().manual_seed(seed)
    side = (n / 0.05) ** (1.0 / 3.0)  # liquid-like density: 0.05 atoms / A^3
    return Batch(
        torch.rand(n, 3, generator=gen, dtype=torch.float64) * side,
        torch.full((n,), 18, dtype=torch.int64),
        cell=torch.eye(3, dtype=torch.float64) * side,
        pbc=[True, True, True],
        velocities=torch.randn(n, 3, generator=gen, dtype=torch.float64),
    )


def time_ranks(n: int, repeats: int) -> dict[str, list[float]]:
    """Run on every rank: times of scatter, gather, migrate (some move / none move),
    and the atoms moved by the first migration of each repeat."""
    import torch.distributed as dist

    from nvdd.partition import DegeneratePartitionWarning, ShardedBatch, SpatialPartitioner

    warnings.simplefilter("ignore", DegeneratePartitionWarning)
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = _uniform_batch(n) if rank == 0 else None
    part = SpatialPartitioner.from_batch(batch, world, 6.0) if batch is not None else None
    out: dict[str, list[float]] = {
        "scatter": [],
        "gather": [],
        "migrate": [],
        "moved": [],
        "migrate_none": [],
    }

    def timed(key: str, fn: Callable[..., Any], *args: Any) -> Any:
        dist.barrier()
        t0 = time.perf_counter()
        result = fn(*args)
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        out[key].append(float(elapsed))
        return result

    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(repeats):
        sb = timed("scatter", ShardedBatch.from_batch, batch, None, part)
        timed("gather", sb.gather, 0)
        local = sb.local_batch
        step = torch.randn(local.n_atoms, 3, generator=gen, dtype=torch.float64) * 0.3
        sb.update_from_batch(local.replace(positions=local.positions + step), check=False)
        stats = timed("migrate", sb.migrate)
        out["moved"].append(float(stats.n_moved))
        timed("migrate_none", sb.migrate)
    return out


def _slab(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    cell = torch.diag(torch.tensor([40.0, 40.0, 120.0], dtype=torch.float64))
    pos = torch.rand(n, 3, generator=gen, dtype=torch.float64) * torch.tensor([40.0, 40.0, 20.0])
    pos[:, 2] += 10.0  # a 20 A slab, 100 A of vacuum along z
    return cell, pos


def _cluster(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    cell = torch.eye(3, dtype=torch.float64) * 120.0
    pos = torch.randn(n, 3, generator=gen, dtype=torch.float64) * 8.0
    return cell, pos + torch.tensor([35.0, 50.0, 80.0], dtype=torch.float64)


def imbalance_table(n: int) -> list[tuple[str, int, str, float, str, float]]:
    """(system, ranks, uniform grid, uniform imbalance, balanced grid, balanced imbalance)."""
    from nvdd.partition import BalanceMode, SpatialPartitioner

    rows = []
    cases = (("slab", _slab, False), ("slab (z cut)", _slab, True), ("cluster", _cluster, False))
    for name, make, z_cut in cases:
        cell, pos = make(n)
        for world in (2, 4, 8):
            kw: dict[str, Any] = {"grid_dims": (1, 1, world)} if z_cut else {}
            uni = SpatialPartitioner(cell, [True] * 3, world, 6.0, positions=pos, **kw)
            bal = SpatialPartitioner(
                cell, [True] * 3, world, 6.0, positions=pos, balance=BalanceMode.QUANTILE, **kw
            )
            rows.append(
                (
                    name,
                    world,
                    str(uni.grid_dims[0]),
                    uni.imbalance(),
                    str(bal.grid_dims[0]),
                    bal.imbalance(),
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    args = parser.parse_args()
    sizes = args.sizes or ([5_000, 20_000] if args.quick else [10_000, 100_000, 400_000])

    import bench_partition as me  # ranks import this module by name

    from nvdd.testing import run_ranks

    print("## scatter / gather / migrate (s, slowest rank, median)")
    header = ("ranks", "atoms", "scatter", "gather", "migrate", "moved", "no-move")
    print("{:>5} {:>8} {:>9} {:>9} {:>9} {:>7} {:>9}".format(*header))
    for world in args.worlds:
        for n in sizes:
            per_rank = run_ranks(me.time_ranks, world, n, args.repeats, timeout_s=600)
            t = {k: statistics.median(v) for k, v in per_rank[0].items()}
            print(
                f"{world:>5} {n:>8} {t['scatter']:>9.4f} {t['gather']:>9.4f} "
                f"{t['migrate']:>9.4f} {int(t['moved']):>7} {t['migrate_none']:>9.4f}"
            )
    n_imb = 4_000 if args.quick else 40_000
    print(f"\n## load imbalance (max / mean owned atoms), {n_imb} atoms, ghost width 6 A")
    columns = ("system", "ranks", "uniform grid", "uniform", "quantile grid", "quantile")
    print("{:>12} {:>5} {:>13} {:>8} {:>14} {:>9}".format(*columns))
    for name, world, ug, ui, bg, bi in imbalance_table(n_imb):
        print(f"{name:>12} {world:>5} {ug:>13} {ui:>8.3f} {bg:>14} {bi:>9.3f}")


if __name__ == "__main__":
    main()
