"""Benchmark of nvdd-halo (a script, not a test).

Three modes (all by default except ``kernels`` off a GPU host's default device):

``ranks``
    Plan build, forward (positions, float64) and reverse (forces) times against
    atoms per rank, on 2 CPU ranks over gloo (slab cut of a periodic cubic cell).
``kernels``
    Single process, on ``--device`` (``cuda`` on a GPU host): every step of a
    plan build (fractional transform, count, fill) with the Warp kernels and with
    the pure-torch reference, and the ghost fold (Warp CSR kernel vs
    ``index_add_``), with bytes moved / time to compare with the memory bandwidth.
``overhead``
    Ghost rows per owned row with explicit images, for a few cubic boxes and
    cuts, measured with the plan's own counting, next to the analytic count of a
    halo that keeps PBC in the neighbour list on unpartitioned axes.

Usage (from the repository root, with every package importable)::

    python benchmarks/bench_halo.py                   # ranks + kernels + overhead (CPU)
    python benchmarks/bench_halo.py --mode kernels --device cuda --sizes 1e5 1e6 4e6
    python benchmarks/bench_halo.py --quick           # smaller sizes

Times are wall-clock medians of ``--repeats`` runs (CUDA: synchronised; ranks: the
slowest rank's). Compare ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["kernel_table", "main", "overhead_table", "rank_times"]

_DENSITY = 0.05  # atoms / A^3, liquid-like


def _median_time(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up (and compiles)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _system(
    n_total: int, cuts: list[list[float]], seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniform atoms in a periodic cube at liquid density, with grid boxes."""
    gen = torch.Generator().manual_seed(seed)
    side = (n_total / _DENSITY) ** (1.0 / 3.0)
    pos = torch.rand(n_total, 3, generator=gen, dtype=torch.float64) * side
    cell = torch.eye(3, dtype=torch.float64)[None] * side
    edges = [[0.0, *c, 1.0] for c in cuts]
    boxes = [
        [
            [edges[0][i], edges[1][j], edges[2][k]],
            [edges[0][i + 1], edges[1][j + 1], edges[2][k + 1]],
        ]
        for i in range(len(edges[0]) - 1)
        for j in range(len(edges[1]) - 1)
        for k in range(len(edges[2]) - 1)
    ]
    return pos, cell, torch.tensor(boxes, dtype=torch.float64)[None]


def rank_times(n_per_rank: int, ghost_width: float, repeats: int) -> dict[str, float]:
    """Run on every rank: plan build, forward and reverse times (seconds)."""
    import torch.distributed as dist

    from nvdd.halo import ParticleHaloConfig, build_halo_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    pos, cell, boxes = _system(n_per_rank * world, [[r / world for r in range(1, world)], [], []])
    frac = pos / cell[0, 0, 0]
    mine = ((frac[:, 0] >= boxes[0, rank, 0, 0]) & (frac[:, 0] < boxes[0, rank, 1, 0])).nonzero()
    rows = mine.flatten()
    x = pos[rows].contiguous()
    ids = rows.clone()
    sysi = torch.zeros_like(ids)
    cfg = ParticleHaloConfig(
        boxes=boxes, pbc=torch.ones(1, 3, dtype=torch.bool), ghost_width=ghost_width
    )
    cpu = torch.device("cpu")

    def build() -> Any:
        dist.barrier()
        return build_halo_plan(cfg, x, ids, sysi, cell)

    plan = build()
    forces = torch.randn(plan.n_ghost, 3, dtype=torch.float64)

    def fwd() -> None:
        dist.barrier()
        plan.ghost_positions(x, cell)

    def rev() -> None:
        dist.barrier()
        plan.reverse(forces)

    return {
        "n_owned": float(plan.n_owned),
        "n_ghost": float(plan.n_ghost),
        "build": _median_time(build, repeats, cpu),
        "forward": _median_time(fwd, repeats, cpu),
        "reverse": _median_time(rev, repeats, cpu),
    }


def _rank_table(sizes: list[int], ghost_width: float, repeats: int) -> None:
    from nvdd.testing import run_ranks

    print(f"\n## ranks: 2 CPU ranks over gloo, slab cut, ghost_width {ghost_width} A, float64")
    print("| atoms/rank | ghosts/rank | build ms | forward ms | reverse ms |")
    print("|---:|---:|---:|---:|---:|")
    for n in sizes:
        out = run_ranks(rank_times, 2, n, ghost_width, repeats, timeout_s=600)
        worst = {k: max(o[k] for o in out) for k in ("build", "forward", "reverse")}
        ghosts = statistics.mean(o["n_ghost"] for o in out)
        print(
            f"| {n} | {ghosts:.0f} | {worst['build'] * 1e3:.2f} | "
            f"{worst['forward'] * 1e3:.3f} | {worst['reverse'] * 1e3:.3f} |"
        )


def _kernel_steps(
    n: int, device: torch.device, ghost_width: float
) -> list[tuple[str, Callable[[], Any], Callable[[], Any], float]]:
    """(name, warp call, torch call, bytes moved) of every plan-build step."""
    from nvdd.halo import ParticleHaloConfig, _kernels, _reference, _select

    pos, cell, boxes = _system(n, [[0.5], [0.5], [0.5]])
    cfg = ParticleHaloConfig(
        boxes=boxes, pbc=torch.ones(1, 3, dtype=torch.bool), ghost_width=ghost_width
    )
    x = pos.to(device).contiguous()
    sysi = torch.zeros(n, dtype=torch.int64, device=device)
    ids = torch.arange(n, device=device)
    inv = torch.linalg.inv(cell).to(device).contiguous()
    frac, _ = _kernels.compute_fractional(x, sysi, inv)
    elo, ehi = _select.expanded_boxes(cfg, cell)
    cand = torch.arange(8, dtype=torch.int32, device=device)
    ok = torch.ones(1, 8, dtype=torch.int32, device=device)
    per = torch.ones(1, 3, dtype=torch.int32, device=device)
    sel = (frac, sysi, cand, ok, elo.to(device).contiguous(), ehi.to(device).contiguous(), per)
    counts, _ = _kernels.count_images(*sel, 0)
    flat = counts.reshape(-1).long()
    offsets = (torch.cumsum(flat, 0) - flat).reshape(counts.shape)
    total = int(flat.sum())
    fill_args = (sel[0], sel[1], ids, *sel[2:], 0, offsets, total)
    meta, _ = _kernels.fill_images(*fill_args)
    # The fold of ghost forces into owners (the reverse exchange's local part).
    index = meta[:, 0].contiguous()
    values = torch.randn(total, 3, dtype=torch.float64, device=device)
    perm = torch.argsort(index, stable=True)
    rows = index[perm].contiguous()
    out = torch.zeros(n, 3, dtype=torch.float64, device=device)
    return [
        (
            "fractional",
            lambda: _kernels.compute_fractional(x, sysi, inv),
            lambda: _reference.compute_fractional_torch(x, sysi, inv),
            n * (24 + 8 + 24),
        ),
        (
            "count (8 ranks)",
            lambda: _kernels.count_images(*sel, 0),
            lambda: _reference.count_images_torch(*sel, 0),
            n * 24 + 8 * n * 4,
        ),
        (
            f"fill ({total} rows)",
            lambda: _kernels.fill_images(*fill_args),
            lambda: _reference.fill_images_torch(*fill_args),
            n * 24 + 8 * n * 8 + total * 48,
        ),
        (
            "fold (reverse)",
            lambda: _kernels.fold_rows(values, rows, perm, out.zero_()),
            lambda: out.zero_().index_add_(0, index, values),
            total * (24 + 8) + n * 24 * 2,
        ),
        (
            "gather (forward; torch both)",
            lambda: x.index_select(0, index),
            lambda: x.index_select(0, index),
            total * (24 + 8 + 24),
        ),
    ]


def kernel_table(sizes: list[int], device: torch.device, repeats: int, ghost_width: float) -> None:
    """Single-process plan-build steps and the fold, Warp against torch."""
    print(f"\n## kernels on {device} (rank 0 of a 2x2x2 grid, ghost_width {ghost_width} A)")
    print("| atoms | step | warp ms | torch ms | warp GB/s | torch GB/s |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in sizes:
        for name, warp_fn, torch_fn, nbytes in _kernel_steps(n, device, ghost_width):
            tw = _median_time(warp_fn, repeats, device)
            tt = _median_time(torch_fn, repeats, device)
            print(
                f"| {n} | {name} | {tw * 1e3:.3f} | {tt * 1e3:.3f} | "
                f"{nbytes / tw / 1e9:.1f} | {nbytes / tt / 1e9:.1f} |"
            )


def overhead_table(n_total: int, ghost_width: float) -> None:
    """Ghost rows / owned rows: explicit images (measured) vs PBC kept on
    unpartitioned axes (analytic, uniform density)."""
    from nvdd.halo import ParticleHaloConfig, _select

    side = (n_total / _DENSITY) ** (1.0 / 3.0)
    print(f"\n## ghost-row overhead, cubic cell {side:.1f} A, {n_total} atoms, gw {ghost_width} A")
    print("| cut | box (A) | explicit images: ghosts/owned | PBC on uncut axes: ghosts/owned |")
    print("|---|---|---:|---:|")
    grids = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 2, 2), (4, 4, 4)]
    for grid in grids:
        cuts = [[i / g for i in range(1, g)] for g in grid]
        pos, cell, boxes = _system(n_total, cuts)
        cfg = ParticleHaloConfig(
            boxes=boxes, pbc=torch.ones(1, 3, dtype=torch.bool), ghost_width=ghost_width
        )
        frac = pos / side
        lo, hi = boxes[0, 0, 0], boxes[0, 0, 1]
        mine = ((frac >= lo) & (frac < hi)).all(dim=1)
        sel, _, msg = _select.select_ghosts(
            cfg,
            pos[mine].contiguous(),
            torch.arange(int(mine.sum())),
            torch.zeros(int(mine.sum()), dtype=torch.int64),
            cell,
            rank=0,
        )
        if sel is None:
            raise RuntimeError(msg)
        explicit = sel.meta.shape[0] / int(mine.sum())
        widths = [side / g for g in grid]
        kept = 1.0
        for g, w in zip(grid, widths, strict=True):
            kept *= (w + 2 * ghost_width) / w if g > 1 else 1.0
        box = " x ".join(f"{w:.1f}" for w in widths)
        print(f"| {grid[0]}x{grid[1]}x{grid[2]} | {box} | {explicit:.2f} | {kept - 1.0:.2f} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=["all", "ranks", "kernels", "overhead"], default="all")
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", type=float, nargs="*", default=None, help="atoms (kernels mode)")
    p.add_argument("--ghost-width", type=float, default=6.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    gw = args.ghost_width
    if args.mode in ("all", "ranks"):
        _rank_table([1000, 4000] if args.quick else [1000, 4000, 16000, 64000], gw, args.repeats)
    if args.mode in ("all", "kernels"):
        sizes = (
            [int(s) for s in args.sizes]
            if args.sizes
            else ([10000] if args.quick else [10000, 100000])
        )
        kernel_table(sizes, torch.device(args.device), args.repeats, gw)
    if args.mode in ("all", "overhead"):
        overhead_table(8000 if args.quick else 64000, gw)


if __name__ == "__main__":
    main()
