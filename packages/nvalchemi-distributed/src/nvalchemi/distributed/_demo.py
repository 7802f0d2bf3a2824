"""The per-rank body of ``nvdd run`` (the main job).

Arguments were validated by the launcher before any rank started
(:mod:`nvalchemi.distributed._checks`). Rank 0 streams ``thermo.csv`` and
``trajectory.extxyz`` as rows come, writes ``energies.png`` atomically at the
end, and every rank writes its shard of ``checkpoint/`` every
``--checkpoint-every`` steps; ``--restart`` continues from such a checkpoint.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from nvalchemi.distributed._checks import (
    FIRST_PHASE_CLASSES,
    read_structure,
    restart_point,
)
from nvalchemi.distributed._models import AR_LATTICE, build_model, builtin_system
from nvalchemi.distributed._outputs import (
    ThermoLog,
    TrajectoryLog,
    nve_drift_per_atom,
    write_plot,
)
from nvdd.core import Batch, init_distributed
from nvdd.dynamics import (
    KB_EV_PER_K,
    MTKNPT,
    BaseDynamics,
    CellDOF,
    DomainConfig,
    DomainParallel,
    HookScope,
    HookStage,
    Langevin,
    NoseHooverNVT,
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
    if args.run_file:  # a (composed) model from a run file; the halo covers its cutoff
        from nvalchemi.distributed._runfile import build_model as build_composed
        from nvalchemi.distributed._runfile import load_run_file

        model = build_composed(load_run_file(args.run_file)).to(device=device, dtype=dtype)
        args.cutoff = float(model.cutoff)
        return model
    return build_model(args, device, dtype)  # --model lj | mace (see _models.py)


def _load(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> Batch:
    if args.run_file:
        from nvalchemi.distributed._runfile import build_system, load_run_file

        data = load_run_file(args.run_file)
        return build_system(
            data, dtype=dtype, device=device, temperature_k=args.temperature, seed=args.seed
        )
    if args.structure:
        return Batch.from_ase(read_structure(args.structure), dtype=dtype, device=device)
    builtin = builtin_system(args, dtype)  # the model's own box (MACE: O/Si), else argon
    if builtin is not None:
        return builtin.to(device)
    return argon_box(args.cells, dtype=dtype, temperature_K=args.temperature, seed=args.seed).to(
        device
    )


def _first_phase(args: argparse.Namespace, model: Any, batch: Batch) -> BaseDynamics:
    """The integrator of the first phase (``--ensemble``)."""
    if args.ensemble == "nvt-nh":
        return NoseHooverNVT(
            model, batch, dt_fs=args.dt, temperature_K=args.temperature, tau_fs=args.tau_t
        )
    if args.ensemble == "npt":
        return MTKNPT(
            model,
            batch,
            dt_fs=args.dt,
            temperature_K=args.temperature,
            pressure_bar=args.pressure,
            tau_t_fs=args.tau_t,
            tau_p_fs=args.tau_p,
            cell_dof=CellDOF(args.cell_dof),
        )
    return Langevin(
        model,
        batch,
        dt_fs=args.dt,
        temperature_K=args.temperature,
        friction_per_fs=args.friction,
        seed=args.seed,
    )


def _phase_name(args: argparse.Namespace) -> str:
    return "NPT" if args.ensemble == "npt" else "NVT"


def _empty(dtype: torch.dtype, device: torch.device) -> Batch:
    return Batch(
        torch.zeros(0, 3, dtype=dtype, device=device),
        torch.zeros(0, dtype=torch.int64, device=device),
    )


class _Run:
    """What the phases share: arguments, outputs (rank 0) and the restart point."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.out = Path(args.out)
        self.checkpoint_dir = self.out / "checkpoint"
        self.restart: dict[str, Any] | None = None
        if args.restart:
            meta = restart_point(args.restart)
            info = meta.get("metadata", {})
            state = meta["integrator"]["state"]
            first = meta["integrator"]["class"] in FIRST_PHASE_CLASSES
            phase = info.get("phase") or (_phase_name(args) if first else "NVE")
            offset = 0 if phase != "NVE" else args.nvt_steps
            step = int(info.get("step", offset + int(state["step_count"])))
            self.restart = {"phase": phase, "step": step}
        self.thermo: ThermoLog | None = None
        self.traj: TrajectoryLog | None = None
        self.bar: Any = None
        self.checkpoints = 0
        if rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            keep = self.restart["step"] if self.restart else None
            self.thermo = ThermoLog(self.out / "thermo.csv", keep_until=keep)
            if args.traj_every > 0 and _has_ase():
                self.traj = TrajectoryLog(self.out / "trajectory.extxyz", keep_until=keep)

    def close(self) -> None:
        for log in (self.thermo, self.traj):
            if log is not None:
                log.close()


class _Hooks:
    """The hooks of one phase: thermo (every rank joins the reductions), frames
    and checkpoints."""

    def __init__(self, run: _Run, dp: DomainParallel, phase: str, offset: int) -> None:
        self.run, self.dp, self.phase, self.offset = run, dp, phase, offset
        self.say = run.bar.write if run.bar is not None else print
        self.t_last, self.step_last = time.perf_counter(), dp.dynamics.step_count

    def thermo(self, ctx: Any) -> None:
        dyn = self.dp.dynamics
        ke = float(kinetic_energy(ctx.batch, dyn.reducer).sum())
        n_total = float(dyn.reducer.sum(torch.tensor([float(ctx.batch.n_atoms)]))[0])
        counts = self.dp.sharded.owned_counts
        epot = float(ctx.batch.energy.sum())
        now = time.perf_counter()
        ms = 1000.0 * (now - self.t_last) / max(1, ctx.step - self.step_last)
        self.t_last, self.step_last = now, ctx.step
        if self.run.thermo is None:
            return
        row = {
            "step": float(self.offset + ctx.step),
            "T": 2.0 * ke / (3.0 * n_total * KB_EV_PER_K),
            "E_pot": epot,
            "E_kin": ke,
            "E_tot": epot + ke,
            "n_atoms": n_total,
            "atoms_min": float(min(counts)),
            "atoms_max": float(max(counts)),
            "ms_per_step": ms,
        }
        conserved = getattr(dyn, "conserved_energy", None)
        if conserved is not None:  # Nose-Hoover / NPT: the extended energy, and V, P
            row["E_ext"] = float(conserved().sum())
        if isinstance(dyn, MTKNPT):
            row["V"], row["P_bar"] = float(dyn.volume().sum()), float(dyn.pressure().mean())
        self.run.thermo.append(row)
        self.say(
            f"{self.phase:>4} {int(row['step']):>7d} {row['T']:9.2f} {row['E_pot']:14.6f} "
            f"{row['E_tot']:14.6f} {int(row['atoms_min']):>7d}-{int(row['atoms_max']):<7d} "
            f"{row['ms_per_step']:9.1f}",
        )

    def frame(self, ctx: Any) -> None:
        if self.run.traj is not None:
            self.run.traj.append(ctx.batch.to_ase(), self.offset + ctx.step)

    def checkpoint(self, ctx: Any) -> None:
        step = self.offset + ctx.step
        if step % self.run.args.checkpoint_every == 0:
            self.dp.save(self.run.checkpoint_dir, metadata={"phase": self.phase, "step": step})
            self.run.checkpoints += 1


def _run_phase(
    run: _Run, dyn: BaseDynamics, phase: str, offset: int, n_steps: int, batch: Batch | None
) -> tuple[Batch | None, DomainParallel]:
    args = run.args
    config = DomainConfig(
        cutoff=args.cutoff,
        skin=args.skin,
        grid_dims=tuple(args.grid) if args.grid else None,
        load_balance=args.load_balance,
    )
    dp = DomainParallel(dyn, config, watchdog_s=args.watchdog)
    if dp.rank != 0:  # one copy of each partition warning is enough
        warnings.filterwarnings("ignore", category=UserWarning)
    with dp:
        if run.restart is not None and run.restart["phase"] == phase:
            dp.load(args.restart)
        else:
            dp.partition(batch)
        hooks = _Hooks(run, dp, phase, offset)
        dp.register_hook(
            HookStage.AFTER_STEP, hooks.thermo, every=args.thermo_every, needs=["energy"]
        )
        if run.traj is not None or (args.traj_every > 0 and _has_ase()):
            dp.register_hook(
                HookStage.AFTER_STEP, hooks.frame, every=args.traj_every, scope=HookScope.RANK_ZERO
            )
        if args.checkpoint_every > 0:
            dp.register_hook(HookStage.AFTER_STEP, hooks.checkpoint)
        if run.bar is not None:
            dp.register_hook(HookStage.AFTER_STEP, lambda ctx: run.bar.update(1))
        dp.run(max(0, n_steps - dyn.step_count))
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
        ref_dyn = _first_phase(args, model, start.clone())
        ref_dyn.run(args.nvt_steps)
        ref_dyn = VelocityVerlet(model, ref_dyn.batch, dt_fs=args.dt)
        ref_dyn.run(args.nve_steps)
        ref = ref_dyn.batch.sort_by_id()
        d = ref.positions - final.positions
        frac = torch.linalg.solve(ref.cell[0].T, d.T).T
        frac = torch.where(ref.pbc[0], frac - torch.round(frac), frac)
        dpos = float((frac @ ref.cell[0]).abs().max())
        dcell = float((ref.cell - final.cell).abs().max())
        print(
            f"compare (trajectory, 1 rank vs {args.nproc}): max |dx| = {dpos:.3e} A, "
            f"|dcell| = {dcell:.3e} A"
        )
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


def run_rank(args: argparse.Namespace) -> int:
    """One rank of ``nvdd run``; returns the process exit status."""
    backend = "nccl" if args.device == "cuda" else "gloo"
    env = init_distributed(backend=backend)
    device, rank = env.device, env.rank
    dtype = getattr(torch, args.dtype)
    run = _Run(args, rank, env.world_size)
    try:
        return _main(run, env, device, dtype)
    finally:
        run.close()


def _main(run: _Run, env: Any, device: torch.device, dtype: torch.dtype) -> int:
    args, rank = run.args, run.rank
    model = _model(args, device, dtype)
    args.cutoff = float(model.cutoff)  # the halo follows the model (MACE: its r_max)
    start = _load(args, dtype, device) if rank == 0 else None
    restart = run.restart
    if rank == 0:
        n = start.n_atoms if start is not None else 0
        where = f"; restart from {args.restart} at step {restart['step']}" if restart else ""
        print(
            f"nvdd run: {n} atoms on {env.world_size} {args.device} rank(s) ({env.backend}); "
            f"{args.ensemble} {args.nvt_steps} + NVE {args.nve_steps} steps of {args.dt} fs{where}"
        )
        print(
            f"{'':>4} {'step':>7} {'T(K)':>9} {'E_pot(eV)':>14} {'E_tot(eV)':>14} "
            f"{'atoms/rank':>15} {'ms/step':>9}",
            flush=True,
        )
        try:
            from tqdm import tqdm

            done = restart["step"] if restart else 0
            total = args.nvt_steps + args.nve_steps
            run.bar = tqdm(total=total, initial=min(done, total), unit="step", leave=False)
        except ImportError:
            run.bar = None
    t0 = time.perf_counter()
    placeholder = _empty(dtype, device)
    state: Batch | None = start
    skip_first = restart is not None and restart["phase"] == "NVE"
    if not skip_first:
        first = _first_phase(args, model, start if start is not None else placeholder)
        state, _ = _run_phase(run, first, _phase_name(args), 0, args.nvt_steps, start)
    nve = VelocityVerlet(model, state if state is not None else placeholder, dt_fs=args.dt)
    final, dp = _run_phase(run, nve, "NVE", args.nvt_steps, args.nve_steps, state)
    elapsed = time.perf_counter() - t0
    if run.bar is not None:
        run.bar.close()
    if rank == 0 and final is not None:
        _report(run, final, model, start, dp, elapsed)
    return 0


def _report(
    run: _Run, final: Batch, model: Any, start: Batch | None, dp: DomainParallel, elapsed: float
) -> None:
    args, out = run.args, run.out
    steps = args.nvt_steps + args.nve_steps
    print(
        f"done: {steps} steps in {elapsed:.1f} s ({1000 * elapsed / max(1, steps):.1f} "
        f"ms/step); halo rebuilds {dp.stats.rebuilds}, last step's collectives "
        f"{dict(dp.stats.last_collectives)}"
    )
    rows = run.thermo.rows if run.thermo is not None else []
    written = []
    if rows:
        written.append("thermo.csv")
    if write_plot(rows, out / "energies.png"):
        written.append("energies.png")
    if run.traj is not None and run.traj.frames:
        written.append("trajectory.extxyz")
    if run.checkpoints or (args.restart and Path(args.restart) == run.checkpoint_dir):
        written.append("checkpoint/")
    _compare(args, final, model, start)
    print(f"outputs in {out}/: " + (", ".join(written) if written else "none"))
    drift = nve_drift_per_atom(rows, args.nvt_steps)
    if drift is not None:
        print(f"NVE energy drift: {drift:.3e} eV/atom over the NVE phase")
