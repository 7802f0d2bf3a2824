"""The device neighbour list's build against the peer's cell list, by cell size.

ms per build of the half list at the LJ search radius (cutoff + skin = 9.5 A)
on FCC argon, every atom moved by a random 0.7 A between builds (the first call
compiles, allocates and sizes; it is not timed). Legs: ``DeviceVerletList`` with
1, 2 and 3 cells per search radius (``cells_per_cutoff``), and the
nvalchemi-toolkit-ops cell list (``half_fill=True``) when it is installed; with
one cell per radius also the build in row order (``row_order_build``, "_rows").

    python benchmarks/bench_neighbors.py --device cuda --cells 32 63 100 --dtype float32 float64
    python benchmarks/bench_neighbors.py --cells 6            # CPU smoke check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import harness


def moved_positions(positions: torch.Tensor, repeats: int) -> list[torch.Tensor]:
    """``repeats`` copies of ``positions``, every atom moved by a random 0.7 A
    (seeded: the same moves in every leg)."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    noise = [
        0.7 * torch.randn(positions.shape, generator=gen, dtype=positions.dtype)
        for _ in range(repeats)
    ]
    return [positions + n.to(positions.device) for n in noise]


def timed(fn: Any, first: torch.Tensor, moved: list[torch.Tensor], device: str) -> float:
    """ms per call of ``fn`` over ``moved`` (after one call on ``first``), timed by
    the shared harness between two device synchronisations."""
    fn(first)
    queue = iter(moved)

    def run(n: int) -> None:
        for _ in range(n):
            fn(next(queue))

    return harness.time_steps(run, len(moved), 0, device)


def legs(
    cells: int, device: str, dtype_name: str, repeats: int, per_cutoff: list[int]
) -> dict[str, Any]:
    from bench_dp import CUTOFF, SKIN, _system

    from nvdd.models._device_neighbors import DeviceVerletList

    dtype = getattr(torch, dtype_name)
    batch = _system(cells, device, dtype)
    moved = moved_positions(batch.positions, repeats)
    out: dict[str, Any] = {
        "cells": cells,
        "atoms": int(batch.positions.shape[0]),
        "dtype": dtype_name,
    }
    counts = {}
    legs = [(k, False) for k in per_cutoff] + [(k, True) for k in per_cutoff if k == 1]
    for k, rows in legs:
        search = DeviceVerletList(CUTOFF["lj"], SKIN, half=True, cells_per_cutoff=k)
        search.row_order_build = rows

        def call(pos: torch.Tensor, s: Any = search) -> Any:
            return s(pos, batch.cell, batch.pbc, batch.system_index)

        name = f"nvdd_c{k}{'_rows' if rows else ''}"
        out[name + "_ms"] = timed(call, batch.positions, moved, device)
        m = call(moved[-1])  # (reused: the same positions)
        counts[name] = int(m.counts.clamp(min=0).sum())
    out["pairs_equal"] = len(set(counts.values())) == 1
    peer = peer_build(batch, device)
    if peer is not None:
        out["peer_ms"] = timed(peer, batch.positions, moved, device)
    return out


def peer_build(batch: Any, device: str) -> Any:
    """The peer's half cell-list build at the LJ search radius on ``batch``'s cell
    (a function of the positions), or None without nvalchemi-toolkit-ops."""
    from bench_dp import CUTOFF, SKIN

    try:
        from nvalchemiops.torch.neighbors import neighbor_list
    except ImportError:
        return None
    cell = batch.cell.reshape(1, 3, 3).contiguous()
    pbc = torch.ones(1, 3, dtype=torch.bool, device=device)

    def build(pos: torch.Tensor) -> Any:
        return neighbor_list(
            pos, cutoff=CUTOFF["lj"] + SKIN, cell=cell, pbc=pbc, method="cell_list", half_fill=True
        )

    return build


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--cells", type=int, nargs="+", default=[6])
    p.add_argument("--dtype", nargs="+", default=["float32"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--per-cutoff", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for dtype in args.dtype:
        for cells in args.cells:
            row = legs(cells, args.device, dtype, args.repeats, args.per_cutoff)
            rows.append(row)
            print(
                f"{row['atoms']:>10,d} atoms {dtype}: "
                + ", ".join(
                    f"{k.removesuffix('_ms')} {v:.2f}" for k, v in row.items() if k.endswith("_ms")
                )
                + f" ms per build; pair counts equal across cell sizes: {row['pairs_equal']}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
