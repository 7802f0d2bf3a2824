"""Benchmark: nvdd's MD step against the single-GPU peer loop, single process and DomainParallel.

Lennard-Jones argon (FCC a = 5.26 A, cutoff 8.5 A, skin 1 A), velocity Verlet
(4 fs). For every size and dtype, in ONE run it times:

- **peer**: the loop of ``/work/shared/reference/peer_lj_ops.py`` built from
  nvalchemi-toolkit-ops (its Warp cell-list half neighbour matrix rebuilt every
  10 steps at 9.5 A, its Warp LJ kernel, velocity Verlet as in-place torch ops),
  on the same atoms and velocities. Timed twice: with a device synchronisation
  only around the whole run (``peer``) and around every step as the reference
  script does (``peer (sync/step)``); the faster of the two is the baseline of
  every ratio;
- **raw**: nvdd's single-process ``VelocityVerlet`` + ``LennardJones`` (the Warp
  backend, half and, with ``--lj-list half full``, full neighbour lists), with
  the peak GPU memory per atom (``torch.cuda.max_memory_allocated``); steady
  steps are replayed from a CUDA graph (the default; ``--graphs on off`` also
  times them eagerly);
- **DomainParallel** on each world size of ``--worlds`` (one process per rank:
  gloo on CPU, NCCL on CUDA), with the share of each step spent in halo
  exchange, fold, migration and plan builds (rank 0);

and prints ms/step, **nvdd / peer** (below 1: nvdd is faster), speed-up and
efficiency against the raw run, and bytes per atom; then the time of one
neighbour build of each (the peer's cell list, nvdd's device list rebuilt on
the device, half and full). ``--largest`` instead
doubles the atom count of the raw fp32 run until the GPU runs out of memory
(caught) and reports the largest size that ran, as a row.

GPU (the commands of docs/benchmarks.md; repository root, PYTHONPATH with every
``packages/*/src``, warp-lang and nvalchemi-toolkit-ops importable)::

    # one H200: peer, raw and DomainParallel at 1 GPU; 4,000 to 4M atoms
    python benchmarks/bench_dp.py --device cuda --cells 10 32 63 100 \\
        --dtype float32 float64 --lj-list half full --steps 100 --warmup 20 --worlds 1
    # two H200s (nvidia-h200-x2): the 1M-atom scaling rows
    python benchmarks/bench_dp.py --device cuda --cells 63 --dtype float32 float64 \\
        --steps 100 --warmup 20 --worlds 1 2
    # the largest LJ fp32 system one GPU holds
    python benchmarks/bench_dp.py --device cuda --largest --dtype float32
    # ghost rows only where a neighbour rank is (record 0079): the halo-forced
    # one-rank step with every axis left to the model, against the default
    python benchmarks/bench_dp.py --device cuda --cells 32 63 100 --dtype float32 \
        --steps 100 --warmup 20 --worlds 1 --no-peer --wrap-whole-axes off on

CPU smoke check (the peer runs on Warp's CPU backend too)::

    python benchmarks/bench_dp.py --quick
    python benchmarks/bench_dp.py --cells 10 --steps 40 --worlds 1 2

CPU ranks share the machine's cores: on a 2-core host, 2 ranks can at best
halve the time. Ratios within one run are the result; this is not a test.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import harness

AR_LATTICE, AR_EPSILON, AR_SIGMA, AR_MASS = (
    harness.AR_LATTICE,
    harness.AR_EPSILON,
    harness.AR_SIGMA,
    harness.AR_MASS,
)
KB_EV_PER_K = harness.KB_EV_PER_K
ASE_TIME_PER_FS = 1.0 / 10.180505710774743  # 1 fs in ASE time units (sqrt(amu A^2 / eV))
MODEL = "lj"
CUTOFF = {"lj": 8.5, "mpnn": 5.0}
DT_FS, SKIN, PEER_EVERY = 4.0, 1.0, 10


def _system(cells: int, device: str, dtype: torch.dtype) -> Any:
    """FCC argon at 90 K, built on ``device`` (the peer script's atom order)."""
    return harness.argon_fcc(cells, device=device, dtype=dtype, temperature_K=90.0)


def _model(device: str, dtype: torch.dtype, half_list: bool = True) -> Any:
    from nvdd.models import LennardJones, LJConfig, MPNNConfig, ReferenceMPNN

    if MODEL == "mpnn":
        cfg = MPNNConfig(cutoff=CUTOFF["mpnn"], species=(18,), hidden=32, n_layers=2, skin=SKIN)
        return ReferenceMPNN(cfg, dtype=dtype, device=device)
    config = LJConfig(
        cutoff=8.5,
        epsilon=AR_EPSILON,
        sigma=AR_SIGMA,
        skin=SKIN,
        half_list=half_list,
        atom_virials=os.environ.get(ATOM_VIRIALS_ENV) == "1",
    )
    model = LennardJones(config).to(device=device, dtype=dtype)
    per_cutoff = os.environ.get(CELLS_PER_CUTOFF_ENV)
    if per_cutoff:  # an A/B leg of the device list's cell size (bench_neighbors.py)
        from nvdd.models._device_neighbors import DeviceVerletList

        model._warp.neighbors = DeviceVerletList(
            config.cutoff, SKIN, half=half_list, cells_per_cutoff=int(per_cutoff)
        )
    if os.environ.get(ROW_ORDER_ENV):  # an A/B leg of the build's thread order
        model._warp.neighbors.row_order_build = os.environ[ROW_ORDER_ENV] == "1"
    if os.environ.get(WAIT_BUILDS_ENV) == "1":  # an A/B leg: wait for every host-side build
        _always_wait(model._warp.neighbors)
    return model


def _always_wait(neighbors: Any) -> None:
    """Make ``neighbors`` wait for every host-side build's flags (what it does
    outside DD), whatever the model sets per call (benchmark-only A/B leg)."""
    cls = type(neighbors)
    patched = type(cls.__name__ + "Waiting", (cls,), {})
    patched.wait_for_host_builds = property(lambda self: True, lambda self, value: None)  # type: ignore[attr-defined]
    neighbors.__class__ = patched


#: "1" / "0": the LJ device list builds in row order / cell order (unset: the default).
ROW_ORDER_ENV = "NVDD_BENCH_ROW_ORDER"
#: "1": the LJ device list waits for every host-side build under DD too (an A/B
#: leg of ``DeviceVerletList.wait_for_host_builds``; unset: the model's choice).
WAIT_BUILDS_ENV = "NVDD_BENCH_WAIT_BUILDS"
#: Cells per search radius of the LJ model's device list (unset: the model's own).
CELLS_PER_CUTOFF_ENV = "NVDD_BENCH_CELLS_PER_CUTOFF"
#: "1": Lennard-Jones also returns per-atom virials (``LJConfig.atom_virials``).
ATOM_VIRIALS_ENV = "NVDD_BENCH_ATOM_VIRIALS"


_sync, _reset_memory, _peak = harness.sync, harness.reset_memory, harness.peak_bytes


# --------------------------------------------------------------------- peer
def peer(
    cells: int, steps: int, warmup: int, device: str, dtype_name: str, sync_each_step: bool
) -> dict[str, Any]:
    """The nvalchemi-toolkit-ops loop of peer_lj_ops.py on the same system."""
    import warp as wp
    from nvalchemiops.interactions.lj import lj_energy_forces
    from nvalchemiops.torch.neighbors import neighbor_list

    wp.config.quiet = True
    wp.init()
    dtype = getattr(torch, dtype_name)
    _reset_memory(device)
    batch = _system(cells, device, dtype)
    pos, vel = batch.positions.contiguous(), batch.velocities.contiguous()
    cell = batch.cell.reshape(1, 3, 3).contiguous()
    n = pos.shape[0]
    vec = wp.vec3d if dtype == torch.float64 else wp.vec3f
    mat = wp.mat33d if dtype == torch.float64 else wp.mat33f
    cell_wp = wp.from_torch(cell, dtype=mat)
    energies = torch.zeros(n, dtype=dtype, device=device)
    forces = torch.zeros(n, 3, dtype=dtype, device=device)
    e_wp, f_wp = wp.from_torch(energies), wp.from_torch(forces, dtype=vec)
    pos_wp = wp.from_torch(pos, dtype=vec)  # pos is updated in place: one view
    pbc = torch.ones(1, 3, dtype=torch.bool, device=device)
    state: dict[str, Any] = {}

    def build() -> None:
        nm, nn, sh = neighbor_list(
            pos, cutoff=CUTOFF["lj"] + SKIN, cell=cell, pbc=pbc, method="cell_list", half_fill=True
        )[:3]
        state["nn"] = nn
        state["nm"] = wp.from_torch(nm.to(torch.int32).contiguous())
        state["nn_wp"] = wp.from_torch(nn.to(torch.int32).contiguous())
        state["sh"] = wp.from_torch(sh.to(torch.int32).contiguous(), dtype=wp.vec3i)

    def force() -> None:
        forces.zero_()
        energies.zero_()
        lj_energy_forces(
            pos_wp, cell_wp, AR_EPSILON, AR_SIGMA, CUTOFF["lj"],
            neighbor_matrix=state["nm"], neighbor_matrix_shifts=state["sh"],
            num_neighbors=state["nn_wp"], fill_value=n, half_neighbor_list=True,
            energies_out=e_wp, forces_out=f_wp,
        )  # fmt: skip

    dt = DT_FS * ASE_TIME_PER_FS
    kick = 0.5 * dt / AR_MASS
    build()
    force()

    def step(s: int) -> None:
        vel.add_(forces, alpha=kick)
        pos.add_(vel, alpha=dt)
        if s % PEER_EVERY == 0:
            build()
        force()
        vel.add_(forces, alpha=kick)

    for s in range(warmup):
        step(s)
    _sync(device)
    elapsed = 0.0
    t0 = time.perf_counter()
    for s in range(warmup, warmup + steps):
        if sync_each_step:
            _sync(device)
            t1 = time.perf_counter()
            step(s)
            _sync(device)
            elapsed += time.perf_counter() - t1
        else:
            step(s)
    _sync(device)
    if not sync_each_step:
        elapsed = time.perf_counter() - t0
    return {
        "ms_per_step": 1000 * elapsed / steps,
        "atoms": n,
        "peak_bytes": _peak(device),
        "half_neighbors": float(state["nn"].float().mean()),
        "energy": float(energies.sum()),
    }


# ------------------------------------------------------- neighbour builds
def builds(cells: int, device: str, dtype_name: str, repeats: int = 3) -> dict[str, float]:
    """ms per neighbour build: the peer's cell list and nvdd's device list (a rebuild
    decided on the device, half and full lists), at 9.5 A on the same atoms."""
    from bench_neighbors import moved_positions, peer_build, timed

    from nvdd.models._device_neighbors import DeviceVerletList

    dtype = getattr(torch, dtype_name)
    _reset_memory(device)
    batch = _system(cells, device, dtype)
    moved = moved_positions(batch.positions, repeats)
    sync = functools.partial(_sync, device)
    out: dict[str, float] = {}
    for half in (True, False):
        search = DeviceVerletList(CUTOFF["lj"], SKIN, half=half)
        out[f"nvdd_{'half' if half else 'full'}_ms"] = timed(
            lambda pos, s=search: s(pos, batch.cell, batch.pbc, batch.system_index),
            batch.positions,
            moved,
            sync,
        )
    peer = peer_build(batch, device)
    if peer is not None:
        out["peer_ms"] = timed(peer, batch.positions, moved, sync)
    return out


# ---------------------------------------------------------------------- raw
def raw(
    cells: int,
    steps: int,
    warmup: int,
    device: str,
    dtype_name: str,
    model: str = "lj",
    half_list: bool = True,
    graphs: bool = True,
) -> dict[str, Any]:
    """The single-process integrator without any DD wrapper (``graphs``: steady
    steps replayed from a CUDA graph where they can be)."""
    from nvdd.dynamics import VelocityVerlet

    global MODEL
    MODEL = model
    dtype = getattr(torch, dtype_name)
    _reset_memory(device)
    dyn = VelocityVerlet(
        _model(device, dtype, half_list),
        _system(cells, device, dtype),
        dt_fs=DT_FS,
        cuda_graphs=graphs,
    )
    dyn.run(warmup)
    _sync(device)
    t0 = time.perf_counter()
    dyn.run(steps)
    _sync(device)
    elapsed = time.perf_counter() - t0
    out: dict[str, Any] = {
        "ms_per_step": 1000 * elapsed / steps,
        "atoms": dyn.batch.n_atoms,
        "peak_bytes": _peak(device),
        "energy": float(dyn.batch.energy.sum()),
        "replays": dyn.graphs.replays,
    }
    search = getattr(dyn.model, "device_neighbors", None)
    if search is not None and MODEL == "lj":
        out["builds"] = search.n_builds
        out["capacity"] = search.capacity
    return out


# ----------------------------------------------------------- DomainParallel
def dd(
    cells: int,
    steps: int,
    warmup: int,
    device: str,
    dtype_name: str,
    model: str = "lj",
    halo: bool = False,
    graphs: bool = True,
    wrap: bool = False,
) -> dict[str, Any]:
    """DomainParallel on the ranks of the current process group.

    ms/step is timed without per-phase synchronisation; the phase shares come
    from a second, shorter run with synchronised phase timers. ``halo``: on one
    rank, run the halo path anyway (``DomainConfig(halo_on_one_rank=True)``).
    ``wrap``: leave the periodic axes the rank grid leaves whole to the model
    (``DomainConfig(wrap_whole_axes=True)``, record 0079).
    """
    import torch.distributed as dist

    global MODEL
    MODEL = model
    from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet

    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    _reset_memory(device)
    batch = _system(cells, device, dtype) if rank == 0 else _system(1, device, dtype)
    dyn = VelocityVerlet(_model(device, dtype), batch, dt_fs=DT_FS, cuda_graphs=graphs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DomainConfig(
            cutoff=CUTOFF[MODEL], skin=SKIN, halo_on_one_rank=halo, wrap_whole_axes=wrap
        )
        dp = DomainParallel(dyn, config)
        with dp:
            dp.partition()
            dp.run(warmup)
            if warmup > 0:  # one rebuild in the warm-up: its one-time costs (Warp module
                dp.model.request_rebuild()  # loads of migration and plan) are not timed
                dp.run(1)
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            rebuilds = dp.stats.rebuilds
            dp.run(steps)
            _sync(device)
            dist.barrier()
            elapsed = time.perf_counter() - t0
            rebuilds = dp.stats.rebuilds - rebuilds
            replays = dyn.graphs.replays
            dp.model.sync_timings = True  # (synchronised timers: eager steps)
            for k in dp.stats.seconds:
                dp.stats.seconds[k] = 0.0
            n_share = max(5, min(steps, 20))
            t1 = time.perf_counter()
            dp.run(n_share)
            _sync(device)
            shared = time.perf_counter() - t1
            shares = {k: v / shared for k, v in dp.stats.seconds.items()}
            counts = dp.sharded.owned_counts
            ghosts = dp.stats.n_ghost
    return {
        "ms_per_step": 1000 * elapsed / steps,
        "atoms": int(sum(counts)),
        "shares": shares,
        "owned": counts,
        "ghosts_rank0": ghosts,
        "peak_bytes": _peak(device),
        "replays": replays,
        "rebuilds": rebuilds,
    }


# ------------------------------------------------------------------ largest
def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _dd_row(every: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's DomainParallel result with every rank's peak memory."""
    return {**every[0], "peak_per_rank": [r["peak_bytes"] for r in every]}


def largest(
    device: str, dtype_name: str, start_cells: int, steps: int, world: int = 1
) -> list[dict[str, Any]]:
    """Double the atoms until memory runs out (caught: a row, not a crash); one row
    per size. ``world`` 1: the raw LJ run; more: DomainParallel on that many ranks
    (one GPU each)."""
    from nvdd.core import spawn_ranks

    run = "raw" if world == 1 else "DomainParallel"
    backend = "nccl" if device == "cuda" else "gloo"
    rows: list[dict[str, Any]] = []
    cells = start_cells
    while True:
        try:
            if world == 1:
                res = raw(cells, steps, 2, device, dtype_name)
            else:
                res = _dd_row(spawn_ranks(
                    dd, world, cells, steps, 2, device, dtype_name, "lj", False, True,
                    backend=backend, timeout_s=1800, start_method="spawn",
                ))  # fmt: skip
        except (RuntimeError, MemoryError) as exc:  # (a RankFailedError names the OOM)
            if not _is_oom(exc):
                raise
            rows.append({"run": f"{run} (out of memory)", "ranks": world, "cells": cells,
                         "atoms": 4 * cells**3, "ms_per_step": math.nan, "peak_bytes": 0})  # fmt: skip
            break
        finally:
            _reset_memory(device)
        rows.append({"run": run, "ranks": world, "cells": cells, **res})
        peaks = res.get("peak_per_rank", [res["peak_bytes"]])
        print(f"  {res['atoms']:>12,d} atoms on {world} rank(s): {res['ms_per_step']:.1f} ms/step, "
              f"{sum(peaks) / res['atoms']:.0f} B/atom, peak GiB per rank "
              + " ".join(f"{b / 2**30:.1f}" for b in peaks), flush=True)  # fmt: skip
        cells = math.ceil(cells * 2 ** (1 / 3))
        if device == "cpu" and cells > 2 * start_cells:  # CPU: a smoke check of the loop
            break
    return rows


# --------------------------------------------------------------------- main
def _print(title: str, rows: list[dict[str, Any]]) -> None:
    peers = [r for r in rows if r["run"].startswith("peer")]
    base = min(peers, key=lambda r: r["ms_per_step"]) if peers else None  # the peer's best
    raw_row = next((r for r in rows if r["run"].startswith("raw")), None)
    print(f"\n{title}")
    cols = ("exchange", "fold", "migrate", "plan")
    print(
        f"{'run':<30}{'ranks':>6}{'ms/step':>10}{'nvdd/peer':>10}{'vs raw':>8}{'eff.':>7}"
        f"{'B/atom':>8}" + "".join(f"{c:>9}" for c in cols) + "  peak GiB per rank"
    )
    for r in rows:
        ms = r["ms_per_step"]
        ratio = (
            ms / base["ms_per_step"]
            if base is not None and not r["run"].startswith("peer")
            else math.nan
        )
        speed = raw_row["ms_per_step"] / ms if raw_row is not None else math.nan
        # peak bytes of rank 0 over its owned atoms (the whole system on one rank)
        owned = r.get("owned", [r.get("atoms", 0)])[0] or 1
        per_atom = r.get("peak_bytes", 0) / owned
        shares = r.get("shares", {})
        print(
            f"{r['run']:<30}{r['ranks']:>6}{ms:>10.2f}{ratio:>10.2f}{speed:>8.2f}"
            f"{speed / r['ranks']:>7.2f}{per_atom:>8.0f}"
            + "".join(f"{100 * shares.get(c, 0.0):>8.1f}%" for c in cols)
            + "  "
            + " ".join(f"{b / 2**30:.2f}" for b in r.get("peak_per_rank", [r.get("peak_bytes", 0)]))
        )
    one = next((r for r in rows if r["run"] == "DomainParallel" and r["ranks"] == 1), None)
    replayed = [f"{r['run']} {r['replays']}" for r in rows if r.get("replays")]
    if replayed:
        print("steps replayed from a CUDA graph: " + ", ".join(replayed))
    if one is not None and raw_row is not None:
        print(
            f"DD wrapper overhead at 1 rank: {100 * (one['ms_per_step'] / raw_row['ms_per_step'] - 1):+.1f}%"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cells", type=int, nargs="+", default=[10], help="FCC cells per edge (4 atoms each)"
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--worlds", type=int, nargs="*", default=[1, 2])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", nargs="+", default=["float64"], choices=["float32", "float64"])
    p.add_argument(
        "--model",
        choices=["lj", "mpnn"],
        default="lj",
        help="LJ argon, or the reference MPNN (2 layers, cutoff 5 A) on the same box",
    )
    p.add_argument("--lj-list", nargs="+", default=["half"], choices=["half", "full"],
                   help="neighbour lists of the raw LJ legs (Warp backend)")  # fmt: skip
    p.add_argument("--no-peer", action="store_true", help="skip the nvalchemi-toolkit-ops leg")
    p.add_argument("--graphs", nargs="+", default=["on"], choices=["on", "off"],
                   help="raw and DomainParallel legs with steady steps replayed from a CUDA "
                   "graph (on, the default), eagerly (off), or both")  # fmt: skip
    p.add_argument("--wrap-whole-axes", nargs="+", default=["off"], choices=["off", "on"],
                   help="DomainParallel legs with image rows on every periodic axis (off, the "
                   "default), with the axes the rank grid leaves whole left to the model "
                   "(on: DomainConfig(wrap_whole_axes=True)), or both")  # fmt: skip
    p.add_argument("--largest", action="store_true",
                   help="double the raw LJ system until out of memory (first --dtype)")  # fmt: skip
    p.add_argument("--start-cells", type=int, default=100, help="--largest: first size")
    p.add_argument("--quick", action="store_true", help="--cells 8 --steps 20 (CPU smoke check)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.cells, args.steps = [8], 20
    from nvdd.core import spawn_ranks

    threads = max(1, (os.cpu_count() or 1))
    torch.set_num_threads(threads)
    results: list[dict[str, Any]] = []
    if args.largest:
        start = args.start_cells if args.device != "cpu" else min(args.start_cells, 6)
        n_steps = max(3, min(args.steps, 10))
        world = max(args.worlds or [1])
        rows = largest(args.device, args.dtype[0], start, n_steps, world)
        fitted = [r for r in rows if r["run"] in ("raw", "DomainParallel")]
        if fitted:
            big, last = fitted[-1], rows[-1]
            why = (
                f"{last['atoms']:,d} atoms ran out of memory"
                if "out of memory" in last["run"]
                else "stopped before running out of memory (CPU smoke check)"
            )
            where = f"{world} ranks" if world > 1 else "one process"
            print(
                f"\nlargest LJ {args.dtype[0]} system that ran on {args.device} ({where}): {big['atoms']:,d} "
                f"atoms ({sum(big.get('peak_per_rank', [big['peak_bytes']])) / big['atoms']:.0f} B/atom, "
                f"{big['ms_per_step']:.1f} ms/step); {why}"
            )
        results.extend(rows)
    else:
        peer_ok = not args.no_peer and args.model == "lj"
        for dtype in args.dtype:
            for cells in args.cells:
                rows: list[dict[str, Any]] = []
                if peer_ok:
                    for sync_each in (False, True):
                        res = peer(cells, args.steps, args.warmup, args.device, dtype, sync_each)
                        rows.append(
                            {"run": "peer (sync/step)" if sync_each else "peer", "ranks": 1, **res}
                        )
                lists = args.lj_list if args.model == "lj" else ["half"]
                modes = [g == "on" for g in args.graphs]
                for graphs in modes:
                    tag = "" if graphs or len(modes) == 1 else ", eager"
                    for kind in lists:
                        res = raw(
                            cells,
                            args.steps,
                            args.warmup,
                            args.device,
                            dtype,
                            args.model,
                            kind == "half",
                            graphs,
                        )
                        label = f"raw ({kind} list{tag})" if args.model == "lj" else f"raw{tag}"
                        rows.append({"run": label, "ranks": 1, "graphs": graphs, **res})
                backend = "nccl" if args.device == "cuda" else "gloo"
                for world in args.worlds:
                    per_rank = max(1, threads // world)
                    for graphs in modes if world == 1 else modes[:1]:
                        tag = "" if graphs or len(modes) == 1 else " eager"
                        for halo, wrap in (
                            (h, w == "on")
                            for h in ((False, True) if world == 1 else (False,))
                            for w in args.wrap_whole_axes
                            if h or world > 1 or w == "off"  # (one rank: nothing to wrap)
                        ):
                            every = spawn_ranks(
                                dd, world, cells, args.steps, args.warmup, args.device, dtype,
                                args.model, halo, graphs, wrap, backend=backend, timeout_s=1800,
                                threads_per_rank=per_rank, start_method="spawn",
                            )  # fmt: skip
                            res = _dd_row(every)
                            label = "DomainParallel" + (
                                " (halo forced" + tag + ")" if halo else tag
                            )
                            if wrap:
                                label += " (whole axes wrapped)"
                            rows.append(
                                {"run": label, "ranks": world, "graphs": graphs, "wrap": wrap,
                                 **res}
                            )  # fmt: skip
                atoms = rows[0]["atoms"] if rows else 4 * cells**3
                if args.model == "lj":
                    times = builds(cells, args.device, dtype)
                    print(
                        "\nneighbour build at 9.5 A (ms): "
                        + ", ".join(f"{k.removesuffix('_ms')} {v:.2f}" for k, v in times.items())
                    )
                    results.append({"run": "builds", "cells": cells, "dtype": dtype, **times})
                _print(
                    f"{args.model.upper()} argon, {atoms:,d} atoms, {dtype}, {args.device}, "
                    f"{args.steps} steps (one run; {threads} CPU threads shared by the ranks)",
                    rows,
                )
                for r in rows:
                    r.update(cells=cells, dtype=dtype)
                results.extend(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
