"""Diagnose CUDA step capture on a GPU host: a bare capture with and without a
kept GraphPool, a captured whole-batch LJ step, then C^3 unit cells of LJ on the
halo path (one NCCL rank, halo forced) for N steps with rebuilds, printing the
captures, replays and the reason of the last drop, and every warning (a failed
capture falls back to eager steps with a warning that benchmarks silence).

    python benchmarks/diag_capture.py 12 80
"""

import sys
import traceback
import warnings

import torch

sys.path.insert(0, "benchmarks")
from nvdd.core import GraphPool, _capture


def _whole() -> None:
    x = torch.ones(1000, device="cuda")
    for label, pool in (("no pool", None), ("GraphPool", GraphPool(torch.device("cuda", 0)))):
        g = _capture.CudaStepGraph(pool)
        try:
            g.capture(lambda: x.mul_(2.0))
            g.replay()
            torch.cuda.synchronize()
            print(label, "ok", float(x[0]))
        except Exception:
            print(label, "FAILED")
            traceback.print_exc()

    from bench_dp import _model, _system

    from nvdd.dynamics import VelocityVerlet

    warnings.simplefilter("always")
    b = _system(6, "cuda", torch.float32)
    dyn = VelocityVerlet(_model("cuda", torch.float32), b, dt_fs=2.0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        dyn.run(30)
    print(
        "captures",
        dyn.graphs.captures,
        "replays",
        dyn.graphs.replays,
        "last_drop",
        dyn.graphs.last_drop,
    )
    for item in w:
        print("warning:", str(item.message)[:2000])


def _halo(cells: int, steps: int) -> list[str]:
    import warnings

    from bench_dp import CUTOFF, DT_FS, SKIN, _model, _system

    from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet

    out = []
    b = _system(cells, "cuda:0", torch.float32)
    dyn = VelocityVerlet(_model("cuda:0", torch.float32), b, dt_fs=DT_FS)
    config = DomainConfig(cutoff=CUTOFF["lj"], skin=SKIN, halo_on_one_rank=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with DomainParallel(dyn, config) as dp:
            dp.partition()
            dp.run(steps)
            rebuilds = dp.stats.rebuilds
    out.append(
        f"halo: rebuilds {rebuilds} captures {dyn.graphs.captures} replays {dyn.graphs.replays} last_drop {dyn.graphs.last_drop}"
    )
    out += ["warning: " + str(i.message)[:3000] for i in w]
    return out


if __name__ == "__main__":
    from nvdd.core import spawn_ranks

    _whole()

    for line in spawn_ranks(
        _halo, 1, int(sys.argv[1]), int(sys.argv[2]), backend="nccl", start_method="spawn"
    )[0]:
        print(line)
