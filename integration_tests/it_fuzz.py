"""Randomized differential testing: DomainParallel on N gloo ranks against one process.

Each seed draws one case (:func:`random_case`): a model (Lennard-Jones fp64 or
fp32, the reference MPNN with 2 or 3 layers), a cell (cubic, orthorhombic,
triclinic, thin), boundaries (periodic, slab, wire, open; open axes with a zero
cell vector or not), a phase and temperature, an integrator (velocity Verlet,
Langevin, FIRE, Nose-Hoover NVT, MTK NPT isotropic or full), 2 to 4 ranks with
or without a fixed grid, a skin from 0 to 1 A, load balancing, migration
hysteresis, a wider ghost width, HALO or GRAPH_PARTITION, a hook of any
scope, and (HALO, 30 % of seeds) a checkpoint at a random step with the rest
of the run restarted from it in a new ``DomainParallel``. :func:`check` runs
the case under ``DomainParallel`` and in one process and compares, by atom id: the final state, every hook call's state, the step
count and the return value (fp64: positions 1e-8 A, forces and energy 1e-10
relative; fp32: 1e-3, 1e-4, 1e-5).

``test_it_fuzz.py`` runs a fixed handful of seeds in CI; a longer campaign::

    PYTHONPATH=<each packages/*/src>:integration_tests \
        python integration_tests/it_fuzz.py START COUNT [BUDGET_S]

prints one JSON line per seed (``"status": "ok" | "FAIL" | "EXC"``).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

from nvdd.core import Batch, maxwell_boltzmann
from nvdd.dynamics import (
    FIRE,
    MTKNPT,
    CellDOF,
    DomainConfig,
    DomainParallel,
    HookScope,
    HookStage,
    Langevin,
    NoseHooverNVT,
    VelocityVerlet,
)
from nvdd.models import LennardJones, LJConfig, MPNNConfig, ReferenceMPNN


# ---------------------------------------------------------------- case generation
def factor_grids(world: int) -> list[tuple[int, int, int]]:
    out = []
    for a in range(1, world + 1):
        for b in range(1, world + 1):
            for c in range(1, world + 1):
                if a * b * c == world:
                    out.append((a, b, c))
    return out


def random_case(seed: int) -> dict[str, Any]:
    r = random.Random(seed)
    model = r.choice(["lj64", "lj64", "lj64", "lj32", "mpnn2", "mpnn3"])
    cutoff = r.choice([4.0, 5.0, 6.0, 7.5]) if model.startswith("lj") else r.choice([3.0, 4.0, 5.0])
    world = r.choice([2, 2, 3, 4, 4])
    grid = None if r.random() < 0.35 else r.choice(factor_grids(world))
    skin = r.choice([0.0, 0.1, 0.5, 1.0])
    pbc_kind = r.choice(["ppp", "ppp", "ppp", "slab", "wire", "open"])
    if pbc_kind == "ppp":
        pbc = [True, True, True]
    elif pbc_kind == "slab":
        pbc = [True, True, True]
        pbc[r.randrange(3)] = False
    elif pbc_kind == "wire":
        pbc = [False, False, False]
        pbc[r.randrange(3)] = True
    else:
        pbc = [False, False, False]
    cellkind = r.choice(["cubic", "ortho", "tric", "tric", "thin"])
    integ = r.choice(["vv", "vv", "langevin", "fire", "nh", "npt_iso", "npt_full"])
    if integ.startswith("npt") and not all(pbc):
        integ = "nh"
    temp = r.choice([5.0, 50.0, 300.0, 2000.0, 20000.0])
    phase = r.choice(["crystal", "liquid", "gas"])
    zero_open = r.random() < 0.5
    spacing = r.uniform(3.6, 4.4)
    dt = r.choice([1.0, 2.0, 4.0]) if model.startswith("lj") else r.choice([0.5, 1.0])
    if temp >= 2000:
        dt = min(dt, 2.0)
    steps = r.choice([10, 20, 30])
    if model == "lj32" and temp >= 20000:
        # float32 at 20,000 K: rounding differences between any two summation
        # orders grow past the float32 tolerance within 30 steps (seed 3755:
        # fine at 10 steps, and at 30 in float64); compare the first 10
        steps = 10
    if model == "lj32" and integ.startswith("npt"):
        # float32 under the barostat (the cell moves every step): the same growth
        # passes the float32 energy tolerance near step 30 in hot systems (seeds
        # 7607 and 7653) and in a 5 K liquid quenched from a random start under
        # the full-cell barostat (seed 11528: 7.4e-5 on 2.97 at 30 steps; equal
        # in float64 at 30 steps, in float32 at 20); compare at most 20
        steps = min(steps, 20)
    every = r.choice([0, 1, 3, 7])
    species = (
        r.choice([(18,), (18, 10), (10, 18, 36)])
        if model.startswith("lj")
        else r.choice([(18,), (18, 36)])
    )
    case = {
        "seed": seed,
        "model": model,
        "cutoff": cutoff,
        "world": world,
        "grid": grid,
        "skin": skin,
        "pbc": pbc,
        "cellkind": cellkind,
        "integ": integ,
        "temp": temp,
        "phase": phase,
        "zero_open": zero_open,
        "spacing": spacing,
        "dt": dt,
        "steps": steps,
        "every": every,
        "species": species,
        "tilts": [r.uniform(-0.5, 0.5) for _ in range(3)],
        "shape": [r.choice([3, 4, 5, 6]) for _ in range(3)],
        "hooks_scope": r.choice(["rank_zero", "global", "local"]),
        "lb": r.random() < 0.3,
        "hyst": r.choice([None, None, 0.0, "half"]),
        "gw_extra": r.choice([0.0, 0.0, 1.5]),
        "strategy": r.choice(["halo", "halo", "halo", "graph_partition"]),
        "one_rank": r.random() < 0.08,
        "stage": r.choice(["after_step", "after_compute", "before_step"]),
    }
    # drawn from a second stream, so that adding it left every other choice of
    # a seed as it was: a checkpoint at a random step, and the rest of the run
    # from it in a new DomainParallel (HALO only: GRAPH_PARTITION refuses)
    extra = random.Random(seed * 13 + 7)
    restart = extra.random() < 0.3 and case["strategy"] == "halo" and steps > 1
    case["restart_at"] = extra.randrange(1, steps) if restart else None
    # a third stream (the same reason): the whole periodic axes left to the
    # model (DomainConfig(wrap_whole_axes=True), record 0079) in half the HALO
    # cases; NVDD_FUZZ_WRAP=1 in every HALO case, =0 in none
    forced = os.environ.get("NVDD_FUZZ_WRAP")
    wrap = random.Random(seed * 17 + 3).random() < 0.5 if forced is None else forced == "1"
    case["wrap"] = wrap and case["strategy"] == "halo"
    return case


def min_dist(pos: torch.Tensor, cell: torch.Tensor, pbc: list[bool]) -> float:
    rng = [range(-2, 3) if p else range(1) for p in pbc]
    best = float("inf")
    for s in itertools.product(*rng):
        sh = torch.tensor(s, dtype=torch.float64) @ cell
        d = (pos[:, None, :] - pos[None, :, :] + sh).norm(dim=-1)
        if all(x == 0 for x in s):
            d.fill_diagonal_(float("inf"))
        best = min(best, float(d.min()))
    return best


def build_batch(c: dict[str, Any]) -> Batch:
    if "explicit" in c:
        e = c["explicit"]
        b = Batch(
            positions=e["pos"].clone(),
            atomic_numbers=e["z"].clone(),
            cell=e["cell"].clone(),
            pbc=torch.tensor(c["pbc"]),
            atom_ids=e["ids"].clone(),
        )
        b = b.replace(velocities=e["vel"].clone())
        return b.to(dtype=torch.float32) if c["model"] == "lj32" else b
    g = torch.Generator().manual_seed(c["seed"])
    r = random.Random(c["seed"] * 7 + 1)
    s = c["spacing"]
    n = list(c["shape"])
    if c["cellkind"] == "ortho":
        n[r.randrange(3)] *= 2
    if c["cellkind"] == "thin":
        # box slightly larger than needed: a few spacings
        n = [3, 3, 3]
        n[r.randrange(3)] = 6
    L = [k * s for k in n]
    cell = torch.diag(torch.tensor(L, dtype=torch.float64))
    if c["cellkind"] == "tric":
        t = c["tilts"]
        cell[1, 0] = t[0] * L[0]
        cell[2, 0] = t[1] * L[0]
        cell[2, 1] = t[2] * L[1]
    grid = torch.stack(
        torch.meshgrid(*[torch.arange(k, dtype=torch.float64) for k in n], indexing="ij"), -1
    ).reshape(-1, 3)
    frac = (grid + 0.5) / torch.tensor(n, dtype=torch.float64)
    jit = {"crystal": 0.02, "liquid": 0.12, "gas": 0.12}[c["phase"]]
    frac = frac + jit * torch.randn(frac.shape, generator=g, dtype=torch.float64) / torch.tensor(
        n, dtype=torch.float64
    )
    if c["phase"] == "gas":
        keep = torch.rand(frac.shape[0], generator=g) < 0.4
        keep[0] = True
        keep[1] = True
        frac = frac[keep]
    pos = frac @ cell
    # guard against overlaps
    md = min_dist(pos, cell, c["pbc"])
    if md < 2.9:
        # shrink jitter: re-place on the lattice
        frac = ((grid + 0.5) / torch.tensor(n, dtype=torch.float64))[: frac.shape[0]]
        pos = frac @ cell
    pbc = torch.tensor(c["pbc"])
    if c["zero_open"]:
        cell = cell.clone()
        for ax in range(3):
            if not c["pbc"][ax]:
                cell[ax] = 0.0
    na = pos.shape[0]
    z = torch.tensor(c["species"])[torch.randint(len(c["species"]), (na,), generator=g)]
    ids = torch.randperm(na * 3, generator=g)[:na] * 2 + 5
    b = Batch(positions=pos, atomic_numbers=z, cell=cell, pbc=pbc, atom_ids=ids)
    b = b.replace(velocities=maxwell_boltzmann(b.masses, c["temp"], generator=g))
    if c["model"] == "lj32":
        b = b.to(dtype=torch.float32)
    return b


def build_model(c: dict[str, Any]) -> Any:
    if c["model"].startswith("lj"):
        cfg = LJConfig(
            cutoff=c["cutoff"],
            species={18: (0.0104, 3.40), 10: (0.0031, 2.75), 36: (0.014, 3.65)},
            skin=0.3,
        )
        m = LennardJones(cfg)
        return m.to(torch.float32) if c["model"] == "lj32" else m.to(torch.float64)
    nl = int(c["model"][-1])
    cfg = MPNNConfig(
        cutoff=c["cutoff"], species=(18, 36), hidden=16, n_basis=6, n_layers=nl, seed=3, skin=0.3
    )
    return ReferenceMPNN(cfg, dtype=torch.float64)


def build_dyn(c: dict[str, Any], model: Any, b: Batch) -> Any:
    i = c["integ"]
    dt = c["dt"]
    if i == "vv":
        return VelocityVerlet(model, b, dt_fs=dt)
    if i == "langevin":
        return Langevin(
            model,
            b,
            dt_fs=dt,
            temperature_K=max(c["temp"], 1.0),
            friction_per_fs=0.02,
            seed=c["seed"],
        )
    if i == "fire":
        return FIRE(model, b, dt_fs=dt, dt_max_fs=max(dt, 4.0), fmax=1e-4)
    if i == "nh":
        return NoseHooverNVT(model, b, dt_fs=dt, temperature_K=max(c["temp"], 1.0), tau_fs=50.0)
    return MTKNPT(
        model,
        b,
        dt_fs=dt,
        temperature_K=max(c["temp"], 1.0),
        pressure_bar=500.0,
        tau_t_fs=50.0,
        tau_p_fs=200.0,
        cell_dof=CellDOF.ISOTROPIC if i == "npt_iso" else CellDOF.FULL,
    )


def _rec(batch: Batch) -> dict[str, Any]:
    return {
        "ids": batch.atom_ids.clone(),
        "pos": batch.positions.clone().double(),
        "forces": batch.forces.clone().double(),
        "energy": batch.energy.clone().double(),
        "cell": batch.cell.clone().double(),
    }


# ---------------------------------------------------------------- bodies
def _hooks(dp: Any, c: dict[str, Any], series: list[Any], local_e: list[float]) -> None:
    if not c["every"]:
        return
    stage = HookStage(c.get("stage", "after_step"))
    sc = {"rank_zero": HookScope.RANK_ZERO, "global": HookScope.GLOBAL, "local": HookScope.LOCAL}[
        c["hooks_scope"]
    ]
    if sc is HookScope.LOCAL:
        dp.register_hook(
            stage,
            lambda ctx: local_e.append(float(ctx.batch.energy.double().sum())),
            every=c["every"],
            needs=["energy"],
        )
    else:
        dp.register_hook(
            stage,
            lambda ctx: series.append({"step": ctx.step, **_rec(ctx.batch)}),
            every=c["every"],
            scope=sc,
            needs=["energy"],
        )


def dd_body(c: dict[str, Any]) -> dict[str, Any]:
    b = build_batch(c)
    model = build_model(c)
    dyn = build_dyn(c, model, b)
    from nvdd.spec import StrategyKind

    hy = c.get("hyst")
    if hy == "half":
        hy = c["skin"] / 2
    if hy is not None and c["skin"] == 0:
        hy = None
    gp = c.get("strategy", "halo") == "graph_partition"
    cfg = DomainConfig(
        cutoff=c["cutoff"],
        skin=c["skin"],
        grid_dims=tuple(c["grid"]) if (c["grid"] and not gp and not c.get("one_rank")) else None,
        load_balance=bool(c.get("lb", False)) and not gp,
        migration_hysteresis=None if gp else hy,
        ghost_width=(c["cutoff"] + c["skin"] + c["gw_extra"]) if c.get("gw_extra") else None,
        strategy=StrategyKind(c.get("strategy", "halo")),
        halo_on_one_rank=True,
        wrap_whole_axes=bool(c.get("wrap", False)) and not gp,
    )
    series: list[dict[str, Any]] = []
    local_e: list[float] = []
    restart_at = c.get("restart_at")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with DomainParallel(dyn, cfg) as dp:
            dp.partition()
            _hooks(dp, c, series, local_e)
            if restart_at is None:
                res = dp.run(c["steps"])
                final, stats, steps_done = dp.gather(0), dp.stats, dyn.step_count
            else:
                dp.run(restart_at)
                path = os.path.join(tempfile.gettempdir(), f"nvdd-fuzz-{c['seed']}-{os.getppid()}")
                dp.save(path)
        if restart_at is not None:  # the rest of the run from the checkpoint
            dyn = build_dyn(c, build_model(c), build_batch(c))
            with DomainParallel(dyn, cfg) as dp:
                dp.load(path)
                _hooks(dp, c, series, local_e)
                res = dp.run(c["steps"] - restart_at)
                final, stats, steps_done = dp.gather(0), dp.stats, dyn.step_count
            if dp.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    if final is None:
        return {"migrated": stats.migrated, "n_local": int(dyn.batch.n_atoms)}
    return {
        "n_local": int(dyn.batch.n_atoms),
        "final": _rec(final),
        "series": series,
        "local_e": local_e,
        "ret": res,
        "steps": steps_done,
        "rebuilds": stats.rebuilds,
        "migrated": stats.migrated,
    }


def single_body(c: dict[str, Any]) -> dict[str, Any]:
    b = build_batch(c)
    model = build_model(c)
    dyn = build_dyn(c, model, b)
    series: list[dict[str, Any]] = []
    if c["every"]:
        dyn.register_hook(
            HookStage(c.get("stage", "after_step")),
            lambda ctx: series.append({"step": ctx.step, **_rec(ctx.batch)}),
            every=c["every"],
            needs=["energy"],
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = dyn.run(c["steps"])
    return {"final": _rec(dyn.batch), "series": series, "ret": res, "steps": dyn.step_count}


# ---------------------------------------------------------------- comparison
def wrapped(d: torch.Tensor, cell: torch.Tensor, pbc: list[bool]) -> torch.Tensor:
    per = torch.tensor(pbc)
    if not bool(per.any()):
        return d
    c = cell.clone()
    for ax in range(3):
        if not pbc[ax] and c[ax].norm() == 0:
            c[ax] = 0
            c[ax, ax] = 1.0
    frac = torch.linalg.solve(c.T, d.T).T
    frac = torch.where(per, frac - torch.round(frac), frac)
    return frac @ c


def compare_states(
    a: dict[str, Any], b: dict[str, Any], pbc: list[bool], tol: dict[str, float], what: str
) -> list[str]:
    errs = []
    ia, ib = a["ids"], b["ids"]
    sa, sb = torch.sort(ia).values, torch.sort(ib).values
    if sa.numel() != torch.unique(sa).numel():
        errs.append(
            f"{what}: duplicate ids in DD ({sa.numel()} rows, {torch.unique(sa).numel()} unique)"
        )
        return errs
    if not torch.equal(sa, sb):
        errs.append(
            f"{what}: id sets differ: DD n={sa.numel()} ref n={sb.numel()}; only DD {sorted(set(sa.tolist()) - set(sb.tolist()))[:5]} only ref {sorted(set(sb.tolist()) - set(sa.tolist()))[:5]}"
        )
        return errs
    oa, ob = torch.argsort(ia), torch.argsort(ib)
    cell = b["cell"][0]
    dcell = float((a["cell"][0] - cell).abs().max())
    if dcell > tol["pos"]:
        errs.append(f"{what}: cell differs by {dcell:.3e}")
    dx = wrapped(a["pos"][oa] - b["pos"][ob], cell, pbc).abs().max().item() if ia.numel() else 0.0
    if not dx <= tol["pos"]:
        errs.append(f"{what}: positions differ by {dx:.3e}")
    fa, fb = a["forces"][oa], b["forces"][ob]
    df = (fa - fb).abs()
    bound = tol["f"] * (1 + fb.abs())
    if not bool((df <= bound).all()):
        w = int(torch.argmax((df - bound).max(dim=1).values))
        errs.append(
            f"{what}: forces differ max {float(df.max()):.3e} at id {int(ia[oa][w])}: {fa[w].tolist()} vs {fb[w].tolist()}"
        )
    de = float((a["energy"] - b["energy"]).abs().max())
    if not de <= tol["e"] * (1 + float(b["energy"].abs().max())):
        errs.append(
            f"{what}: energy differs {float(a['energy'].sum()):.12g} vs {float(b['energy'].sum()):.12g} (diff {de:.3e})"
        )
    return errs


def tolerances(c: dict[str, Any]) -> dict[str, float]:
    if c["model"] == "lj32":
        return {"pos": 1e-3, "f": 1e-4, "e": 1e-5}
    return {"pos": 1e-8, "f": 1e-10, "e": 1e-10}


def check(c: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    from nvdd.testing import run_ranks

    allr = run_ranks(dd_body, 1 if c.get("one_rank") else c["world"], c, timeout_s=300)
    got = allr[0]
    got["migrated"] = sum(r["migrated"] for r in allr)
    got["n_local"] = [r["n_local"] for r in allr]
    ref = single_body(c)
    tol = tolerances(c)
    errs = compare_states(got["final"], ref["final"], c["pbc"], tol, "final")
    if got["steps"] != ref["steps"] or got["ret"] != ref["ret"]:
        errs.append(
            f"steps/return differ: DD {got['steps']} {got['ret']} vs ref {ref['steps']} {ref['ret']}"
        )
    if c["every"] and c["hooks_scope"] != "local":
        if len(got["series"]) != len(ref["series"]):
            errs.append(f"hook calls differ: {len(got['series'])} vs {len(ref['series'])}")
        for sa, sb in zip(got["series"], ref["series"], strict=False):
            if sa["step"] != sb["step"]:
                errs.append(f"hook step {sa['step']} vs {sb['step']}")
                break
            e = compare_states(sa, sb, c["pbc"], tol, f"hook@{sa['step']}")
            if e:
                errs.extend(e)
                break
    if c["every"] and c["hooks_scope"] == "local":
        if len(got["local_e"]) != len(ref["series"]):
            errs.append(f"local hook calls differ: {len(got['local_e'])} vs {len(ref['series'])}")
        for ea, sb in zip(got["local_e"], ref["series"], strict=False):
            eb = float(sb["energy"].sum())
            if abs(ea - eb) > tol["e"] * (1 + abs(eb)):
                errs.append(f"local hook energy@{sb['step']}: {ea:.12g} vs {eb:.12g}")
                break
    info = {
        "n": int(ref["final"]["ids"].numel()),
        "rebuilds": got["rebuilds"],
        "migrated": got["migrated"],
        "n_local": got["n_local"],
    }
    return errs, info


def main() -> None:
    start, count = int(sys.argv[1]), int(sys.argv[2])
    budget = float(sys.argv[3]) if len(sys.argv) > 3 else 1e9
    t0 = time.time()
    for seed in range(start, start + count):
        if time.time() - t0 > budget:
            break
        c = random_case(seed)
        ts = time.time()
        try:
            errs, info = check(c)
            status = "FAIL" if errs else "ok"
        except Exception as e:
            info = {}
            errs = [f"EXC {type(e).__name__}: {str(e)[-1500:]}"]
            status = "EXC"
        short = {
            k: c[k]
            for k in (
                "model",
                "cutoff",
                "world",
                "grid",
                "skin",
                "pbc",
                "cellkind",
                "integ",
                "temp",
                "phase",
                "zero_open",
                "steps",
                "every",
                "hooks_scope",
                "wrap",
                "species",
            )
        }
        print(
            json.dumps(
                {
                    "seed": seed,
                    "status": status,
                    "t": round(time.time() - ts, 1),
                    "info": info,
                    "case": short,
                    "errs": errs,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
