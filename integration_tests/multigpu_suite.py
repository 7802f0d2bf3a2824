"""The integration suite over NCCL: run under torchrun, one process per GPU.

    python -m torch.distributed.run --standalone --nproc-per-node=N \\
        integration_tests/multigpu_suite.py

Every scenario runs decomposed over all ranks on their GPUs; rank 0 then runs the
single-process reference on its GPU and compares by atom id (float64: positions
1e-8 A modulo lattice vectors, forces 1e-10 eV/A... loosened by --tolerance-scale
for GPU atomics). Exits 1 if any scenario fails. ``nox -s multigpu`` refuses
fewer than 2 GPUs; ``--allow-single`` runs it on one GPU to check the NCCL path.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from it_systems import crystal, mace_model, model_for, oxide, wrapped_max_diff

from nvdd.core import init_distributed
from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet, trace_and_validate
from nvdd.models._mace_deps import cueq_available
from nvdd.spec import DistributionSpec

SCENARIOS = [
    # (name, system, model, steps, dt fs, species)
    ("lj-periodic", "periodic", "lj", 50, 4.0, (18,)),
    ("lj-triclinic", "triclinic", "lj", 50, 4.0, (18,)),
    ("lj-slab-pbc", "slab", "lj", 50, 4.0, (18,)),
    ("lj-cluster-open", "cluster", "lj", 50, 4.0, (18,)),
    ("mpnn2-periodic", "periodic", "mpnn2", 30, 1.0, (18, 36)),
    ("mpnn3-triclinic", "triclinic", "mpnn3", 20, 1.0, (18, 36)),
    ("mace-oxide", "oxide", "mace", 10, 0.5, (8, 14)),
]
# MACE with cuEquivariance's kernels, where cuequivariance and its CUDA ops import
CUEQ_SCENARIO = ("mace-cueq-oxide", "oxide", "mace-cueq", 10, 0.5, (8, 14))


def _run(
    kind: str,
    model_name: str,
    steps: int,
    dt: float,
    species: tuple[int, ...],
    device: torch.device,
    decomposed: bool,
    dtype: torch.dtype = torch.float64,
    halo: bool = False,
):
    model, cutoff = model_for(model_name, dtype=dtype, device=device)
    model = model.to(device=device, dtype=dtype)
    batch = (oxide() if kind == "oxide" else crystal(kind, species=species)).to(device, dtype)
    dyn = VelocityVerlet(model, batch, dt_fs=dt)
    if not decomposed:
        dyn.run(steps)
        return dyn.batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DomainConfig(cutoff=cutoff, skin=0.5, halo_on_one_rank=halo)
        with DomainParallel(dyn, config) as dp:
            dp.partition()
            dp.run(steps)
            return dp.gather(0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--allow-single", action="store_true")
    p.add_argument(
        "--tolerance-scale",
        type=float,
        default=100.0,
        help="GPU atomics reorder sums: tolerances x this (default 100)",
    )
    p.add_argument(
        "--dtype",
        choices=("float64", "float32", "both"),
        default="float64",
        help="float64: positions 1e-8 A, forces 1e-10 eV/A; float32: forces 1e-5 x max|F|",
    )
    p.add_argument(
        "--halo",
        action="store_true",
        help="on one rank, run the halo path anyway (DomainConfig.halo_on_one_rank)",
    )
    args = p.parse_args()
    dtypes = ["float64", "float32"] if args.dtype == "both" else [args.dtype]
    env = init_distributed(backend="nccl")
    world, rank, device = env.world_size, env.rank, env.device
    if world < 2 and not args.allow_single:
        print("multigpu_suite: fewer than 2 ranks (use --allow-single to run anyway)")
        return 1
    failures = 0
    scenarios = SCENARIOS + ([CUEQ_SCENARIO] if cueq_available() else [])
    cases = [(*sc, dt_name) for dt_name in dtypes for sc in scenarios]
    for name, kind, model_name, steps, dt, species, dt_name in cases:
        dtype = getattr(torch, dt_name)
        t0 = time.perf_counter()
        got = _run(kind, model_name, steps, dt, species, device, True, dtype, args.halo)
        elapsed = time.perf_counter() - t0
        ok = True
        if rank == 0:
            assert got is not None
            ref = _run(kind, model_name, steps, dt, species, device, False, dtype).sort_by_id()
            same = torch.equal(got.atom_ids.cpu(), ref.atom_ids.cpu())
            dx = wrapped_max_diff(
                got.positions.double(), ref.positions.double(), ref.cell[0].double(), ref.pbc[0]
            )
            df = float((got.forces - ref.forces).abs().max())
            de = float((got.energy - ref.energy).abs().max())
            if dtype == torch.float64:
                ok = same and dx < 1e-8 * args.tolerance_scale and df < 1e-10 * args.tolerance_scale
            else:  # fp32: forces by id within 1e-5 of the largest force (one step's worth)
                fmax = float(ref.forces.abs().max())
                ok = same and df <= 1e-5 * max(fmax, 1.0) * args.tolerance_scale / 100.0
            print(
                f"{'PASS' if ok else 'FAIL'} {name:<18} {dt_name} ranks={world} ids_equal={same} "
                f"max|dx|={dx:.2e} max|dF|={df:.2e} |dE|={de:.2e} ({elapsed:.1f} s)",
                flush=True,
            )
        flag = torch.tensor([0 if ok else 1], device=device)
        dist.all_reduce(flag)
        failures += int(flag.item())
    checks = len(cases)
    if world >= 2:  # trace_and_validate on the GPUs of this torchrun (collective)
        checks += 2
        failures += _trace_mace(rank, args.tolerance_scale)
    if rank == 0:
        print(
            f"multigpu_suite: {checks - failures}/{checks} scenarios passed on {world} GPU rank(s)"
        )
    dist.destroy_process_group()
    return 1 if failures else 0


def _trace_mace(rank: int, scale: float) -> int:
    """trace_and_validate(device="cuda") on MACE: passes; without its refresh adapter
    it names mace.interactions.1. Every rank gets the same report."""
    model, batch = mace_model(), oxide((5, 4, 4))
    good = trace_and_validate(model, batch, device="cuda", tolerance=1e-8 * scale)
    broken_spec = model.distribution_spec().replace(
        distribution=DistributionSpec(), name="no refresh"
    )
    bad = trace_and_validate(model, batch, spec=broken_spec, device="cuda", tolerance=1e-8 * scale)
    fails = int(not good.passed) + int(bad.passed or bad.first_uncovered != "mace.interactions.1")
    if rank == 0:
        print(f"{'PASS' if good.passed else 'FAIL'} trace-mace-cuda      {good.errors}", flush=True)
        ok = not bad.passed and bad.first_uncovered == "mace.interactions.1"
        print(
            f"{'PASS' if ok else 'FAIL'} trace-mace-no-refresh first_uncovered={bad.first_uncovered}",
            flush=True,
        )
    return fails


if __name__ == "__main__":
    raise SystemExit(main())
