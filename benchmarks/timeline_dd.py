"""Where the time of a DomainParallel rebuild step goes: host, device, waits.

One rank (the halo path forced) or ``--world`` ranks; LJ argon as in
``bench_dp.py``. After a warm-up, ``--steps`` forced rebuild steps run under
``torch.profiler`` (with ``profile_dd``'s ranges) and under ``cProfile``. For
the last profiled step it prints

- the step's host wall time, the device's busy time (union of kernels, copies
  and memsets) and its idle time;
- the host calls that waited for the device (runtime and driver calls longer
  than ``--wait-us``: synchronisations, blocking copies), with the innermost
  ``nvdd`` range they ran in;
- the longest device idle gaps, with the range the host was in meanwhile;
- the device time per range (kernels attributed to the innermost range open on
  the host when they were launched);

then the cProfile table of the profiled steps (host time per function). With
``--after`` the profiled step is the one after each forced rebuild (where the
step's CUDA graphs are captured again) and the rebuild itself runs unprofiled.
The
chrome trace of the profiled steps goes to ``--chrome`` when given.

    python benchmarks/timeline_dd.py --device cuda --cells 63 --steps 2 --chrome OUT/t.json
    python benchmarks/timeline_dd.py --cells 6          # CPU smoke check (no device rows)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pstats
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))

#: Runtime / driver calls that make the host wait for the device (or may).
_WAITS = ("Synchronize", "Memcpy", "cuStreamQuery", "cudaStreamQuery", "EventQuery")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _innermost(ranges: list[dict[str, Any]], t: float) -> str:
    """The name of the shortest ``nvdd:`` range open on the host at ``t``."""
    best, width = "(outside nvdd ranges)", float("inf")
    for r in ranges:
        if r["ts"] <= t <= r["ts"] + r["dur"] and r["dur"] < width:
            best, width = r["name"][5:], r["dur"]
    return best


def summarise(trace: dict[str, Any], wait_us: float, gaps: int) -> str:
    """The timeline summary of the last ``nvdd:step`` range of a chrome trace."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [e for e in events if e.get("name") == "nvdd:step"]
    if not steps:
        return "no nvdd:step range in the trace"
    step = steps[-1]
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    host = [e for e in events if t0 <= e["ts"] <= t1 and e.get("cat") not in _DEVICE_CATS]
    ranges = [e for e in host if str(e.get("name", "")).startswith("nvdd:") and e is not step]
    # device work: correlated to launches inside the step (it may run after t1)
    launches = {
        e["args"]["correlation"]: e
        for e in host
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    device = [
        e
        for e in events
        if e.get("cat") in _DEVICE_CATS and e.get("args", {}).get("correlation") in launches
    ]
    lines = [f"step (host range): {step['dur'] / 1000:.2f} ms"]
    if device:
        busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in device])
        end = max(b for _, b in busy)
        start = min(a for a, _ in busy)
        on = sum(b - a for a, b in busy)
        lines.append(
            f"device: {len(device)} kernels/copies/memsets, busy {on / 1000:.2f} ms, first "
            f"{(start - t0) / 1000:.2f} ms after the step began, last done "
            f"{(end - t0) / 1000:.2f} ms after it"
        )
        per: dict[str, float] = {}
        for e in device:
            launch = launches[e["args"]["correlation"]]
            key = _innermost(ranges, launch["ts"])
            per[key] = per.get(key, 0.0) + e["dur"]
        lines.append("device time by the range that launched it (ms):")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:16]:
            lines.append(f"   {k:<34s} {v / 1000:8.3f}")
        top: dict[str, list[float]] = {}
        for e in device:
            top.setdefault(str(e["name"])[:60], []).append(e["dur"])
        lines.append("device work by name (ms, calls):")
        for k, v in sorted(top.items(), key=lambda kv: -sum(kv[1]))[:14]:
            lines.append(f"   {k:<62s} {sum(v) / 1000:8.3f} {len(v):5d}")
        idle = [(a1, b0) for (_, a1), (b0, _) in itertools.pairwise(busy)]
        idle.sort(key=lambda g: -(g[1] - g[0]))
        lines.append(f"longest device idle gaps (of {len(idle)}): ms, host range meanwhile")
        for a, b in idle[:gaps]:
            lines.append(
                f"   {(b - a) / 1000:7.3f} at +{(a - t0) / 1000:6.2f}  {_innermost(ranges, a)}"
            )
    waits = [
        e
        for e in host
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and any(w in str(e.get("name")) for w in _WAITS)
        and e["dur"] >= wait_us
    ]
    total = sum(e["dur"] for e in waits)
    lines.append(
        f"host calls that waited >= {wait_us:.0f} us: {len(waits)}, {total / 1000:.2f} ms in all"
    )
    for e in sorted(waits, key=lambda e: e["ts"]):
        lines.append(
            f"   +{(e['ts'] - t0) / 1000:6.2f} {e['dur'] / 1000:7.3f} ms  {e['name']:<26s} "
            f"{_innermost(ranges, e['ts'])}"
        )
    launched = [e for e in host if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    lines.append(
        f"runtime/driver calls: {len(launched)}, "
        f"{sum(e['dur'] for e in launched) / 1000:.2f} ms of host time"
    )
    return "\n".join(lines)


def _rank(cells: int, device: str, dtype_name: str, steps: int, warmup: int, halo: bool,
          chrome: str | None, wait_us: float, gaps: int, top: int,
          after: bool) -> dict[str, Any]:  # fmt: skip
    import torch.distributed as dist
    from profile_dd import _RANGES, _patched, lj_setup

    from nvdd.dynamics import DomainParallel

    rank, cuda, sync, dyn, config = lj_setup(cells, device, dtype_name, halo)
    out: dict[str, Any] = {}

    def wrap(f: Any, label: str) -> Any:
        def ranged(*a: Any, **k: Any) -> Any:
            with torch.profiler.record_function("nvdd:" + label.strip()):
                return f(*a, **k)

        return ranged

    with DomainParallel(dyn, config) as dp:
        dp.partition()
        dp.run(warmup)
        for _ in range(3):  # rebuild paths warm (first-rebuild copies, kernels loaded)
            dp.model.request_rebuild()
            dp.run(1)
        sync()
        dist.barrier()
        undo = _patched(_RANGES, wrap)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        profile = cProfile.Profile()
        try:
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(steps):
                    dp.model.request_rebuild()
                    if after:  # the rebuild unprofiled; the step after it (a capture)
                        with torch.profiler.record_function("rebuild (not profiled)"):
                            dp.run(1)
                    sync()
                    profile.enable()
                    with torch.profiler.record_function("nvdd:step"):
                        dp.run(1)
                        sync()
                    profile.disable()
        finally:
            for owner, name, original in undo:
                setattr(owner, name, original)
        if rank == 0:
            path = chrome or os.path.join(os.environ.get("TMPDIR", "/tmp"), "timeline_dd.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                out["timeline"] = summarise(json.load(f), wait_us, gaps)
            if chrome is None:
                os.remove(path)
            buf = io.StringIO()
            stats = pstats.Stats(profile, stream=buf)
            stats.sort_stats("tottime").print_stats(top)
            stats.sort_stats("cumulative").print_stats("nvdd", top)
            out["cprofile"] = "\n".join(
                line[:160] for line in buf.getvalue().splitlines() if line.strip()
            )
            out["owned"], out["ghosts"] = dp.stats.n_owned, dp.stats.n_ghost
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--cells", type=int, default=10)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=2, help="profiled forced rebuild steps")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--whole", action="store_true", help="one rank: the whole batch, no halo")
    p.add_argument("--chrome", default=None, help="write the chrome trace here")
    p.add_argument("--wait-us", type=float, default=30.0)
    p.add_argument("--gaps", type=int, default=12)
    p.add_argument("--top", type=int, default=30, help="rows of each cProfile table")
    p.add_argument(
        "--after", action="store_true",
        help="profile the step after each forced rebuild (the graphs' capture) instead",
    )  # fmt: skip
    args = p.parse_args()
    from nvdd.core import spawn_ranks

    backend = "nccl" if args.device == "cuda" else "gloo"
    res = spawn_ranks(
        _rank, args.world, args.cells, args.device, args.dtype, args.steps, args.warmup,
        not args.whole, args.chrome, args.wait_us, args.gaps, args.top, args.after,
        backend=backend, timeout_s=1200,
    )  # fmt: skip
    r = res[0]
    print(f"rank 0: {r['owned']:,} owned, {r['ghosts']:,} ghosts")
    print(r["timeline"])
    print(r["cprofile"])


if __name__ == "__main__":
    main()
