"""Ghost rows per rank of the halo plan, with image rows on every periodic axis
and with the axes the rank grid leaves whole left to the model (record 0079).

Plan only: no model, no process group. For a P-rank grid of the LJ argon box of
``benchmarks/bench_dp.py`` (FCC a = 5.26 A, cutoff 8.5 A, skin 1 A, so the
runtime's ghost width cutoff + skin + skin / 4), the runtime's partitioner
(``SpatialPartitioner.from_batch`` with the grid) assigns the atoms, and every
rank's ghost selection (``nvdd.halo``'s count and fill kernels, as
``build_halo_plan`` runs them) says how many rows it sends to each rank; a rank
holds as ghost rows what every rank sends it. Layouts: ``images``, the default
(image rows across every periodic face); ``wrapped``,
``DomainConfig(wrap_whole_axes=True)``.

    python benchmarks/ghost_rows.py                  # 1M atoms (63^3 cells), 4 grids
    python benchmarks/ghost_rows.py --quick          # 6^3 cells, 2x1x1: seconds

Rows go to ``benchmarks/results/ghost-rows-lj.json``; ``benchmarks/render.py``
renders them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import harness

CUTOFF, SKIN = 8.5, 1.0
GRIDS = ("2x1x1", "2x2x1", "2x2x2", "4x2x1")
LAYOUTS = ("images", "wrapped")


def ghost_rows(
    batch: Any, grid: tuple[int, int, int], ghost_width: float, wrapped: bool
) -> tuple[list[int], list[int]]:
    """(owned rows, ghost rows) of every rank of ``grid`` (rank order)."""
    from nvdd.halo import ParticleHaloConfig
    from nvdd.halo._select import SelectBackend, select_ghosts
    from nvdd.partition import SpatialPartitioner

    world = grid[0] * grid[1] * grid[2]
    part = SpatialPartitioner.from_batch(batch, world, ghost_width, grid_dims=grid)
    config = ParticleHaloConfig(
        boxes=part.boxes,
        pbc=part.pbc,
        ghost_width=ghost_width,
        wrapped=part.whole_axes if wrapped else None,
    )
    positions = part.wrap_positions(batch.positions)
    owner = part.owner_of(positions)
    cell = part.domain_cell(batch.cell).to(positions.dtype)
    recv = torch.zeros(world, dtype=torch.int64)
    owned = []
    for r in range(world):
        rows = (owner == r).nonzero().flatten()
        owned.append(int(rows.numel()))
        selection, _, message = select_ghosts(
            config,
            positions[rows].contiguous(),
            batch.atom_ids[rows].contiguous(),
            batch.system_index[rows].contiguous(),
            cell,
            r,
            SelectBackend.WARP,
        )
        if selection is None:
            raise RuntimeError(f"rank {r}: {message}")
        recv += selection.send_counts
    return owned, recv.tolist()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", type=int, default=63, help="FCC cells per axis (63: 1M atoms)")
    p.add_argument("--grids", nargs="+", default=list(GRIDS))
    p.add_argument("--quick", action="store_true", help="6^3 cells, 2x1x1 (seconds)")
    p.add_argument("--out", default=str(harness.RESULTS))
    p.add_argument("--name", default="ghost-rows-lj")
    args = p.parse_args(argv)
    if args.quick:
        args.cells, args.grids = 6, ["2x1x1"]
    batch = harness.argon_fcc(args.cells, device="cpu", dtype=torch.float64)
    ghost_width = CUTOFF + SKIN + SKIN / 4  # DomainConfig(cutoff, skin): + the hysteresis
    rows: list[dict[str, Any]] = []
    for spec in args.grids:
        grid = tuple(int(x) for x in spec.split("x"))
        assert len(grid) == 3
        for layout in LAYOUTS:
            t0 = time.perf_counter()
            owned, ghosts = ghost_rows(batch, grid, ghost_width, layout == "wrapped")  # type: ignore[arg-type]
            row = {
                "atoms": batch.n_atoms,
                "cells": args.cells,
                "grid": spec,
                "ranks": len(owned),
                "layout": layout,
                "ghost_width": ghost_width,
                "owned": owned,
                "ghost": ghosts,
                "ghost_max": max(ghosts),
                "ghost_mean": sum(ghosts) / len(ghosts),
                "seconds": time.perf_counter() - t0,
            }
            print({k: v for k, v in row.items() if k not in ("owned", "ghost")}, flush=True)
            rows.append(row)
    command = "python benchmarks/ghost_rows.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    path = harness.write_result(
        args.name,
        title="LJ argon: ghost rows per rank of the halo plan, image rows on every "
        "periodic axis or the whole axes left to the model",
        command=command.strip(),
        rows=rows,
        benchmark="benchmarks/ghost_rows.py",
        out_dir=Path(args.out),
        note=f"plan only (no model); ghost width {ghost_width} A = cutoff {CUTOFF} + skin "
        f"{SKIN} + hysteresis {SKIN / 4}",
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
