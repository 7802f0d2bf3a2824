"""Benchmark: Nose-Hoover NVT and MTK NPT, decomposed vs single-process (not a test).

Three modes (LJ argon, cutoff 6 A, the systems of integration_tests/it_ensembles.py):

``drift``
    The extended-energy drift (least-squares slope) of a decomposed run on
    ``--world`` CPU ranks against the 1-rank run of the same steps, for NVT-NH,
    NPT (isotropic) and NPT (full cell), with the largest position and cell
    differences at the end::

        python benchmarks/bench_ensembles.py drift --steps 2000 --world 4

``pressure``
    NPT argon liquid (``4 cells**3`` atoms, 100 K, 500 bar) on ``--world`` CPU
    ranks and on one: mean pressure and volume with block-average errors::

        python benchmarks/bench_ensembles.py pressure --cells 4 --steps 6000 --equil 2000

``timing``
    ms/step of the single-process integrators (velocity Verlet, NVT-NH with and
    without CUDA graphs, NPT isotropic, NPT full; ``--kinds`` picks, e.g. ``fire
    fire-eager``: FIRE from the liquid, never converging) on one device: the
    integrators' own cost::

        python benchmarks/bench_ensembles.py timing --device cuda --cells 20 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration_tests"))


#: The ensembles of ``drift`` (kinds of ``it_ensembles.integrator``).
DRIFT_KINDS = ("nvt-nh", "npt-iso", "npt-full")


def drift_mode(args: argparse.Namespace) -> dict[str, Any]:
    from it_ensembles import drift, run_dd, single
    from it_systems import wrapped_max_diff

    from nvdd.testing import run_ranks

    out: dict[str, Any] = {}
    for kind in DRIFT_KINDS:
        t0 = time.perf_counter()
        got = run_ranks(run_dd, args.world, "liquid", kind, args.steps, None, timeout_s=7200)[0]
        t1 = time.perf_counter()
        ref = single("liquid", kind, args.steps)
        t2 = time.perf_counter()
        order = ref["ids"].argsort()
        pbc = torch.ones(3, dtype=torch.bool)
        ce_n, ce_1 = got["conserved"], ref["conserved"]
        out[kind] = {
            "steps": args.steps,
            "world": args.world,
            "drift_n_eV_per_step": drift(ce_n),
            "drift_1_eV_per_step": drift(ce_1),
            "ratio": drift(ce_n) / drift(ce_1),
            "max_abs_dCE_eV": max(abs(a - b) for a, b in zip(ce_n, ce_1, strict=True)),
            "CE_range_eV": max(ce_1) - min(ce_1),
            "max_dx_A": wrapped_max_diff(
                got["positions"], ref["positions"][order], ref["cell"], pbc
            ),
            "max_dcell_A": float((got["cell"] - ref["cell"]).abs().max()),
            "rebuilds": got["rebuilds"],
            "seconds_dd": round(t1 - t0, 1),
            "seconds_1": round(t2 - t1, 1),
        }
        print(kind, json.dumps(out[kind]), flush=True)
    return out


def pressure_mode(args: argparse.Namespace) -> dict[str, Any]:
    from it_ensembles import P_BAR, argon_npt, block_mean, single

    from nvdd.testing import run_ranks

    t0 = time.perf_counter()
    got = run_ranks(
        argon_npt, args.world, args.steps, args.equil, None, args.cells, timeout_s=7200
    )[0]
    t1 = time.perf_counter()
    ref = single("liquid-eq", "npt-iso", args.steps, args.cells, tau_p_fs=500.0)
    t2 = time.perf_counter()
    rows = {}
    for label, series in (
        (f"{args.world} ranks", got),
        ("1 rank", {k: ref[k][args.equil :] for k in ("pressure", "volume")}),
    ):
        p, p_err = block_mean(series["pressure"])
        v, v_err = block_mean(series["volume"])
        rows[label] = {"P_bar": p, "P_err": p_err, "V_A3": v, "V_err": v_err}
        print(
            f"{label:>8}: P = {p:8.1f} +- {p_err:5.1f} bar (target {P_BAR}), "
            f"V = {v:9.1f} +- {v_err:6.1f} A^3",
            flush=True,
        )
    atoms = 4 * args.cells**3
    return {
        "atoms": atoms,
        "steps": args.steps,
        "equilibration": args.equil,
        "target_bar": P_BAR,
        "rows": rows,
        "seconds_dd": round(t1 - t0, 1),
        "seconds_1": round(t2 - t1, 1),
    }


#: The integrators ``timing`` runs by default (``-eager``: every step eager).
TIMED_KINDS = ("nve", "nvt-nh", "nvt-nh-eager", "npt-iso", "npt-iso-eager", "npt-full",
               "npt-full-eager")  # fmt: skip


def timing_mode(args: argparse.Namespace) -> dict[str, Any]:
    from it_ensembles import integrator
    from it_systems import lj_model

    from nvalchemi.distributed._demo import argon_box
    from nvdd.dynamics import FIRE, VelocityVerlet

    dev = torch.device(args.device)
    out: dict[str, Any] = {}
    for kind in args.kinds:
        batch = argon_box(args.cells, dtype=torch.float64, temperature_K=90.0, seed=0).to(dev)
        model = lj_model().to(dev)
        if kind == "nve":
            dyn: Any = VelocityVerlet(model, batch, dt_fs=4.0)
        elif kind.startswith("fire"):  # (fmax never met: every step runs its test)
            dyn = FIRE(model, batch, dt_fs=1.0, dt_max_fs=4.0, fmax=1e-30)
        else:
            dyn = integrator(kind.removesuffix("-eager"), batch, model=model)
        if kind.endswith("-eager"):  # the same integrator, every step eager (no CUDA graphs)
            dyn.graphs.enabled = False
        dyn.run(5)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dyn.run(args.steps)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ms = 1000.0 * (time.perf_counter() - t0) / args.steps
        out[kind] = round(ms, 3)
        replays = dyn.graphs.replays
        search = getattr(model, "device_neighbors", None)
        builds = "" if search is None else f", {search.n_builds} list builds"
        print(
            f"{kind:>12}: {ms:8.3f} ms/step ({batch.n_atoms} atoms, {dev}, {replays} steps "
            f"replayed{builds})",
            flush=True,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("drift", "pressure", "timing"))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--equil", type=int, default=1000)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--cells", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--kinds",
        nargs="+",
        default=list(TIMED_KINDS),
        choices=[*TIMED_KINDS, "fire", "fire-eager"],
        help="timing: the integrators to time",
    )
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    result = {"drift": drift_mode, "pressure": pressure_mode, "timing": timing_mode}[args.mode](
        args
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
