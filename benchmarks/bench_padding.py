"""Benchmark: compilations and step time of a compiled forward, padded vs unpadded.

One "rank" of a graph-partition run: atoms random-walk in a box, the rank holds
the atoms of the left half plus a halo of width ``cutoff``, and builds a COO
edge list every step, so both its atom and its edge count drift. A toy pair
model (gather, pair term, scatter to atoms) runs compiled in three ways:

- ``padded``: :class:`nvdd.padding.COOPadder` pads to grow-only capacities, the
  forward is compiled with ``dynamic=False`` (one shape); ``padded-nocheck``: the
  same without the index-range check (one host sync less);
- ``static``: unpadded, ``dynamic=False``: a compilation per new shape;
- ``dynamic``: unpadded, torch's automatic dynamic shapes (symbolic sizes after
  the second shape).

Usage::

    python bench_padding.py --steps 100 --atoms 1500 --backend count
    python bench_padding.py --backend inductor --device cuda --json out.json

``--backend count`` counts compilations and runs the captured graphs eagerly
(cheap, any machine); ``inductor`` really compiles (slow on CPU), optionally
with ``--compile-mode reduce-overhead`` (CUDA graphs, which need fixed shapes). Ratios, not
absolute numbers, are the result; it is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
from torch._dynamo.utils import counters

from nvdd.padding import COOGraph, COOPadder

CUTOFF = 2.5


def energies(
    positions: torch.Tensor,
    edge_index: torch.Tensor,
    edge_mask: torch.Tensor,
    atom_mask: torch.Tensor,
) -> torch.Tensor:
    """Per-atom energies of a smooth pair term, masked."""
    vec = positions[edge_index[1]] - positions[edge_index[0]]
    r = torch.linalg.vector_norm(vec, dim=-1)
    keep = edge_mask & (r < CUTOFF)
    e = torch.where(keep, 0.5 * (CUTOFF - r) ** 2 / r, 0.0)
    out = torch.zeros(positions.shape[0], dtype=positions.dtype, device=positions.device)
    return torch.where(atom_mask, out.index_add(0, edge_index[1], e), 0.0)


def energies_plain(
    positions: torch.Tensor,
    edge_index: torch.Tensor,
    edge_mask: torch.Tensor,
    atom_mask: torch.Tensor,
) -> torch.Tensor:
    """The same computation under its own code object (dynamo state is per code)."""
    vec = positions[edge_index[1]] - positions[edge_index[0]]
    r = torch.linalg.vector_norm(vec, dim=-1)
    keep = edge_mask & (r < CUTOFF)
    e = torch.where(keep, 0.5 * (CUTOFF - r) ** 2 / r, 0.0)
    out = torch.zeros(positions.shape[0], dtype=positions.dtype, device=positions.device)
    return torch.where(atom_mask, out.index_add(0, edge_index[1], e), 0.0)


class Counting:
    """A backend that counts compilations and runs the captured graph eagerly."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.compiles += 1
        return gm.forward


def trajectory(n_atoms: int, steps: int, device: str, seed: int = 0) -> list[COOGraph]:
    """The rank's local graph at every step (built up front, not timed)."""
    g = torch.Generator().manual_seed(seed)
    box = (n_atoms / 0.05) ** (1 / 3)  # 0.05 atoms / A^3
    pos = torch.rand(n_atoms, 3, generator=g, dtype=torch.float64) * box
    graphs = []
    for _ in range(steps):
        pos = (pos + 0.15 * torch.randn(n_atoms, 3, generator=g, dtype=torch.float64)).clamp(0, box)
        local = pos[pos[:, 0] < box / 2 + CUTOFF].to(device)
        d = torch.cdist(local, local, compute_mode="donot_use_mm_for_euclid_dist")
        d.fill_diagonal_(float("inf"))
        ei = torch.stack(torch.nonzero(d < CUTOFF, as_tuple=True))
        graphs.append(COOGraph(ei, local.shape[0], {"positions": local}))
    return graphs


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(
    mode: str, graphs: list[COOGraph], backend: str, device: str, compile_mode: str | None
) -> dict[str, Any]:
    torch.compiler.reset()
    counters["stats"].clear()
    counter = Counting()
    padded = mode.startswith("padded")
    fn = energies if padded else energies_plain
    dynamic = None if mode == "dynamic" else False
    if backend == "count":
        compiled = torch.compile(fn, backend=counter, dynamic=dynamic)
    else:
        compiled = torch.compile(fn, backend=backend, mode=compile_mode, dynamic=dynamic)
    padder = COOPadder(check_indices=mode != "padded-nocheck")
    times, pad_times = [], []
    wasted = []
    t_all = time.perf_counter()
    for g in graphs:
        sync(device)
        t0 = time.perf_counter()
        if padded:
            p = padder.pad(g)
            t_pad = time.perf_counter()
            out = compiled(p.atom_fields["positions"], p.edge_index, p.edge_mask, p.atom_mask)
            wasted.append(1 - g.n_edges / p.edge_cap)
        else:
            t_pad = t0
            ones_e = torch.ones(g.n_edges, dtype=torch.bool, device=device)
            ones_a = torch.ones(g.n_atoms, dtype=torch.bool, device=device)
            out = compiled(g.atom_fields["positions"], g.edge_index, ones_e, ones_a)
        sync(device)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        pad_times.append(t_pad - t0)
        del out
    total = time.perf_counter() - t_all
    tail = times[len(times) // 2 :]
    return {
        "mode": mode,
        "compiles": counter.compiles if backend == "count" else counters["stats"]["unique_graphs"],
        "capacity_growths": padder.registry.n_growths() if padded else None,
        "total_s": round(total, 3),
        "steady_step_ms": round(1e3 * statistics.median(tail), 3),
        "pad_ms": round(1e3 * statistics.median(pad_times), 3) if padded else None,
        "edge_padding_fraction": round(statistics.mean(wasted), 3) if wasted else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--atoms", type=int, default=1500)
    ap.add_argument("--backend", choices=["count", "inductor"], default="count")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", default="padded,static,dynamic")
    ap.add_argument("--compile-mode", default=None, help="e.g. reduce-overhead (CUDA graphs)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    # let "static" recompile at every step instead of falling back to eager
    for name, value in (
        ("recompile_limit", args.steps + 1),
        ("accumulated_recompile_limit", 10 * (args.steps + 1)),
    ):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, value)
    graphs = trajectory(args.atoms, args.steps, args.device)
    atoms = [g.n_atoms for g in graphs]
    edges = [g.n_edges for g in graphs]
    header = {
        "steps": args.steps,
        "backend": args.backend,
        "compile_mode": args.compile_mode,
        "device": args.device,
        "torch": torch.__version__,
        "local_atoms": [min(atoms), max(atoms)],
        "local_edges": [min(edges), max(edges)],
        "distinct_shapes": len(set(zip(atoms, edges, strict=True))),
    }
    results = [
        run(m, graphs, args.backend, args.device, args.compile_mode) for m in args.modes.split(",")
    ]
    print(json.dumps(header))
    for r in results:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"setup": header, "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
