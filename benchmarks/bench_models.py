"""Benchmark of nvdd-models: neighbour-list libraries and model forward+forces time.

Not a test: it prints timings measured in one run: the best of ``--repeats``
rounds, competitors interleaved round by round; CPU time of the process on the
CPU device (every path runs on one thread, and CPU time is what a loaded shared
machine disturbs least), wall time with synchronisation on CUDA. Ratios between
columns are the point; absolute numbers depend on the machine.

Sections
--------
1. Neighbour-list libraries on perturbed FCC argon (a = 5.26 A), full lists with
   shifts at ``--nl-cutoff``: vesin (raw and through ``nvdd.models.NeighborList``)
   against nvalchemi-toolkit-ops (Warp cell list and naive, when installed), for
   one system of growing size and for a batch of small periodic systems.
2. Models: energy + forces + stress of ``LennardJones`` (direct and autograd
   forces, cutoff 8.5 A) and ``ReferenceMPNN`` (cutoff 5 A, width 32, 2 layers,
   float64 and float32) against the number of atoms, with a neighbour search on
   every call (skin 0, atoms moved) and with a cached Verlet list (the model
   alone plus the per-call cutoff filter).
3. Domain decomposition (CPU, gloo): the same models inside a live DD context on
   ``--dd-ranks`` ranks (slabs along x, a halo plan from nvdd-halo, the model's
   Verlet list cached, forces folded into owners as the runtime does): the
   slowest rank's wall time per call against the single-process model on the
   whole system; for the MPNN also a variant whose per-layer exchange is a
   refresh only (``refresh_neighbors`` instead of ``scatter_to_owners``), with
   its forces checked equal. Needs nvdd-halo and nvdd-testing on the path.

Usage (from the repository root)::

    PYTHONPATH=$(ls -d packages/*/src | tr '\\n' :) python benchmarks/bench_models.py
    ... --device cuda --sizes 4000 32000 108000   # on a GPU host
    ... --quick                                    # a smoke run (small sizes)
    ... --skip neighbors models --dd-sizes 864 2048  # the DD section alone
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from nvdd.core import Batch
from nvdd.models import (
    ForceMode,
    LennardJones,
    LJConfig,
    MPNNConfig,
    NeighborList,
    ReferenceMPNN,
)

FCC_A = 5.26  # Angstrom, argon
LJ = LJConfig(cutoff=8.5, species={18: (0.0104, 3.40)})


def fcc(k: int, seed: int = 0, jitter: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """``4 k**3`` atoms of FCC argon in a periodic cube, displaced at random."""
    basis = torch.tensor(
        [[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]], dtype=torch.float64
    )
    r = torch.arange(k, dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(r, r, r, indexing="ij"), dim=-1).reshape(-1, 3)
    pos = (grid[:, None, :] + basis[None]).reshape(-1, 3) * FCC_A
    gen = torch.Generator().manual_seed(seed)
    pos = pos + jitter * torch.randn(pos.shape, generator=gen, dtype=torch.float64)
    return pos, torch.eye(3, dtype=torch.float64) * FCC_A * k


def fcc_k(n_atoms: int) -> int:
    """The FCC edge (in cells) whose atom count is closest to ``n_atoms``."""
    return max(1, round((n_atoms / 4) ** (1 / 3)))


def _clock(device: torch.device) -> Callable[[], float]:
    """CPU time of this process on the CPU device (every timed path runs on one
    thread, and CPU time ignores the waits a shared machine imposes); wall time
    on CUDA."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def timed_together(
    fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Best time of each function in seconds, the functions interleaved round by
    round so that a change of load on the machine hits them all alike."""
    clock = _clock(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = clock()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[name] = min(best[name], clock() - t0)
    return best


def _ms(times: dict[str, float]) -> dict[str, float]:
    return {f"{name}_ms": 1e3 * t for name, t in times.items()}


# ----------------------------------------------------------- neighbour lists
def _nvalchemiops() -> Any | None:
    try:
        from nvalchemiops.torch import neighbors
    except ImportError:
        return None
    return neighbors


def _nvalchemi_search(
    nv: Any,
    pos: torch.Tensor,
    cell: torch.Tensor,
    pbc: torch.Tensor,
    cutoff: float,
    method: str,
    **kw: Any,
) -> int:
    """One nvalchemi-toolkit-ops COO search; regrows ``max_neighbors`` on overflow."""
    max_neighbors = kw.pop("max_neighbors", 160)
    while True:
        try:
            out = nv.neighbor_list(
                pos,
                cutoff,
                cell=cell,
                pbc=pbc,
                return_neighbor_list=True,
                method=method,
                max_neighbors=max_neighbors,
                **kw,
            )
            return int(out[0].shape[1])
        except nv.NeighborOverflowError:
            max_neighbors *= 2


def bench_neighbors(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    import vesin

    rows: list[dict[str, Any]] = []
    nv = _nvalchemiops()
    rc = args.nl_cutoff
    nl = NeighborList(rc)
    raw = vesin.NeighborList(cutoff=rc, full_list=True)
    for n in args.sizes:
        pos, cell = fcc(fcc_k(n))
        pos, cell = pos.to(device), cell.to(device)
        pbc = torch.ones(1, 3, dtype=torch.bool, device=device)
        si = torch.zeros(pos.shape[0], dtype=torch.int64, device=device)
        row: dict[str, Any] = {"n_atoms": int(pos.shape[0])}
        edges = nl(pos, cell[None], pbc, si)
        row["n_edges"] = edges.n_edges
        fns: dict[str, Callable[[], Any]] = {
            "nvdd_vesin": partial(nl, pos, cell[None], pbc, si),
            "vesin_raw": partial(raw.compute, pos, cell, pbc[0], "PS"),
        }
        if nv is not None:
            methods = ["cell_list"] + (["naive"] if pos.shape[0] <= 4000 else [])
            for method in methods:
                pairs = _nvalchemi_search(nv, pos, cell[None], pbc, rc, method)
                if pairs != edges.n_edges:
                    raise RuntimeError(
                        f"nvalchemiops {method} found {pairs} pairs, vesin {edges.n_edges}"
                    )
                fns[f"nvalchemiops_{method}"] = partial(
                    _nvalchemi_search, nv, pos, cell[None], pbc, rc, method
                )
        row.update(_ms(timed_together(fns, device, args.repeats)))
        rows.append(row)
        print(json.dumps({"neighbors": row}), flush=True)
    # A batch of small periodic systems (cells smaller than twice the cutoff).
    for n_sys in args.batch_systems:
        parts = [fcc(3, seed=s) for s in range(n_sys)]
        pos = torch.cat([p for p, _ in parts]).to(device)
        cells = torch.stack([c for _, c in parts]).to(device)
        pbc = torch.ones(n_sys, 3, dtype=torch.bool, device=device)
        si = torch.arange(n_sys, device=device).repeat_interleave(parts[0][0].shape[0])
        row = {
            "batch": f"{n_sys} x {parts[0][0].shape[0]}",
            "n_edges": nl(pos, cells, pbc, si).n_edges,
        }
        fns = {"nvdd_vesin": partial(nl, pos, cells, pbc, si)}
        if nv is not None:
            bi = si.to(torch.int32)
            for method in ("batch_cell_list", "batch_naive"):
                fns[f"nvalchemiops_{method}"] = partial(
                    _nvalchemi_search, nv, pos, cells, pbc, rc, method, batch_idx=bi
                )
        row.update(_ms(timed_together(fns, device, args.repeats)))
        rows.append(row)
        print(json.dumps({"neighbors_batch": row}), flush=True)
    return rows


# -------------------------------------------------------------------- models
def _models(
    device: torch.device,
) -> dict[str, tuple[Callable[[float], torch.nn.Module], torch.dtype]]:
    mpnn = MPNNConfig(cutoff=5.0, species=(18,), hidden=32, n_basis=8, n_layers=2)

    def lj(mode: ForceMode) -> Callable[[float], torch.nn.Module]:
        return lambda skin: LennardJones(
            LJConfig(cutoff=LJ.cutoff, species=LJ.species, force_mode=mode, skin=skin)
        ).to(device)

    return {
        "lj_direct_f64": (lj(ForceMode.DIRECT), torch.float64),
        "lj_autograd_f64": (lj(ForceMode.AUTOGRAD), torch.float64),
        "mpnn_f64": (
            lambda skin: ReferenceMPNN(
                MPNNConfig(**{**mpnn.__dict__, "skin": skin}), device=device
            ),
            torch.float64,
        ),
        "mpnn_f32": (
            lambda skin: ReferenceMPNN(
                MPNNConfig(**{**mpnn.__dict__, "skin": skin}), dtype=torch.float32, device=device
            ),
            torch.float32,
        ),
    }


def _call_moved(model: torch.nn.Module, batch: Batch, counter: Iterator[int]) -> Any:
    """Call ``model`` on slightly moved positions (a new position forces a search)."""
    return model(batch.replace(positions=batch.positions + 1e-4 * (next(counter) % 7 + 1)))


def bench_models(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in args.sizes:
        pos, cell = fcc(fcc_k(n))
        for name, (make, dtype) in _models(device).items():
            batch = Batch(
                pos.to(device, dtype),
                torch.full((pos.shape[0],), 18, device=device),
                cell=cell.to(device, dtype),
                pbc=[True, True, True],
            )
            fresh, cached = make(0.0), make(1.0)
            row: dict[str, Any] = {"model": name, "n_atoms": int(pos.shape[0])}
            fns = {
                "with_search": partial(_call_moved, fresh, batch, itertools.count()),
                "cached_list": partial(cached, batch),
            }
            row.update(_ms(timed_together(fns, device, args.repeats)))
            if cached.neighbors.n_builds != 1:  # type: ignore[union-attr]
                raise RuntimeError("the cached model rebuilt its neighbour list")
            rows.append(row)
            print(json.dumps({"models": row}), flush=True)
    return rows


# ------------------------------------------------------ domain decomposition
def _dd_model(kind: str) -> torch.nn.Module:
    if kind == "lj_direct_f64":
        return LennardJones(LJConfig(cutoff=LJ.cutoff, species=LJ.species, skin=1.0))
    return ReferenceMPNN(MPNNConfig(cutoff=5.0, species=(18,), hidden=32, n_basis=8, skin=1.0))


def _dd_rank(kind: str, n_atoms: int, repeats: int) -> dict[str, Any]:
    """Rank function: best wall time of one DD forward (+ fold) on this rank."""
    import torch.distributed as dist

    from nvdd import models
    from nvdd.halo import ParticleHaloConfig, build_halo_plan
    from nvdd.shardtensor import DDContext, dd_scope, refresh_neighbors

    rank, world = dist.get_rank(), dist.get_world_size()
    pos, cell = fcc(fcc_k(n_atoms))
    frac = pos @ torch.linalg.inv(cell)
    frac = frac - torch.floor(frac)
    owned = (torch.floor(frac[:, 0] * world) == rank).nonzero().squeeze(1)
    cuts = torch.arange(world + 1, dtype=torch.float64) / world
    boxes = torch.zeros(1, world, 2, 3, dtype=torch.float64)
    boxes[0, :, 1] = 1.0
    boxes[0, :, 0, 0], boxes[0, :, 1, 0] = cuts[:-1], cuts[1:]
    pbc = torch.ones(1, 3, dtype=torch.bool)
    model = _dd_model(kind)
    cutoff = float(model.cutoff)  # type: ignore[arg-type]
    cells = cell.unsqueeze(0)
    x = (frac @ cell)[owned]
    ids = owned.clone()
    plan = build_halo_plan(
        ParticleHaloConfig(boxes=boxes, pbc=pbc, ghost_width=cutoff + 1.0),
        x,
        ids,
        torch.zeros_like(ids),
        cells,
        backend="torch",
    )
    n = plan.n_owned
    padded = Batch(
        torch.cat([x, plan.ghost_positions(x, cells)]),
        torch.full((plan.n_padded,), 18),
        cell=cells,
        pbc=torch.zeros(1, 3, dtype=torch.bool),
        atom_ids=torch.cat([ids, plan.ghost_atom_ids]),
        validate=False,
    )
    autograd = kind.startswith("mpnn")

    def step() -> torch.Tensor:
        leaf = padded.positions.detach().requires_grad_(autograd)
        with dd_scope(DDContext(layout=plan, positions=leaf)):
            f = model(padded.replace(positions=leaf))["forces"]
        return f[:n] + plan.reverse(f[n:])

    def best() -> tuple[float, torch.Tensor]:
        out = step()  # warm-up (and the list's build)
        t_best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            out = step()
            t_best = min(t_best, time.perf_counter() - t0)
        return t_best, out

    row: dict[str, Any] = {"n_owned": n, "n_ghost": plan.n_ghost}
    t_fold, forces = best()
    row["dd_forward_ms"] = 1e3 * t_fold
    if autograd:
        fold = models._mpnn.scatter_to_owners
        models._mpnn.scatter_to_owners = refresh_neighbors  # type: ignore[attr-defined]
        try:
            t_refresh, forces_refresh = best()
        finally:
            models._mpnn.scatter_to_owners = fold  # type: ignore[attr-defined]
        row["refresh_only_ms"] = 1e3 * t_refresh
        row["refresh_max_dF"] = float((forces_refresh - forces).abs().max())
    return row


def bench_dd(args: argparse.Namespace) -> list[dict[str, Any]]:
    from nvdd.testing import run_ranks

    rows: list[dict[str, Any]] = []
    for n in args.dd_sizes:
        pos, cell = fcc(fcc_k(n))
        batch = Batch(pos, torch.full((pos.shape[0],), 18), cell=cell, pbc=[True, True, True])
        for kind in ("lj_direct_f64", "mpnn_f64"):
            model = _dd_model(kind)
            model(batch)  # warm-up (and the list's build)
            single = float("inf")
            for _ in range(args.repeats):  # wall time, as on the ranks
                t0 = time.perf_counter()
                model(batch)
                single = min(single, time.perf_counter() - t0)
            per_rank = run_ranks(_dd_rank, args.dd_ranks, kind, n, args.repeats, timeout_s=600)
            row: dict[str, Any] = {
                "model": kind,
                "n_atoms": int(pos.shape[0]),
                "ranks": args.dd_ranks,
                "max_n_ghost": max(r["n_ghost"] for r in per_rank),
                "single_process_ms": 1e3 * single,
            }
            for key in ("dd_forward_ms", "refresh_only_ms", "refresh_max_dF"):
                if key in per_rank[0]:
                    row[key] = max(r[key] for r in per_rank)
            rows.append(row)
            print(json.dumps({"dd": row}), flush=True)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[108, 256, 500, 864, 2048, 4000])
    parser.add_argument("--batch-systems", type=int, nargs="*", default=[8, 32])
    parser.add_argument(
        "--nl-cutoff", type=float, default=9.0, help="library comparison cutoff (A)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch and vesin CPU threads")
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 repeats")
    parser.add_argument("--skip", nargs="*", default=[], choices=["neighbors", "models", "dd"])
    parser.add_argument("--dd-sizes", type=int, nargs="*", default=[864, 2048])
    parser.add_argument("--dd-ranks", type=int, default=2)
    parser.add_argument("--json", help="also write every row to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.batch_systems, args.repeats = [108, 500], [4], 2
        args.dd_sizes = [500]
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    header = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
    }
    print(json.dumps({"header": header}), flush=True)
    results: dict[str, Any] = {"header": header}
    if "neighbors" not in args.skip:
        results["neighbors"] = bench_neighbors(args, device)
    if "models" not in args.skip:
        results["models"] = bench_models(args, device)
    if "dd" not in args.skip and args.dd_sizes:
        results["dd"] = bench_dd(args)
    for key in ("neighbors", "models", "dd"):
        if key in results:
            clock = "CPU time" if device.type == "cpu" and key != "dd" else "wall time"
            where = f"cpu, {args.dd_ranks} gloo ranks" if key == "dd" else header["device"]
            print(f"\n## {key} ({where}, {args.threads} thread(s), {clock}, ms)\n")
            print(_table(results[key]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
