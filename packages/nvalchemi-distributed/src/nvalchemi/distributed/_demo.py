"""The per-rank body of ``nvdd run`` (the main job)."""

from __future__ import annotations

import argparse
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from nvalchemi.distributed._models import AR_LATTICE, build_model, builtin_system
from nvdd.core import Batch, OptionalDependencyError, init_distributed
from nvdd.dynamics import (
    KB_EV_PER_K,
    BaseDynamics,
    DomainConfig,
    DomainParallel,
    HookScope,
    HookStage,
    Langevin,
    VelocityVerlet,
    kinetic_energy,
)

__all__ = ["argon_box", "run_rank"]


def argon_box(cells: int, *, dtype: torch.dtype, temperature_K: float, seed: int) -> Batch:
    """An FCC argon crystal of ``cells**3`` unit cells (4 atoms each), periodic,
    with Maxwell-Boltzmann velocities at ``temperature_K`` and zero momentum."""
    basis = torch.tensor([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]], dtype=dtype)
    grid = torch.stack(torch.meshgrid(*[torch.arange(cells, dtype=dtype)] * 3, indexing="ij"), -1)
    frac = (grid.reshape(-1, 1, 3) + basis).reshape(-1, 3)
    n = frac.shape[0]
    positions = frac * AR_LATTICE
    g = torch.Generator().manual_seed(seed)
    masses = torch.full((n,), 39.948, dtype=dtype)
    v = (
        torch.randn(n, 3, generator=g, dtype=dtype)
        * torch.sqrt(KB_EV_PER_K * temperature_K / masses)[:, None]
    )
    v -= v.mean(dim=0)
    return Batch(
        positions=positions,
        atomic_numbers=torch.full((n,), 18),
        masses=masses,
        velocities=v,
        cell=torch.eye(3, dtype=dtype) * cells * AR_LATTICE,
        pbc=[True, True, True],
    )


def _model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    return build_model(args, device, dtype)  # --model lj | mace (see _models.py)


def _load(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> Batch:
    if args.structure:
        try:
            from ase.io import read
        except ImportError as exc:
            raise OptionalDependencyError("ase", "--structure", extra="nvdd-core[ase]") from exc
        atoms = read(args.structure)
        return Batch.from_ase(atoms, dtype=dtype, device=device)
    builtin = builtin_system(args, dtype)  # the model's own box (MACE: O/Si), else argon
    if builtin is not None:
        return builtin.to(device)
    return argon_box(args.cells, dtype=dtype, temperature_K=args.temperature, seed=args.seed).to(
        device
    )


def _empty(dtype: torch.dtype, device: torch.device) -> Batch:
    return Batch(
        torch.zeros(0, 3, dtype=dtype, device=device),
        torch.zeros(0, dtype=torch.int64, device=device),
    )


class _Thermo:
    """Rank 0 prints and records a thermo table; every rank joins the reductions."""

    def __init__(
        self,
        dp: DomainParallel,
        phase: str,
        offset: int,
        rows: list[dict[str, float]],
        out: Path,
        traj_every: int,
        bar: Any = None,
    ) -> None:
        self.dp, self.phase, self.offset, self.rows = dp, phase, offset, rows
        self.say = bar.write if bar is not None else print
        self.out, self.traj_every = out, traj_every
        self.t_last, self.step_last = time.perf_counter(), 0

    def thermo(self, ctx: Any) -> None:
        dyn = self.dp.dynamics
        ke = float(kinetic_energy(ctx.batch, dyn.reducer).sum())
        n_total = float(dyn.reducer.sum(torch.tensor([float(ctx.batch.n_atoms)]))[0])
        counts = self.dp.sharded.owned_counts
        epot = float(ctx.batch.energy.sum())
        now = time.perf_counter()
        ms = 1000.0 * (now - self.t_last) / max(1, ctx.step - self.step_last)
        self.t_last, self.step_last = now, ctx.step
        if self.dp.rank != 0:
            return
        row = {
            "step": float(self.offset + ctx.step),
            "T": 2.0 * ke / (3.0 * n_total * KB_EV_PER_K),
            "E_pot": epot,
            "E_kin": ke,
            "E_tot": epot + ke,
            "atoms_min": float(min(counts)),
            "atoms_max": float(max(counts)),
            "ms_per_step": ms,
        }
        self.rows.append(row)
        self.say(
            f"{self.phase:>4} {int(row['step']):>7d} {row['T']:9.2f} {row['E_pot']:14.6f} "
            f"{row['E_tot']:14.6f} {int(row['atoms_min']):>7d}-{int(row['atoms_max']):<7d} "
            f"{row['ms_per_step']:9.1f}",
        )

    def frame(self, ctx: Any) -> None:
        from ase.io import write

        atoms = ctx.batch.to_ase()
        for a in atoms:
            a.info["step"] = self.offset + ctx.step
        write(self.out / "trajectory.extxyz", atoms, format="extxyz", append=True)


def _run_phase(
    dyn: BaseDynamics,
    args: argparse.Namespace,
    phase: str,
    offset: int,
    n_steps: int,
    rows: list[dict[str, float]],
    out: Path,
    batch: Batch | None,
    bar: Any,
) -> tuple[Batch | None, DomainParallel]:
    config = DomainConfig(
        cutoff=args.cutoff,
        skin=args.skin,
        grid_dims=tuple(args.grid) if args.grid else None,
        load_balance=args.load_balance,
    )
    dp = DomainParallel(dyn, config)
    if dp.rank != 0:  # one copy of each partition warning is enough
        warnings.filterwarnings("ignore", category=UserWarning)
    thermo = _Thermo(dp, phase, offset, rows, out, args.traj_every, bar)
    dp.register_hook(HookStage.AFTER_STEP, thermo.thermo, every=args.thermo_every, needs=["energy"])
    if args.traj_every > 0 and _has_ase():
        dp.register_hook(
            HookStage.AFTER_STEP, thermo.frame, every=args.traj_every, scope=HookScope.RANK_ZERO
        )
    if bar is not None:
        dp.register_hook(HookStage.AFTER_STEP, lambda ctx: bar.update(1))
    with dp:
        dp.partition(batch)
        dp.run(n_steps)
        final = dp.gather(0)
    return final, dp


def _has_ase() -> bool:
    try:
        import ase  # noqa: F401
    except ImportError:
        return False
    return True


def _compare(args: argparse.Namespace, final: Batch, model: Any, start: Batch | None) -> None:
    """Rank 0: the 1-rank reference, compared by atom id."""
    if args.compare == "none":
        return
    if args.compare == "trajectory" and start is not None:
        ref_dyn: BaseDynamics = Langevin(
            model,
            start.clone(),
            dt_fs=args.dt,
            temperature_K=args.temperature,
            friction_per_fs=args.friction,
            seed=args.seed,
        )
        ref_dyn.run(args.nvt_steps)
        ref_dyn = VelocityVerlet(model, ref_dyn.batch, dt_fs=args.dt)
        ref_dyn.run(args.nve_steps)
        ref = ref_dyn.batch.sort_by_id()
        d = ref.positions - final.positions
        frac = torch.linalg.solve(ref.cell[0].T, d.T).T
        frac = torch.where(ref.pbc[0], frac - torch.round(frac), frac)
        dpos = float((frac @ ref.cell[0]).abs().max())
        print(f"compare (trajectory, 1 rank vs {args.nproc}): max |dx| = {dpos:.3e} A")
        out = model(ref)
        forces, energy = out["forces"], out["energy"]
    else:
        out = model(final)
        forces, energy = out["forces"], out["energy"]
    df = float((forces.detach() - final.forces).abs().max())
    de = float((energy.detach() - final.energy).abs().max())
    print(
        f"compare (1 rank vs {args.nproc}, by atom id): max |dF| = {df:.3e} eV/A, "
        f"|dE| = {de:.3e} eV over {final.n_atoms} atoms"
    )


def _plot(rows: list[dict[str, float]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("E_pot", "E_kin", "E_tot"):
        ax.plot(steps, [r[key] for r in rows], label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("energy (eV)")
    ax.legend()
    ax.set_title("nvdd run: NVT then NVE")
    fig.tight_layout()
    fig.savefig(out / "energies.png", dpi=120)
    plt.close(fig)


def run_rank(args: argparse.Namespace) -> int:
    """One rank of ``nvdd run``; returns the process exit status."""
    backend = "nccl" if args.device == "cuda" else "gloo"
    env = init_distributed(backend=backend)
    device, rank = env.device, env.rank
    dtype = getattr(torch, args.dtype)
    out = Path(args.out)
    model = _model(args, device, dtype)
    args.cutoff = float(model.cutoff)  # the halo follows the model (MACE: its r_max)
    start = _load(args, dtype, device) if rank == 0 else None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        traj = out / "trajectory.extxyz"
        if traj.exists():
            traj.unlink()
        n = start.n_atoms if start is not None else 0
        print(
            f"nvdd run: {n} atoms on {env.world_size} {args.device} rank(s) ({env.backend}); "
            f"NVT {args.nvt_steps} + NVE {args.nve_steps} steps of {args.dt} fs"
        )
        print(
            f"{'':>4} {'step':>7} {'T(K)':>9} {'E_pot(eV)':>14} {'E_tot(eV)':>14} "
            f"{'atoms/rank':>15} {'ms/step':>9}",
            flush=True,
        )
    bar = None
    if rank == 0:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.nvt_steps + args.nve_steps, unit="step", leave=False)
        except ImportError:
            bar = None
    rows: list[dict[str, float]] = []
    t0 = time.perf_counter()
    placeholder = _empty(dtype, device)
    nvt = Langevin(
        model,
        start if start is not None else placeholder,
        dt_fs=args.dt,
        temperature_K=args.temperature,
        friction_per_fs=args.friction,
        seed=args.seed,
    )
    state, _ = _run_phase(nvt, args, "NVT", 0, args.nvt_steps, rows, out, start, bar)
    nve = VelocityVerlet(model, state if state is not None else placeholder, dt_fs=args.dt)
    final, dp = _run_phase(nve, args, "NVE", args.nvt_steps, args.nve_steps, rows, out, state, bar)
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if rank == 0 and final is not None:
        steps = args.nvt_steps + args.nve_steps
        print(
            f"done: {steps} steps in {elapsed:.1f} s ({1000 * elapsed / max(1, steps):.1f} "
            f"ms/step); halo rebuilds {dp.stats.rebuilds}, last step's collectives "
            f"{dict(dp.stats.last_collectives)}"
        )
        _write_csv(rows, out)
        _plot(rows, out)
        _compare(args, final, model, start)
        print(
            f"outputs in {out}/: thermo.csv, energies.png"
            + (", trajectory.extxyz" if args.traj_every > 0 and _has_ase() else "")
        )
        drift = _drift(rows, args.nvt_steps)
        if drift is not None:
            print(f"NVE energy drift: {drift:.3e} eV/atom over the NVE phase")
    return 0


def _write_csv(rows: list[dict[str, float]], out: Path) -> None:
    if not rows:
        return
    keys = list(rows[0])
    lines = [",".join(keys)] + [",".join(f"{r[k]:.10g}" for k in keys) for r in rows]
    (out / "thermo.csv").write_text("\n".join(lines) + "\n")


def _drift(rows: list[dict[str, float]], nvt_steps: int) -> float | None:
    nve = [r for r in rows if r["step"] > nvt_steps]
    if len(nve) < 2:
        return None
    n = max(1.0, rows[0]["atoms_max"])
    return abs(nve[-1]["E_tot"] - nve[0]["E_tot"]) / n if math.isfinite(n) else None
