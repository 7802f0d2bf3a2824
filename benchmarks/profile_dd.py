"""Where a DomainParallel LJ step goes on N ranks: steady steps against rebuild steps.

Every rank times each step on its own (device synchronised around it), so the
table separates the steady step (no migration) from the steps that migrate and
build a new halo plan; then synchronised phase timers; then a torch.profiler
table of rank 0 over a window that holds a rebuild.

    python benchmarks/profile_dd.py --device cuda --world 2 --cells 63 --dtype float32
    python benchmarks/profile_dd.py --world 2 --cells 8            # CPU smoke check
    # each step timed alone and tagged (rebuild, capture, replay, eager): what
    # one rebuild costs a run whose steady steps are replayed CUDA graphs
    python benchmarks/profile_dd.py --device cuda --world 1 --halo --cells 63 --trace 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))


def _trace(dp: Any, dyn: Any, steps: int, sync: Any) -> dict[str, Any]:
    """Each of ``steps`` steps timed alone (device synchronised), tagged by what it
    was: ``R`` rebuilt the halo, ``C`` captured a CUDA graph, ``G`` replayed one,
    ``E`` ran eagerly. Returns the per-tag counts and mean ms, the sequence, and
    the cost of one rebuild cycle (the rebuild step, the eager steps and the
    capture after it, each less a replayed step) over the replayed step."""
    graphs = getattr(dyn, "graphs", None)
    host_seconds = _capture_seconds()
    start = dict(host_seconds)
    tags: list[str] = []
    times: list[float] = []
    for _ in range(steps):
        before = (dp.stats.rebuilds, getattr(graphs, "captures", 0), getattr(graphs, "replays", 0))
        t0 = time.perf_counter()
        dp.run(1)
        sync()
        times.append(1000 * (time.perf_counter() - t0))
        after = (dp.stats.rebuilds, getattr(graphs, "captures", 0), getattr(graphs, "replays", 0))
        tag = (
            "R"
            if after[0] != before[0]
            else "C"
            if after[1] != before[1]
            else "G"
            if after[2] != before[2]
            else "E"
        )
        tags.append(tag)
    by: dict[str, list[float]] = {}
    for tag, ms in zip(tags, times, strict=True):
        by.setdefault(tag, []).append(ms)
    means = {tag: statistics.mean(v) for tag, v in by.items()}
    counts = {tag: len(v) for tag, v in by.items()}
    replay = statistics.median(by["G"]) if "G" in by else float("nan")
    extra = sum(ms - replay for tag, ms in zip(tags, times, strict=True) if tag != "G")
    rebuilds = max(1, counts.get("R", 0))
    captured = max(1, counts.get("C", 0))
    capture_ms = {k: 1000 * (v - start[k]) / captured for k, v in host_seconds.items()}
    return {
        "capture_host_ms": capture_ms,
        "sequence": "".join(tags),
        "counts": counts,
        "mean_ms": means,
        "replay_ms": replay,
        "per_step_ms": statistics.mean(times),
        "extra_per_rebuild_ms": extra / rebuilds,
    }


def _capture_seconds() -> dict[str, float]:
    """``CudaStepGraph.host_seconds`` (live; all zero where no graph is captured)."""
    from nvdd.core import _capture

    return _capture.CudaStepGraph.host_seconds


def lj_setup(cells: int, device: str, dtype_name: str, halo: bool) -> tuple[Any, ...]:
    """``(rank, cuda, sync, dynamics, config)`` of this rank's LJ argon run
    (``bench_dp``'s system and model; rank 0 holds the atoms, ``halo``: the halo
    path on one rank too). Call on a rank of ``spawn_ranks``."""
    import torch.distributed as dist
    from bench_dp import CUTOFF, DT_FS, SKIN, _model, _system

    from nvdd.dynamics import DomainConfig, VelocityVerlet

    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    cuda = device == "cuda"
    dev = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = getattr(torch, dtype_name)
    batch = _system(cells, dev, dtype) if rank == 0 else _system(1, dev, dtype)
    dyn = VelocityVerlet(_model(dev, dtype), batch, dt_fs=DT_FS)
    config = DomainConfig(cutoff=CUTOFF["lj"], skin=SKIN, halo_on_one_rank=halo)
    return rank, cuda, sync, dyn, config


def _torch_capture() -> None:
    """The capture as it was before GraphPool (A/B legs): ``torch.cuda.graph``,
    a new private pool per capture and ``empty_cache`` before each."""
    import gc

    from nvdd.core import _capture

    def capture(self: Any, body: Any) -> Any:
        enabled = gc.isenabled()
        gc.disable()
        try:
            with _capture._activate(None) as active:
                with torch.cuda.graph(self._graph):
                    body()
                return active.callbacks
        finally:
            if enabled:
                gc.enable()

    _capture.CudaStepGraph.capture = capture  # type: ignore[method-assign]


def _rank(
    cells: int,
    device: str,
    dtype_name: str,
    steps: int,
    halo: bool,
    shapes: bool = False,
    python: bool = False,
    warmup: int = 20,
    breakdown: int = 0,
    steady_window: bool = False,
    ranges: int = 0,
    forced: int = 0,
    trace: int = 0,
    torch_capture: bool = False,
) -> dict[str, Any]:
    import torch.distributed as dist

    from nvdd.dynamics import DomainParallel

    if torch_capture:
        _torch_capture()
    rank, cuda, sync, dyn, config = lj_setup(cells, device, dtype_name, halo)
    out: dict[str, Any] = {}
    with DomainParallel(dyn, config) as dp:
        dp.partition()
        dp.run(warmup)
        sync()
        dist.barrier()
        if trace:
            out["trace"] = _trace(dp, dyn, trace, sync)
            if cuda:  # what the allocator holds after the traced rebuild cycles
                out["trace"]["reserved_mb"] = torch.cuda.memory_reserved() / 2**20
                out["trace"]["max_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
        steady, rebuild = [], []
        for _ in range(steps):
            before = dp.stats.rebuilds
            t0 = time.perf_counter()
            dp.run(1)
            sync()
            ms = 1000 * (time.perf_counter() - t0)
            (rebuild if dp.stats.rebuilds != before else steady).append(ms)
        for _ in range(forced):  # rebuilds on demand, timed alone (no piece timers)
            dp.model.request_rebuild()
            sync()
            t0 = time.perf_counter()
            dp.run(1)
            sync()
            rebuild.append(1000 * (time.perf_counter() - t0))
        out["steady_ms"] = statistics.median(steady) if steady else float("nan")
        out["rebuild_ms"] = statistics.mean(rebuild) if rebuild else float("nan")
        out["rebuilds"] = len(rebuild)
        out["steps"] = steps + forced
        dp.model.sync_timings = True
        for k in dp.stats.seconds:
            dp.stats.seconds[k] = 0.0
        t0 = time.perf_counter()
        dp.run(steps)
        sync()
        total = time.perf_counter() - t0
        out["phases_ms"] = {k: 1000 * v / steps for k, v in dp.stats.seconds.items()}
        out["synced_ms"] = 1000 * total / steps
        dp.model.sync_timings = False
        if ranges:
            text = _rebuild_ranges(dp, ranges, sync, cuda)
            if rank == 0:
                out["ranges"] = text
        if breakdown and rank == 0:
            out["breakdown"] = _breakdown(dp, breakdown, sync)
        elif breakdown:
            _breakdown(dp, breakdown, sync)  # (every rank steps alike)
        if not steady_window:
            dp.model.request_rebuild()  # the window below holds one rebuild and steady steps
        acts = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(
            activities=acts, record_shapes=shapes, with_stack=python
        ) as prof:
            dp.run(10)
            sync()
        if rank == 0:
            tables = []
            for key in ("self_cpu_time_total", "self_cuda_time_total" if cuda else None):
                if key is None:
                    continue
                t = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=55)
                tables.append("\n".join(line[:150] for line in t.splitlines()))
            if shapes:  # the costliest operators by input shapes (which tensors)
                key = "cuda_time_total" if cuda else "cpu_time_total"
                t = prof.key_averages(group_by_input_shape=True).table(
                    sort_by=key, row_limit=40, max_name_column_width=30, max_shapes_column_width=70
                )
                tables.append(t)
            if python:  # host time of nvdd's Python functions (inclusive), per call site
                rows = [
                    e
                    for e in prof.key_averages()
                    if ("/nvdd/" in e.key or e.key.startswith("nvdd/")) and ".py(" in e.key
                ]
                rows.sort(key=lambda e: -e.cpu_time_total)
                lines = ["nvdd Python functions by inclusive host time (10 steps):"]
                if not rows:  # (seen with torch 2.11+cu130 on the H200: no Python events)
                    lines.append(
                        "  none recorded: this torch build's profiler gave no Python frames"
                    )
                for e in rows[:40]:
                    where = e.key.split("nvdd/", 1)[-1]
                    lines.append(
                        f"  {e.cpu_time_total / 1000:9.2f} ms  {e.count:6d} calls  {where[:100]}"
                    )
                tables.append("\n".join(lines))
            out["profile"] = "\n".join(tables)
        out["owned"], out["ghosts"] = dp.stats.n_owned, dp.stats.n_ghost
    return out


#: What a rebuild step calls, timed one by one (module, attribute path, label).
_PIECES = (
    ("nvdd.dynamics._distributed_model", "DistributedModel._skin_used_up", "check"),
    ("nvdd.dynamics._distributed_model", "DistributedModel._rebuild", "rebuild (migrate+plan)"),
    ("nvdd.partition._sharded", "ShardedBatch.migrate", "  migrate"),
    ("nvdd.dynamics._distributed_model", "build_halo_plan", "  build_halo_plan"),
    ("nvdd.halo._plan", "select_ghosts", "    select_ghosts"),
    ("nvdd.halo._plan", "_header_exchange", "    header exchange"),
    ("nvdd.dynamics._distributed_model", "DistributedModel._install", "  install (static fields)"),
    ("nvdd.dynamics._distributed_model", "DistributedModel.exchange", "exchange (ghost positions)"),
    ("nvdd.dynamics._distributed_model", "DistributedModel.forward", "forward (model)"),
    ("nvdd.models._device_neighbors", "DeviceVerletList.__call__", "  neighbour list"),
    ("nvdd.models._lj", "WarpLJ.__call__", "  LJ kernel"),
    ("nvdd.dynamics._distributed_model", "DistributedModel.fold", "fold + consolidation"),
    ("nvdd.halo._plan", "HaloPlan.reverse", "  fold"),
)


#: Finer pieces of a rebuild step, profiled as ``record_function`` ranges.
_RANGES = (
    *_PIECES,
    ("nvdd.partition._spatial", "SpatialPartitioner._destinations", "destinations"),
    ("nvdd.partition._spatial", "SpatialPartitioner.wrap_positions", "wrap_positions"),
    ("nvdd.partition._spatial", "SpatialPartitioner._keeps", "keeps"),
    ("nvdd.partition._spatial", "kernel_destinations", "destinations kernel"),
    ("nvdd.partition._sharded", "all_reduce_sum", "migrate all_reduce_sum"),
    ("nvdd.halo._plan", "check_plan_inputs", "check_plan_inputs"),
    ("nvdd.models._device_neighbors", "DeviceVerletList._allocate", "list allocate"),
    ("nvdd.models._device_neighbors", "DeviceVerletList._launch_chain", "list launch chain"),
    ("nvdd.models._device_neighbors", "_check_system_range", "list system range"),
    ("nvdd.halo._plan", "Route.sorted_on", "fold order"),
    ("nvdd.halo._plan", "HaloPlan.ghost_positions", "ghost_positions"),
    ("nvdd.halo._plan", "HaloPlan.forward_many", "forward_many"),
)


def _patched(pieces: Any, wrap: Any) -> list[tuple[Any, str, Any]]:
    """Replace each piece by ``wrap(original, label)``; returns what to restore."""
    import importlib

    undo = []
    for module, path, label in pieces:
        owner: Any = importlib.import_module(module)
        *parents, name = path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        setattr(owner, name, wrap(original, label))
        undo.append((owner, name, original))
    return undo


def _rebuild_ranges(dp: Any, n: int, sync: Any, cuda: bool) -> str:
    """Host and device time of each piece of ``_RANGES`` (``record_function``
    ranges, inclusive) over ``n`` forced rebuild steps.

    The device column is the profiler's attribution of kernels to ranges; on
    the H200 it credited migration with 7 ms that an A/B of the same rebuilds
    did not find (``docs/h200/2026-12-01-h1-rebuild-ab.log``): use it to point,
    and ``--forced`` (steps timed alone) to measure."""

    def wrap(f: Any, label: str) -> Any:
        def ranged(*a: Any, **k: Any) -> Any:
            with torch.profiler.record_function("nvdd:" + label.strip()):
                return f(*a, **k)

        return ranged

    undo = _patched(_RANGES, wrap)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(n):
                dp.model.request_rebuild()
                dp.run(1)
            sync()
    finally:
        for owner, name, original in undo:
            setattr(owner, name, original)
    lines = [f"--- {n} forced rebuild steps, ranges (inclusive, per step): host ms, device ms"]
    rows = [e for e in prof.key_averages() if e.key.startswith("nvdd:")]
    rows.sort(key=lambda e: -e.cpu_time_total)
    for e in rows:
        dev = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))
        lines.append(
            f"   {e.key[5:]:<32s} {e.cpu_time_total / 1000 / n:8.2f} {dev / 1000 / n:8.2f}"
            f"   ({e.count // n} calls)"
        )
    return "\n".join(lines)


def _breakdown(dp: Any, n: int, sync: Any) -> str:
    """Synchronised time of each piece of ``_PIECES`` over ``n`` steps as they
    come (rebuild and steady steps apart), then ``n`` steps with a forced rebuild
    (``request_rebuild`` before each); inclusive times, a piece inside another
    indented."""
    spent: dict[str, float] = {}

    def wrap(f: Any, label: str) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                sync()
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0

        return timed

    undo = _patched(_PIECES, wrap)
    texts = []
    nbr = getattr(getattr(dp.model.model, "_warp", None), "neighbors", None)
    try:
        for label, forced in (("natural", False), ("forced rebuild", True)):
            groups: dict[str, list[dict[str, float]]] = {"rebuild": [], "steady": []}
            for _ in range(n):
                if forced:
                    dp.model.request_rebuild()
                spent.clear()
                before, hosts = dp.stats.rebuilds, getattr(nbr, "host_rebuilds", 0)
                sync()
                t0 = time.perf_counter()
                dp.run(1)
                sync()
                row = dict(spent, step=time.perf_counter() - t0)
                row["list host rebuilds"] = getattr(nbr, "host_rebuilds", 0) - hosts
                groups["rebuild" if dp.stats.rebuilds != before else "steady"].append(row)
            for kind, rows in groups.items():
                if not rows:
                    continue
                keys = list(dict.fromkeys(k for r in rows for k in r))
                mean = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}
                lines = [
                    f"--- {label} steps that were {kind} steps: {len(rows)} of {n}, "
                    f"{1000 * mean.pop('step'):.2f} ms each (pieces synchronised, inclusive)"
                ]
                hosts_mean = mean.pop("list host rebuilds")
                lines += [f"   {k:<32s} {1000 * v:8.2f} ms" for k, v in mean.items()]
                lines.append(
                    f"   neighbour-list host rebuilds per step: {hosts_mean:.2f}; capacity "
                    f"{getattr(nbr, 'capacity', '?')}"
                )
                texts.append("\n".join(lines))
    finally:
        for owner, name, original in undo:
            setattr(owner, name, original)
    return "\n".join(texts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--cells", type=int, default=10)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--trace",
        type=int,
        default=0,
        help="time N steps one by one first, tagged rebuild / capture / replay / eager",
    )
    p.add_argument("--halo", action="store_true", help="one rank: the halo path anyway")
    p.add_argument(
        "--torch-capture",
        action="store_true",
        help="capture with torch.cuda.graph as before GraphPool (an A/B leg)",
    )
    p.add_argument("--shapes", action="store_true", help="also a table by input shapes")
    p.add_argument("--python", action="store_true", help="also host time per nvdd function")
    p.add_argument("--warmup", type=int, default=20, help="steps before the timed window")
    p.add_argument(
        "--forced",
        type=int,
        default=0,
        metavar="N",
        help="also time N steps with a forced rebuild (in the rebuild mean)",
    )
    p.add_argument(
        "--ranges",
        type=int,
        default=0,
        metavar="N",
        help="also profile N forced rebuild steps as ranges (host and device time)",
    )
    p.add_argument(
        "--steady-window",
        action="store_true",
        help="profile steps as they come (no forced rebuild in the window)",
    )
    p.add_argument(
        "--breakdown",
        type=int,
        default=0,
        metavar="N",
        help="also time the pieces of N steps as they come and N forced rebuilds",
    )
    args = p.parse_args()
    from nvdd.core import spawn_ranks

    backend = "nccl" if args.device == "cuda" else "gloo"
    res = spawn_ranks(
        _rank, args.world, args.cells, args.device, args.dtype, args.steps, args.halo, args.shapes, args.python,
        args.warmup, args.breakdown, args.steady_window, args.ranges, args.forced, args.trace,
        args.torch_capture, backend=backend, timeout_s=900, start_method="spawn",
    )  # fmt: skip
    print(f"### profile_dd.py --device {args.device} --world {args.world} --cells {args.cells} "
          f"--dtype {args.dtype} --steps {args.steps}{' --halo' if args.halo else ''}"
          f"{' --torch-capture' if args.torch_capture else ''}")  # fmt: skip
    for r, out in enumerate(res):
        if "trace" in out:
            t = out["trace"]
            means = ", ".join(f"{k} {v:.2f}" for k, v in sorted(t["mean_ms"].items()))
            print(
                f"rank {r} trace (R rebuild, C capture, G replay, E eager): {t['counts']}; "
                f"mean ms {means}; {t['per_step_ms']:.2f} ms/step; one rebuild costs "
                f"{t['extra_per_rebuild_ms']:.1f} ms over replayed steps ({t['replay_ms']:.2f})"
            )
            print(f"   {t['sequence']}")
            if any(t["capture_host_ms"].values()):
                parts = ", ".join(f"{k} {v:.2f}" for k, v in t["capture_host_ms"].items())
                print(f"   host ms per capture step (CudaStepGraph.host_seconds): {parts}")
            if "reserved_mb" in t:
                print(f"   allocator: {t['reserved_mb']:.0f} MiB reserved after the trace, "
                      f"{t['max_reserved_mb']:.0f} MiB at most")  # fmt: skip
        print(f"rank {r}: {out['owned']:,d} owned, {out['ghosts']:,d} ghosts; steady step "
              f"{out['steady_ms']:.2f} ms (median), rebuild step {out['rebuild_ms']:.2f} ms "
              f"({out['rebuilds']} in {out['steps']}); synchronised phases "
              f"{out['synced_ms']:.2f} ms/step:")  # fmt: skip
        print("   " + ", ".join(f"{k} {v:.3f}" for k, v in out["phases_ms"].items()))
    print(res[0]["profile"])
    if "breakdown" in res[0]:
        print(res[0]["breakdown"])
    if "ranges" in res[0]:
        print(res[0]["ranges"])


if __name__ == "__main__":
    main()
