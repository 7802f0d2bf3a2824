"""Predict the P-GPU domain-decomposed LJ step from one GPU.

No multi-GPU machine is needed: for a P-rank grid of a periodic argon box, each
rank's steady step is run on this one device in turn, on that rank's real rows:

- its owned atoms (a uniform grid of boxes in fractional coordinates) and its
  ghost rows, chosen as the runtime chooses them: every periodic image of
  every atom within the ghost width (cutoff + skin) of the box, on all six faces
  (layout ``faces``, the default), or with the axes the grid leaves whole left
  to the model's neighbour list (layout ``split``:
  ``DomainConfig(wrap_whole_axes=True)``, record 0079);
- the Lennard-Jones model with its own device neighbour list on ``[owned | ghost]``
  with open boundaries, called as a rank's runtime calls it (under a DD context
  the model counts owned receivers only: ``n_receivers`` = the owned rows, so the
  list holds the pairs with an owned end, none between two ghosts, and ghost
  rows have no list of their own), driven by the velocity-Verlet integrator
  (CUDA graphs as in the raw run), its ghost rows held at rest (on a rank they
  move with their owners; see :func:`~benchmarks.scaling_ranks.hold_ghosts`);
- the pack (gather of the ghost sources), the exchange replaced by a device copy of
  the same bytes, the unpack, the force fold (into the owners) where the model's
  spec folds forces (not LJ's direct forces: each rank's owned rows are
  complete, ``folds`` False, record 0093) and the per-step skin check with its
  host read.

Each rank's step is timed twice. ``step_ms``, the prediction's term: the whole
steady step as the runtime runs it (:class:`~benchmarks.scaling_ranks.RankStep`): the decision (skin test
and non-finite flag) in the captured head, its host read, then the exchange,
the padded rows, the model, and the fold by the runtime's kernel in the
captured tail; eager where the runtime's step is eager; the integrator holds
the owned rows alone, as a rank's does. And each phase alone
(``model_ms``: the integrator and model without the halo; ``exchange_ms``,
``fold_ms``, ``check_ms``: torch operations launched eagerly, one phase at a
time; ``total_ms`` their sum), which says where the step goes. The sum
overstates a captured step (eager launches, a drained queue per phase); it
was the prediction's term before ``step_ms`` (``predicted_by_phases_ms`` keeps it).

The predicted P-GPU step is the slowest rank (``step_ms``) plus a communication term:
``latency + bytes / bandwidth`` for the forward (positions) exchange of the
rank that sends most, twice where the spec folds forces (the reverse exchange;
``exchanges``), plus one small all-reduce. The
default figures are stated assumptions for one NVLink node of H100/H200 SXM
GPUs: 900 GB/s of NVLink per GPU in the vendor's datasheet is 450 GB/s per
direction, of which NCCL's all-to-all is taken to reach 2/3 (300 GB/s); 20 us
per ``all_to_all_single`` and 15 us per small all-reduce (NCCL small-message
latency inside one node). Override them with ``--bandwidth-gbs``,
``--latency-us`` and ``--allreduce-us``.

Before any timing, each rank's rows are checked: the forces on its owned atoms
from the open ``[owned | ghost]`` system, with the rank's owned-receiver list
(``ghost_forces=False``: complete forces on owned rows), equal the forces of the
whole periodic system (a wrong ghost set would make the prediction meaningless),
both with every atom displaced a little (:func:`displaced`: on the perfect
lattice most forces vanish by symmetry, so a missing or misplaced ghost could
go unseen).
Each rank's row also records ``pairs``, the entries of its neighbour list.

    python benchmarks/predict_scaling.py --device cuda --cells 63 100 --dtype float32 float64
    python benchmarks/predict_scaling.py --quick          # CPU, seconds
    python benchmarks/predict_scaling.py --device cuda --model mace --cells 48 \\
        --dtype float32 --grids 2x1x1 2x2x1 2x2x2 --cueq    # MACE medium, 110k atoms
    python benchmarks/predict_scaling.py --quick --model mace   # tiny MACE on the CPU

``--model mpnn`` (the reference MPNN on the same argon) and ``--model mace``
(MACE of benchmarks/bench_mace.py's ``--mace-size`` shape, random weights, on its
silica-like box of ``cells**3`` sites; ``--cueq`` for cuEquivariance's kernels)
run each rank's model inside a DD context whose ghost rows copy owned rows, with
the model's spec adapters installed (their ghost rows held at rest too), and add one exchange of the ghosts'
features per refresh and per fold to the communication term.

Memory (issue 36's capacity target): on CUDA each run also records its GPU peak,
``peak_bytes``: ``torch.cuda.max_memory_allocated`` over the run (its system's
rows, the integrator, the model's neighbour list built afresh, its warm-up and
timed steps) less the bytes allocated when it began (the whole system the script
holds, the model's weights; the previous rank's tensors are freed and the
allocator's cache emptied first; None on the CPU). The fixed per-process costs are
thus left out on both sides: the CUDA context is not in the allocator's count, and
the libraries' one-time workspaces (cuBLAS, cuEquivariance, Warp's modules) are
allocated by the full-system force call before any measured run. Each grid row's
``capacity_ratio`` is how many atoms P GPUs hold relative to one::

    P x (raw peak / raw atoms) / max over ranks (rank peak / rank owned atoms)

assuming memory grows linearly with rows at fixed density, with no intercept
(:func:`capacity_ratio`). The assumption errs on the safe side: a fixed
workspace per run weighs more on a rank's fewer rows, and at the larger sizes
that fill a GPU a rank's ghost rows are a smaller share of its owned ones.
Allocator slack (reserved but unallocated bytes) is taken to scale with the rest.

Rows go to ``benchmarks/results/scaling-predicted-lj.json`` (``--out``); the
benchmarks page renders them (``benchmarks/render.py``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import harness
from benchmarks.scaling_ranks import Owned, RankStep, Scoped, hold_ghosts
from nvdd.dynamics._provider import folds_forces

CUTOFF, SKIN, DT_FS = 8.5, 1.0, 4.0
#: The rank grids of the tables (the runtime's default for a cube splits x, then y, then z).
GRIDS = ("2x1x1", "2x2x1", "2x2x2", "4x2x1")
#: Ghost layouts: ``faces``, the runtime's default (image rows on all six faces);
#: ``split``, image rows only across axes the grid splits, the whole axes left
#: periodic to the model's neighbour list (``DomainConfig(wrap_whole_axes=True)``).
LAYOUTS = ("faces", "split")
#: Phases of a rank's step, in ms, each timed alone (``total_ms``: their sum), and
#: ``step_ms``: the whole step as the runtime runs it (the prediction's term).
PHASES = ("model_ms", "exchange_ms", "fold_ms", "check_ms", "total_ms")
STEP = "step_ms"
SHIFTS = [(a, b, c) for a in (-1, 0, 1) for b in (-1, 0, 1) for c in (-1, 0, 1)]


#: The reference MPNN's shape (as benchmarks/bench_dp.py runs it).
MPNN = {"cutoff": 5.0, "hidden": 32, "n_layers": 2}
#: MACE's shape (a size of benchmarks/bench_mace.py: ``medium``, or ``tiny`` for CPU checks)
#: and whether it runs cuEquivariance's kernels; set by ``main`` (``--mace-size``, ``--cueq``).
MACE: dict[str, Any] = {"size": "medium", "cueq": False}
#: MACE's time step (fs), as benchmarks/bench_mace.py runs it.
MACE_DT_FS = 0.5


def _mace_shape() -> tuple[int, int]:
    """MACE's ghost-feature width (floats per row of ``node_feats``) and interactions."""
    from e3nn import o3

    from benchmarks.bench_mace import SIZES

    size = SIZES[MACE["size"]]
    return o3.Irreps(size["hidden_irreps"]).dim, int(size.get("num_interactions", 2))


def system(kind: str, cells: int, device: str, dtype: torch.dtype) -> Any:
    """The benchmark system of ``kind``: FCC argon (``cells**3`` cubic cells) for LJ
    and the MPNN, the silica-like box of benchmarks/bench_mace.py (``cells**3``
    sites) for MACE."""
    if kind == "mace":
        from benchmarks.bench_mace import silica

        return silica((cells, cells, cells), dtype, device)
    return harness.argon_fcc(cells, device=device, dtype=dtype, temperature_K=90.0)


def _model(device: str, dtype: torch.dtype, kind: str = "lj") -> Any:
    from nvdd.models import LennardJones, LJConfig, MPNNConfig, ReferenceMPNN

    if kind == "mace":
        from benchmarks.bench_mace import build
        from nvdd.models import MACEModel

        mace = build(MACE["size"], dtype)
        return MACEModel(mace, dtype=dtype, device=device, cueq=MACE["cueq"], skin=SKIN)
    if kind == "mpnn":
        config = MPNNConfig(
            cutoff=MPNN["cutoff"],
            species=(18,),
            hidden=MPNN["hidden"],
            n_layers=MPNN["n_layers"],
            skin=SKIN,
        )
        return ReferenceMPNN(config, dtype=dtype, device=device)

    config = LJConfig(cutoff=CUTOFF, epsilon=harness.AR_EPSILON, sigma=harness.AR_SIGMA, skin=SKIN)
    return LennardJones(config).to(device=device, dtype=dtype)


def rank_rows(
    frac: torch.Tensor,
    grid: Sequence[int],
    coords: Sequence[int],
    width: torch.Tensor,
    layout: str = "faces",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of the rank at ``coords`` of ``grid``: ``(owned, ghost_src, ghost_shift)``.

    ``frac``: fractional positions in [0, 1); ``width``: the ghost width in
    fractional units per axis; ``layout``: see :data:`LAYOUTS`. ``ghost_src``
    indexes ``frac``; ``ghost_shift`` is the integer image shift of each ghost row.
    """
    g = torch.tensor(list(grid), dtype=frac.dtype, device=frac.device)
    c = torch.tensor(list(coords), dtype=frac.dtype, device=frac.device)
    lo, hi = c / g, (c + 1) / g
    owned = ((frac >= lo) & (frac < hi)).all(dim=1)
    whole = [n == 1 for n in grid]
    if layout == "split":  # no rows across a whole axis: the model wraps it
        width = torch.where(torch.tensor(whole, device=frac.device), 0.0, width)
    src, shift = [], []
    for s in SHIFTS:
        if layout == "split" and any(w and k for w, k in zip(whole, s, strict=True)):
            continue
        st = torch.tensor(s, dtype=frac.dtype, device=frac.device)
        f = frac + st
        near = ((f >= lo - width) & (f < hi + width)).all(dim=1)
        if s == (0, 0, 0):
            near &= ~owned
        idx = torch.nonzero(near).flatten()
        src.append(idx)
        shift.append(st.expand(idx.numel(), 3))
    return torch.nonzero(owned).flatten(), torch.cat(src), torch.cat(shift)


#: The check's displacement of every atom: normal, this many Angstrom per
#: component, clipped at twice that (so at most 0.17 A, below half the skin:
#: the ghost rows chosen from the undisplaced positions still hold every pair).
SHAKE = 0.05


def displaced(batch: Any, seed: int = 1) -> Any:
    """``batch`` with every atom moved a little (:data:`SHAKE`), drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    d = (SHAKE * torch.randn(batch.positions.shape, generator=g, dtype=torch.float64)).clamp(
        -2 * SHAKE, 2 * SHAKE
    )
    return batch.replace(positions=batch.positions + d.to(batch.positions))


def local_system(
    batch: Any,
    owned: torch.Tensor,
    src: torch.Tensor,
    shift: torch.Tensor,
    pbc: Sequence[bool] = (False, False, False),
) -> Any:
    """The ``[owned | ghost]`` system of one rank (open, or periodic along ``pbc``)."""
    from nvdd.core import Batch

    cell = batch.cell[0]
    pos = torch.cat([batch.positions[owned], batch.positions[src] + shift @ cell])
    rows = torch.cat([owned, src])
    return Batch(
        positions=pos,
        atomic_numbers=batch.atomic_numbers[rows],
        masses=batch.masses[rows],
        velocities=batch.velocities[rows],
        cell=cell,
        pbc=list(pbc),
    )


def list_pairs(model: Any, local: Any, n_owned: int) -> int:
    """Entries of the owned-receiver neighbour list of the LJ ``model`` on ``local``
    (each pair with an owned end once; a pair of two ghosts is never listed)."""
    matrix = model.device_neighbors(
        local.positions, local.cell, local.pbc, local.system_index, n_receivers=n_owned
    )
    return int(matrix.counts.clamp(min=0).sum())


def forget_lists(model: Any) -> None:
    """Drop the neighbour lists ``model`` caches, with their buffers (the next call
    builds anew): a run's peak then counts its own list, not the last system's."""
    reset = getattr(model, "reset_neighbors", None)
    if callable(reset):  # LJ: its list and the Warp backend's
        reset()
        return
    for value in vars(model).values():  # MACE's Verlet list, the MPNN's and its device edges
        if type(value).__name__ in ("VerletList", "DeviceVerletList", "DeviceEdges"):
            value.reset()


def memory_mark(device: str) -> int | None:
    """Start a peak measurement: garbage collected, the allocator's cache emptied,
    its peak counter reset. The bytes allocated now (None off CUDA)."""
    harness.reset_memory(device)
    return int(torch.cuda.memory_allocated()) if str(device).startswith("cuda") else None


def peak_since(device: str, mark: int | None) -> int | None:
    """GPU peak bytes allocated since :func:`memory_mark` beyond its ``mark``."""
    if mark is None:
        return None
    harness.sync(device)
    return harness.peak_bytes(device) - mark


def capacity_ratio(
    raw_peak: int | None, raw_atoms: int, per_rank: Sequence[dict[str, Any]]
) -> float | None:
    """How many atoms ``len(per_rank)`` GPUs hold relative to one:
    ``P x (raw_peak / raw_atoms) / max over ranks (peak_bytes / owned)``, memory
    taken to grow linearly with rows at fixed density, with no intercept (see the
    module notes). None when a peak is missing (the CPU) or not positive."""
    if not per_rank or raw_peak is None or raw_peak <= 0 or raw_atoms <= 0:
        return None
    worst = 0.0  # the most bytes per owned atom of any rank
    for r in per_rank:
        peak, owned = r.get("peak_bytes"), r["owned"]
        if peak is None or peak <= 0 or owned <= 0:
            return None
        worst = max(worst, peak / owned)
    return len(per_rank) * (raw_peak / raw_atoms) / worst


def _timed(fn: Callable[[], Any], steps: int, warmup: int, device: str) -> float:
    """ms per call of ``fn`` over ``steps`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    harness.sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    harness.sync(device)
    return 1000.0 * (time.perf_counter() - t0) / steps


def check_rank(model: Any, full_forces: torch.Tensor, owned: torch.Tensor, local: Any) -> float:
    """max |F_local(owned) - F_periodic(owned)|: zero up to rounding when the ghost
    set is complete (the rank's owned-receiver list; owned rows complete, no fold)."""
    n = owned.numel()
    out = model(local, n_receivers=n, ghost_forces=False)
    return float((out["forces"][:n] - full_forces[owned]).abs().max()) if n else 0.0


def time_rank(
    model: Any,
    batch: Any,
    owned: torch.Tensor,
    src: torch.Tensor,
    shift: torch.Tensor,
    *,
    steps: int,
    warmup: int,
    device: str,
    graphs: bool,
    pbc: Sequence[bool] = (False, False, False),
    scoped: bool = False,
) -> dict[str, float]:
    """ms per phase of one rank's steady step (the exchanges as device copies;
    ``scoped``: the model runs inside a DD context, see :class:`~benchmarks.scaling_ranks.Scoped`, and
    ``adapters`` counts its spec's adapters that were applied), and
    ``peak_bytes``, the GPU peak of the rank's rows and model steps (see the
    module notes; None off CUDA)."""
    from nvdd.dynamics import VelocityVerlet

    forget_lists(model)
    mark = memory_mark(device)
    local = local_system(batch, owned, src, shift, pbc)
    n_o, n_g = owned.numel(), src.numel()
    dt_fs, adapters = DT_FS, {}
    # the ghosts move only by the exchange, as on a rank (see hold_ghosts)
    local = hold_ghosts(local, n_o)
    if scoped:
        model = Scoped(model, n_o, n_g, device, pbc)
        model.registry.install()
        adapters = {"adapters": sum(s.applied for s in model.registry.statuses)}
        dt_fs = MACE_DT_FS if type(model.inner).__name__ == "MACEModel" else DT_FS
    else:  # LJ: the owned receivers of a rank's runtime
        model = Owned(model, n_o)
    try:
        dyn = VelocityVerlet(model, local, dt_fs=dt_fs, cuda_graphs=graphs and not scoped)
        model_ms = _timed(lambda: dyn.run(1), steps, warmup, device)
    finally:
        if scoped:
            model.registry.restore()
    peak = peak_since(device, mark)  # (before the emulation's whole-system buffers below)

    pos = dyn.batch.positions
    source = batch.positions.clone()
    image = shift @ batch.cell[0]
    wire_pos = torch.empty(n_g, 3, dtype=pos.dtype, device=pos.device)

    def exchange() -> None:  # pack, the wire as a device copy, unpack
        packed = source.index_select(0, src) + image
        wire_pos.copy_(packed)
        pos[n_o:].copy_(wire_pos)

    forces = dyn.batch.forces
    acc = torch.zeros_like(source)
    wire_f = torch.empty(n_g, 3, dtype=pos.dtype, device=pos.device)

    def fold() -> None:  # ghost forces over the wire, added into their owners
        wire_f.copy_(forces[n_o:])
        acc.index_add_(0, src, wire_f)

    folds = folds_forces(model.distribution_spec("halo"))  # (LJ's direct forces: no fold)

    ref = pos[:n_o].clone()
    half_skin = SKIN / 2

    def check() -> None:  # the skin test of the owned rows, read on the host
        bool(((pos[:n_o] - ref).norm(dim=1).max() > half_skin).item())

    alone = {
        "exchange_ms": _timed(exchange, steps, warmup, device),
        "fold_ms": _timed(fold, steps, warmup, device) if folds else 0.0,
        "check_ms": _timed(check, steps, warmup, device),
    }
    dyn = pos = forces = acc = None  # (freed before the whole step runs)
    # the whole steady step as the runtime runs it: the phases in one step,
    # captured as the runtime captures them (see RankStep)
    captured = graphs and not scoped
    padded = local_system(batch, owned, src, shift, pbc)
    rank = RankStep(model, n_o, source, src, shift, static=padded, skin=SKIN, captured=captured)
    if scoped:
        model.registry.install()
    try:  # (the integrator holds the owned rows alone, as a rank's does)
        rows = torch.arange(n_o, device=padded.positions.device)
        stepper = VelocityVerlet(rank, padded.select(rows), dt_fs=dt_fs, cuda_graphs=captured)
        step_ms = _timed(lambda: stepper.run(1), steps, warmup, device)
    finally:
        if scoped:
            model.registry.restore()
    return {
        "model_ms": model_ms,
        **alone,
        "step_ms": step_ms,
        "folds": folds,
        "decision_reads": rank.reads,
        **adapters,
        "peak_bytes": peak,
    }


def predict(
    cells: int,
    dtype_name: str,
    grids: Sequence[str],
    layouts: Sequence[str],
    *,
    steps: int,
    warmup: int,
    device: str,
    graphs: bool,
    bandwidth_gbs: float,
    latency_us: float,
    allreduce_us: float,
    tol: float,
    kind: str = "lj",
) -> list[dict[str, Any]]:
    """The raw one-GPU row and one row per grid and ghost layout: the phases of
    the slowest rank, the communication term and the predicted speed-up.

    ``kind="mpnn"``: the reference MPNN, each rank's model inside a DD context
    (:class:`~benchmarks.scaling_ranks.Scoped`), its feature refreshes added to the communication term;
    its owned forces are not checked (ghost features are stand-ins).
    ``kind="mace"``: MACE (:data:`MACE`) on the silica-like box, as the MPNN
    and with its spec's adapters installed; eager steps (no CUDA graphs)."""
    from nvdd.dynamics import VelocityVerlet

    dtype = getattr(torch, dtype_name)
    batch = system(kind, cells, device, dtype)
    model = _model(device, dtype, kind)
    mpnn = kind in ("mpnn", "mace")
    if kind == "mace":
        graphs = False
        feat_width, n_layers = _mace_shape()
    else:
        feat_width, n_layers = MPNN["hidden"], MPNN["n_layers"]
    cutoff = float(model.cutoff)
    n = batch.n_atoms
    dt_fs = MACE_DT_FS if kind == "mace" else DT_FS
    # first, so that the libraries' one-time workspaces precede every measured run
    full_forces = model(batch)["forces"].detach()
    # the owned-force check runs on displaced positions: on the perfect lattice
    # most forces vanish by symmetry, and a wrong ghost set could too
    shaken, shaken_forces = batch, full_forces
    if not mpnn:
        shaken = displaced(batch)
        shaken_forces = model(shaken)["forces"].detach()
    force_max = float(shaken_forces.abs().max())  # what the check compares against
    forget_lists(model)
    mark = memory_mark(device)
    raw = VelocityVerlet(model, batch.clone(), dt_fs=dt_fs, cuda_graphs=graphs)
    raw_ms = _timed(lambda: raw.run(1), steps, warmup, device)
    raw_peak = peak_since(device, mark)
    raw = None  # free its buffers before the ranks run
    base = {"model": kind, "cells": cells, "dtype": dtype_name, "atoms": n}
    rows: list[dict[str, Any]] = [{**base, "ranks": 1, "raw_ms": raw_ms, "peak_bytes": raw_peak}]
    width = (cutoff + SKIN) / batch.cell[0].diagonal()
    frac = torch.remainder(batch.positions @ torch.linalg.inv(batch.cell[0]), 1.0)
    itemsize = torch.finfo(dtype).bits // 8
    scale = max(1.0, force_max)
    for spec in grids:
        grid = tuple(int(x) for x in spec.split("x"))
        for layout in layouts:
            pbc = [layout == "split" and k == 1 for k in grid]
            per_rank = []
            for coords in itertools.product(*(range(k) for k in grid)):
                owned, src, shift = rank_rows(frac, grid, coords, width, layout)
                err, pairs = None, None
                if not mpnn:
                    local = local_system(shaken, owned, src, shift, pbc)
                    err = check_rank(model, shaken_forces, owned, local)
                    if not err <= tol * scale:
                        raise AssertionError(f"rank {coords} of {spec} ({layout}): |dF| {err:.3e}")
                    local = local_system(batch, owned, src, shift, pbc)
                    pairs = list_pairs(model, local, owned.numel())
                    del local
                t = time_rank(
                    model,
                    batch,
                    owned,
                    src,
                    shift,
                    steps=steps,
                    warmup=warmup,
                    device=device,
                    graphs=graphs,
                    pbc=pbc,
                    scoped=mpnn,
                )
                t["total_ms"] = sum(t[k] for k in PHASES[:-1])  # each phase timed alone
                per_rank.append(
                    {
                        "owned": owned.numel(),
                        "ghost": src.numel(),
                        "force_err": err,
                        "pairs": pairs,
                        **t,
                    }
                )
            slow = max(per_rank, key=lambda r: r[STEP])
            sent = max(r["ghost"] for r in per_rank) * 3 * itemsize
            wire_ms = sent / (bandwidth_gbs * 1e9) * 1e3
            # the forward exchange, and the reverse one where the spec folds forces
            exchanges = 2 if all(r["folds"] for r in per_rank) else 1
            comm_ms = exchanges * (latency_us * 1e-3 + wire_ms) + allreduce_us * 1e-3
            if mpnn:  # a refresh per layer but the last, and its adjoint (a fold)
                features = max(r["ghost"] for r in per_rank) * feat_width * itemsize
                refreshes = 2 * (n_layers - 1)
                comm_ms += refreshes * (latency_us * 1e-3 + features / (bandwidth_gbs * 1e9) * 1e3)
            predicted = slow[STEP] + comm_ms
            # the earlier method: the phases timed alone, summed (kept for comparison)
            by_phases = max(r["total_ms"] for r in per_rank) + comm_ms
            rows.append(
                {
                    **base,
                    "ranks": len(per_rank),
                    "grid": spec,
                    "layout": layout,
                    "raw_ms": raw_ms,
                    "owned_min": min(r["owned"] for r in per_rank),
                    "owned_max": max(r["owned"] for r in per_rank),
                    "ghost_min": min(r["ghost"] for r in per_rank),
                    "ghost_max": max(r["ghost"] for r in per_rank),
                    "bytes_per_exchange": sent,
                    "slowest": {k: slow[k] for k in (*PHASES, STEP)},
                    "comm_ms": comm_ms,
                    "exchanges": exchanges,
                    "predicted_ms": predicted,
                    "speedup": raw_ms / predicted,
                    "overhead": slow[STEP] / (raw_ms * slow["owned"] / n),
                    "predicted_by_phases_ms": by_phases,
                    "speedup_by_phases": raw_ms / by_phases,
                    "max_force_err": None if mpnn else max(r["force_err"] for r in per_rank),
                    # the largest force of the displaced system the check compares against
                    "check_force_max": None if mpnn else force_max,
                    "peak_bytes_max": None
                    if any(r["peak_bytes"] is None for r in per_rank)
                    else max(r["peak_bytes"] for r in per_rank),
                    # atoms the P GPUs hold relative to one (linear memory in rows)
                    "capacity_ratio": capacity_ratio(raw_peak, n, per_rank),
                    # each rank's model counts owned receivers only, as under the runtime
                    "receivers": "owned",
                    "per_rank": per_rank,
                }
            )
    return rows


def add_options(
    p: argparse.ArgumentParser, *, cells: list[int], dtypes: list[str], name: str
) -> None:
    """The options this script and ``validate_scaling.py`` share (model, system,
    timing, communication model, output), with each script's defaults."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cells", type=int, nargs="+", default=cells)
    p.add_argument("--dtype", nargs="+", default=dtypes)
    p.add_argument("--model", choices=("lj", "mpnn", "mace"), default="lj")
    p.add_argument("--mace-size", choices=("medium", "small", "tiny"), default="medium")
    p.add_argument("--cueq", action="store_true", help="MACE with cuEquivariance's kernels")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--no-graphs", action="store_true", help="eager steps (no CUDA graphs)")
    p.add_argument("--bandwidth-gbs", type=float, default=300.0)
    p.add_argument("--latency-us", type=float, default=20.0)
    p.add_argument("--allreduce-us", type=float, default=15.0)
    p.add_argument("--out", default=str(harness.RESULTS))
    p.add_argument("--name", default=None, help=f"default: scaling-{name}-MODEL")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(p, cells=[63, 100], dtypes=["float32", "float64"], name="predicted")
    p.add_argument("--grids", nargs="+", default=list(GRIDS), help="rank grids, e.g. 2x1x1")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="also emulate the one-rank halo step (grid 1x1x1, layout faces) and time the "
        "real runtime's (DomainParallel with the halo forced on one rank) in the same run",
    )
    p.add_argument("--quick", action="store_true", help="CPU sizes: 4 cells, 2x1x1, 3 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.cells, args.grids, args.steps, args.warmup = [4], ["2x1x1"], 3, 1
        args.dtype = ["float64"]
        if args.model == "mace":  # the tiny shape on a 6^3-site box (a 2x1x1 halo fits)
            args.cells, args.mace_size = [6], "tiny"
    MACE.update(size=args.mace_size, cueq=args.cueq)
    if args.calibrate and args.model == "mace":
        p.error("--calibrate runs LJ or the MPNN (benchmarks/bench_dp.py), not MACE")
    if args.calibrate:
        from nvdd.core import init_distributed

        init_distributed(backend="nccl" if args.device.startswith("cuda") else "gloo")
        args.grids = ["1x1x1", *[g for g in args.grids if g != "1x1x1"]]
    rows: list[dict[str, Any]] = []
    for cells in args.cells:
        for dt in args.dtype:
            tol = 1e-9 if dt == "float64" else 1e-4
            got = predict(
                cells,
                dt,
                args.grids,
                args.layouts,
                steps=args.steps,
                warmup=args.warmup,
                device=args.device,
                graphs=not args.no_graphs,
                bandwidth_gbs=args.bandwidth_gbs,
                latency_us=args.latency_us,
                allreduce_us=args.allreduce_us,
                tol=tol,
                kind=args.model,
            )
            if args.calibrate:
                from benchmarks.bench_dp import dd

                real = dd(
                    cells, args.steps, args.warmup, args.device, dt, model=args.model, halo=True
                )
                for r in got:
                    if r.get("grid") == "1x1x1" and r["layout"] == "faces":
                        r["runtime_ms"] = real["ms_per_step"]
            for r in got:
                line = {k: v for k, v in r.items() if k not in ("per_rank", "slowest")}
                print(line, flush=True)
            rows += got
    from pathlib import Path

    command = "python benchmarks/predict_scaling.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    path = harness.write_result(
        args.name or f"scaling-predicted-{args.model}",
        title={
            "lj": "LJ argon",
            "mpnn": "The reference MPNN on argon",
            "mace": f"MACE ({args.mace_size} shape, random weights"
            + (", cuEquivariance" if args.cueq else "")
            + ") on silica",
        }[args.model]
        + ": the P-GPU step predicted from one GPU (each rank's rows run in turn)",
        command=command.strip(),
        rows=rows,
        benchmark="benchmarks/predict_scaling.py",
        out_dir=Path(args.out),
        note=(
            f"communication term: {args.bandwidth_gbs:g} GB/s per direction, "
            f"{args.latency_us:g} us per exchange, {args.allreduce_us:g} us per all-reduce "
            "(assumptions for one NVLink node, see the script's docstring)"
        ),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
