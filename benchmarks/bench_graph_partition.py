"""Benchmark: the graph-partition strategy (per-layer exchange options, GP vs HALO).

Part 1, ``--part exchange``: under ``StrategyKind.GRAPH_PARTITION`` every layer of
a message-passing model must make the node features its edges read current. On
the real ghost sets of an argon box (index blocks in Z-order, and in a random
atom order for contrast), it times three ways of doing it for ``F`` features:

- ``sparse``: the request plan's refresh (one ``all_to_all_single`` of exactly
  the rows each rank's edges read), what the runtime does;
- ``allgather``: ``all_gather_into_tensor`` of every block (padded to the largest),
  then the ghost rows picked locally (what a full all-gather costs);
- ``alltoall-dense``: every block to every rank through ``all_to_all_single``.

Part 2, ``--part step``: the reference MPNN (2 layers, cutoff 5 A) under
DomainParallel, HALO and GRAPH_PARTITION, ms/step and ghost rows per rank.

Usage::

    python benchmarks/bench_graph_partition.py --quick           # CPU, gloo
    python benchmarks/bench_graph_partition.py --cells 12 --worlds 2 4 --features 32 128
    python benchmarks/bench_graph_partition.py --part step --device cuda --cells 29 --worlds 1 2

Alternating repeats within one run; ratios are the result, not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

CUTOFF, SKIN = 5.0, 1.0


def _box(cells: int, order: str) -> Any:
    from nvalchemi.distributed._demo import argon_box

    b = argon_box(cells, dtype=torch.float64, temperature_K=90.0, seed=0)
    if order == "random":
        g = torch.Generator().manual_seed(1)
        b = b.replace(atom_ids=torch.randperm(b.n_atoms, generator=g))
    return b


def _ways(
    plan: Any,
    x: torch.Tensor,
    counts: tuple[int, ...],
    ghosts: torch.Tensor,
    slot: torch.Tensor,
    world: int,
    n_max: int,
) -> dict[str, Any]:
    """The three exchanges of ``x`` (``[owned | ghost]`` rows), each returning the
    refreshed rows. **Collective** (every rank calls the same one)."""
    import torch.distributed as dist

    from nvdd.dynamics._graph_partition import replicate_rows

    n_own = plan.n_owned
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    buf = torch.empty(world * n_max, x.shape[1], dtype=x.dtype)

    def sparse() -> torch.Tensor:
        return plan.refresh(x)  # type: ignore[no-any-return]

    def allgather() -> torch.Tensor:
        own = torch.zeros(n_max, x.shape[1], dtype=x.dtype)
        own[:n_own] = x[:n_own]
        gather(buf, own)
        return torch.cat([x[:n_own], buf.index_select(0, slot)])

    def dense() -> torch.Tensor:
        every = replicate_rows(x[:n_own], counts, None)
        return torch.cat([x[:n_own], every.index_select(0, ghosts)])

    return {"sparse": sparse, "allgather": allgather, "alltoall-dense": dense}


def exchange(cells: int, features: list[int], repeats: int, order: str) -> dict[str, Any]:
    """Every rank: the GP plan of the box, then the three exchanges, timed."""
    import torch.distributed as dist

    from nvdd.dynamics._graph_partition import replicate_rows
    from nvdd.halo import build_request_plan
    from nvdd.partition import IndexShardedBatch, graph_ghosts

    rank, world = dist.get_rank(), dist.get_world_size()
    batch = _box(cells, order) if rank == 0 else None
    sharded = IndexShardedBatch.from_batch(
        batch, None, 0, order="space" if order == "space" else "id"
    )
    local, part = sharded.local_batch, sharded.partitioner
    counts = part.counts()
    pos = replicate_rows(local.positions, counts, None)
    si = replicate_rows(local.system_index[:, None], counts, None)[:, 0]
    owned = torch.zeros(part.n_items, dtype=torch.bool)
    start, stop = sharded.bounds
    owned[start:stop] = True
    ghosts = graph_ghosts(pos, si, local.cell, local.pbc, owned, CUTOFF + SKIN)
    owner = part.owner_of(ghosts)
    offsets = torch.tensor(part.offsets())
    plan = build_request_plan(owner, ghosts - offsets[owner], local.n_atoms)
    n_max = max(counts)
    out: dict[str, Any] = {"n_owned": local.n_atoms, "n_ghost": plan.n_ghost, "ms": {}}
    for f in features:
        x = torch.randn(plan.n_padded, f, dtype=torch.float32)
        # the global row of every ghost inside an all-gathered (world * n_max, f) buffer
        slot = owner * n_max + (ghosts - offsets[owner])
        ways = _ways(plan, x, counts, ghosts, slot, world, n_max)
        ref = ways["sparse"]()
        for name, fn in ways.items():
            torch.testing.assert_close(fn(), ref, rtol=0, atol=0, msg=name)  # same rows
        total = dict.fromkeys(ways, 0.0)
        for _ in range(repeats):
            for name, fn in ways.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                total[name] += time.perf_counter() - t0
        out["ms"][f] = {k: 1000 * v / repeats for k, v in total.items()}
    return out


def step(cells: int, steps: int, warmup: int, device: str = "cpu") -> dict[str, Any]:
    """Every rank: MPNN MD under HALO and under GRAPH_PARTITION, alternating chunks
    (``device="cuda"``: one GPU per rank, NCCL)."""
    import torch.distributed as dist

    from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet
    from nvdd.models import MPNNConfig, ReferenceMPNN
    from nvdd.spec import StrategyKind

    rank = dist.get_rank()
    dev = f"cuda:{torch.cuda.current_device()}" if device == "cuda" else "cpu"

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    runs: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind in (StrategyKind.HALO, StrategyKind.GRAPH_PARTITION):
            cfg = MPNNConfig(cutoff=CUTOFF, species=(18,), hidden=32, n_layers=2, skin=SKIN)
            batch = _box(cells if rank == 0 else 1, "space").to(dev, torch.float32)
            model = ReferenceMPNN(cfg).to(device=dev, dtype=torch.float32)
            dyn = VelocityVerlet(model, batch, dt_fs=4.0)
            dp = DomainParallel(dyn, DomainConfig(cutoff=CUTOFF, skin=SKIN, strategy=kind))
            dp.partition()
            dp.run(warmup)
            runs[kind.value] = dp
        seconds = dict.fromkeys(runs, 0.0)
        for _ in range(4):
            for name, dp in runs.items():
                sync()
                t0 = time.perf_counter()
                dp.run(max(1, steps // 4))
                sync()
                seconds[name] += time.perf_counter() - t0
        out = {
            name: {
                "ms_per_step": 1000 * seconds[name] / (4 * max(1, steps // 4)),
                "n_owned": dp.stats.n_owned,
                "n_ghost": dp.stats.n_ghost,
            }
            for name, dp in runs.items()
        }
        for dp in runs.values():
            dp.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["exchange", "step", "both"], default="both")
    p.add_argument("--cells", type=int, default=10)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--features", type=int, nargs="+", default=[32, 128])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="--cells 6 --worlds 2 --repeats 10")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="the step part on one GPU per rank (NCCL); the exchange part is CPU only")  # fmt: skip
    a = p.parse_args()
    if a.quick:
        a.cells, a.worlds, a.repeats, a.steps = 6, [2], 10, 8
    from nvdd.core import spawn_ranks

    os.environ["OMP_NUM_THREADS"] = "1"
    n_atoms = 4 * a.cells**3
    if a.part in ("exchange", "both") and a.device == "cpu":
        print(
            f"\nper-layer exchange under GRAPH_PARTITION, argon {n_atoms} atoms, float32 features"
        )
        print(
            f"{'order':>7}{'ranks':>6}{'owned':>7}{'ghosts':>8}{'F':>5}"
            f"{'sparse ms':>11}{'allgather ms':>14}{'a2a-dense ms':>14}"
        )
        for order in ("space", "random"):
            for world in a.worlds:
                res = spawn_ranks(
                    exchange,
                    world,
                    a.cells,
                    a.features,
                    a.repeats,
                    order,
                    timeout_s=1800,
                    threads_per_rank=1,
                )
                worst = max(res, key=lambda r: r["n_ghost"])
                for f in a.features:
                    ms = {k: max(r["ms"][f][k] for r in res) for k in worst["ms"][f]}
                    print(
                        f"{order:>7}{world:>6}{worst['n_owned']:>7}{worst['n_ghost']:>8}{f:>5}"
                        f"{ms['sparse']:>11.3f}{ms['allgather']:>14.3f}"
                        f"{ms['alltoall-dense']:>14.3f}"
                    )
    if a.part in ("step", "both"):
        print(f"\nMPNN MD step (eager, float32, {a.device}), argon {n_atoms} atoms, "
              "HALO vs GRAPH_PARTITION")  # fmt: skip
        print(f"{'ranks':>6}{'halo ms':>10}{'ghosts':>8}{'gp ms':>9}{'ghosts':>8}")
        for world in a.worlds:
            res = spawn_ranks(
                step, world, a.cells, a.steps, a.warmup, a.device, timeout_s=3600,
                threads_per_rank=1, backend="nccl" if a.device == "cuda" else "gloo",
                start_method="spawn" if a.device == "cuda" else "forkserver",
            )  # fmt: skip
            h = max(r["halo"]["ms_per_step"] for r in res)
            g = max(r["graph_partition"]["ms_per_step"] for r in res)
            hg = max(r["halo"]["n_ghost"] for r in res)
            gg = max(r["graph_partition"]["n_ghost"] for r in res)
            print(f"{world:>6}{h:>10.1f}{hg:>8}{g:>9.1f}{gg:>8}")


if __name__ == "__main__":
    main()
