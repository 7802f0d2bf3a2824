"""The per-rank body of ``nvdd run`` (the main job).

Arguments were validated by the launcher before any rank started
(:mod:`nvalchemi.distributed._checks`). Rank 0 streams ``thermo.csv`` and
``trajectory.extxyz`` as rows come, writes ``energies.png`` atomically at the
end, and every rank writes its shard of ``checkpoint/`` every
``--checkpoint-every`` steps; ``--restart`` continues from such a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from nvalchemi.distributed._checks import (
    FIRST_PHASE_CLASSES,
    read_structure,
    restart_point,
    system_options,
)
from nvalchemi.distributed._console import (
    install_warning_format,
    missing_outputs,
    progress_bar,
    quiet_warp,
)
from nvalchemi.distributed._models import AR_LATTICE, build_model, builtin_system
from nvalchemi.distributed._outputs import (
    ThermoLog,
    TrajectoryLog,
    next_due,
    nve_drift_per_atom,
    output_due,
    write_plot,
)
from nvalchemi.distributed._stop import (
    PARENT_ENV,
    die_with_parent,
    install_stop_handlers,
    stop_signal,
)
from nvdd.core import (
    Batch,
    CommunicationError,
    any_rank,
    init_distributed,
    maxwell_boltzmann,
    shutdown_distributed,
)
from nvdd.dynamics import (
    KB_EV_PER_K,
    MTKNPT,
    BaseDynamics,
    CellDOF,
    DomainConfig,
    DomainParallel,
    HookStage,
    Langevin,
    NoseHooverNVT,
    VelocityVerlet,
    kinetic_energy,
)
from nvdd.spec import StrategyKind

__all__ = ["argon_box", "run_rank"]


def argon_box(cells: int, *, dtype: torch.dtype, temperature_K: float, seed: int) -> Batch:
    """An FCC argon crystal of ``cells**3`` unit cells (4 atoms each), periodic,
    with Maxwell-Boltzmann velocities at ``temperature_K`` and zero momentum."""
    basis = torch.tensor([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]], dtype=dtype)
    grid = torch.stack(torch.meshgrid(*[torch.arange(cells, dtype=dtype)] * 3, indexing="ij"), -1)
    frac = (grid.reshape(-1, 1, 3) + basis).reshape(-1, 3)
    n = frac.shape[0]
    positions = frac * AR_LATTICE
    masses = torch.full((n,), 39.948, dtype=dtype)
    v = maxwell_boltzmann(masses, temperature_K=temperature_K, seed=seed)
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
        system = build_system(
            data, dtype=dtype, device=device, temperature_k=args.temperature, seed=args.seed
        )
        return _with_velocities(system, args)
    if args.structure:
        batch = Batch.from_ase(read_structure(args.structure), dtype=dtype, device=device)
        return _with_velocities(batch, args)
    builtin = builtin_system(args, dtype)  # the model's own box (MACE: O/Si), else argon
    if builtin is not None:
        return builtin.to(device)
    return argon_box(args.cells, dtype=dtype, temperature_K=args.temperature, seed=args.seed).to(
        device
    )


def _with_velocities(batch: Batch, args: argparse.Namespace) -> Batch:
    """``batch``, or, when it has no velocities at all (a structure file without
    them), with Maxwell-Boltzmann velocities at ``--temperature``; the header line
    then says so (``args.velocity_note``)."""
    if args.temperature <= 0 or bool(batch.velocities.abs().gt(0).any()):
        return batch
    v = maxwell_boltzmann(
        batch.masses, args.temperature, seed=args.seed, system_index=batch.system_index
    )
    args.velocity_note = (
        f"; velocities drawn at {args.temperature:g} K (Maxwell-Boltzmann, seed "
        f"{args.seed}): the structure has none"
    )
    return batch.replace(velocities=v.to(device=batch.velocities.device, dtype=batch.dtype))


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
        self.system = system_options(args)  # stored with every checkpoint
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
        self.current: tuple[BaseDynamics, int] | None = None  # the phase running, its offset
        if rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            # A restart records the checkpoint's step again (from the checkpoint): a
            # run stopped between its checkpoint and that step's outputs lacks them.
            keep = self.restart["step"] - 1 if self.restart else None
            self.thermo = ThermoLog(self.out / "thermo.csv", keep_until=keep)
            if args.traj_every > 0 and _has_ase():
                self.traj = TrajectoryLog(self.out / "trajectory.extxyz", keep_until=keep)

    def start_logs(self, ctx: Any = None) -> None:
        """The restart's first step succeeded: cut the streamed files back to the
        checkpoint's step and write on (a no-op once started, and on fresh runs)."""
        for log in (self.thermo, self.traj):
            if log is not None:
                log.start()

    def close(self) -> None:
        for log in (self.thermo, self.traj):
            if log is not None:
                log.close()


class _Hooks:
    """What a phase records: thermo rows and frames at the steps
    :func:`~nvalchemi.distributed._outputs.output_due` names (counted over the
    whole run), and checkpoints."""

    def __init__(self, run: _Run, dp: DomainParallel, phase: str, offset: int) -> None:
        self.run, self.dp, self.phase, self.offset = run, dp, phase, offset
        self.say = run.bar.write if run.bar is not None else print
        self.t_last, self.step_last = time.perf_counter(), offset + dp.dynamics.step_count
        self.recorded = -1  # the last global step recorded (a step is recorded once)

    def record(self, step: int) -> None:
        """The thermo row and the frame due at the global ``step``, if any.
        **Collective** (every rank calls it at the same steps)."""
        args = self.run.args
        total = args.nvt_steps + args.nve_steps
        thermo = output_due(step, args.thermo_every, total)
        frame = output_due(step, args.traj_every, total) and _has_ase()
        if not (thermo or frame) or step == self.recorded:
            return
        self.recorded = step
        failed: Exception | None = None
        try:
            if thermo:
                self.thermo(step)
            if frame:
                whole = self.dp.gather(0)  # every rank: rank 0 writes
                if whole is not None and self.run.traj is not None:
                    self.run.traj.append(whole.to_ase(), step)
        except Exception as exc:  # rank 0's files (a full disk): every rank stops here
            failed = exc
        if any_rank(failed is not None, self.dp.group):
            if failed is not None:
                raise failed
            raise CommunicationError(
                f"rank {self.run.rank}: stopped at step {step}: another rank failed "
                "recording the outputs"
            )

    def thermo(self, step: int) -> None:
        dyn = self.dp.dynamics
        dyn.ensure_forces()
        self.dp.totals(("energy",))
        batch = dyn.batch
        ke = float(kinetic_energy(batch, dyn.reducer).sum())
        n_total = float(dyn.reducer.sum(torch.tensor([float(batch.n_atoms)]))[0])
        counts = self.dp.sharded.owned_counts
        epot = float(batch.energy.sum())
        now = time.perf_counter()
        ms = (
            1000.0 * (now - self.t_last) / (step - self.step_last) if step > self.step_last else 0.0
        )
        self.t_last, self.step_last = now, step
        if self.run.thermo is None:
            return
        row = {
            "step": float(step),
            "T": 2.0 * ke / (3.0 * n_total * KB_EV_PER_K),
            "E_pot": epot,
            "E_kin": ke,
            "E_tot": epot + ke,
            "n_atoms": n_total,
            "atoms_min": float(min(counts)),
            "atoms_max": float(max(counts)),
            "ms_per_step": ms,
        }
        # Nose-Hoover / NPT: the extended energy, and V, P (from a step's sums: from
        # the phase's first step on; NaN in the row of step 0)
        conserved = getattr(dyn, "conserved_energy", None)
        if conserved is not None and dyn.step_count > 0:
            row["E_ext"] = float(conserved().sum())
        if isinstance(dyn, MTKNPT) and dyn.step_count > 0:
            row["V"], row["P_bar"] = float(dyn.volume().sum()), float(dyn.pressure().mean())
        self.run.thermo.append(row)
        self.say(
            f"{self.phase:>4} {int(row['step']):>7d} {row['T']:9.2f} {row['E_pot']:14.6f} "
            f"{row['E_tot']:14.6f} {int(row['atoms_min']):>7d}-{int(row['atoms_max']):<7d} "
            f"{row['ms_per_step']:9.1f}",
        )

    def checkpoint(self, step: int) -> None:
        """The checkpoint of the global ``step`` when one is due. **Collective**.

        Called between ``dp.run`` segments, not as a hook: a hook every rank
        registers is agreed on after each due step (one all-reduce), which an
        every-step hook would pay at every step."""
        every = self.run.args.checkpoint_every
        if every > 0 and step % every == 0:
            # the outputs of this step first: a checkpoint never gets ahead of the
            # files a restart from it keeps (up to its step)
            self.record(step)
            info = {"phase": self.phase, "step": step, "system": self.run.system}
            self.dp.save(self.run.checkpoint_dir, metadata=info)
            self.run.checkpoints += 1


#: Integrator attributes set from this run's options that a restart keeps
#: (``load`` restores the checkpoint's; the dynamics options may change between
#: segments of a run).
_APPLIED = (
    "dt_fs",
    "temperature_K",
    "friction_per_fs",
    "seed",
    "tau_fs",
    "tau_t_fs",
    "tau_p_fs",
    "pressure_bar",
    "cell_dof",
)


def _run_phase(
    run: _Run, dyn: BaseDynamics, phase: str, offset: int, n_steps: int, batch: Batch | None
) -> tuple[Batch | None, DomainParallel]:
    args = run.args
    graph = getattr(args, "strategy", "halo") == "graph-partition"
    config = DomainConfig(
        cutoff=args.cutoff,
        skin=args.skin,
        grid_dims=tuple(args.grid) if args.grid else None,
        load_balance=args.load_balance,
        strategy=StrategyKind.GRAPH_PARTITION if graph else StrategyKind.HALO,
    )
    dp = DomainParallel(dyn, config, watchdog_s=args.watchdog)
    run.current = (dyn, offset)
    if dp.rank != 0:  # one copy of each partition warning is enough
        warnings.filterwarnings("ignore", category=UserWarning)
    with dp:
        if run.restart is not None and run.restart["phase"] == phase:
            given = {k: getattr(dyn, k) for k in _APPLIED if hasattr(dyn, k)}
            dp.load(args.restart)
            for key, value in given.items():  # this run's options, not the checkpoint's
                setattr(dyn, key, value)
        else:
            dp.partition(batch)
        hooks = _Hooks(run, dp, phase, offset)
        if run.restart is not None and run.rank == 0:
            dp.register_hook(HookStage.AFTER_STEP, run.start_logs)
        if run.bar is not None:
            dp.register_hook(HookStage.AFTER_STEP, lambda ctx: run.bar.update(1))
        # Run from one due output step to the next: rows, frames and checkpoints
        # fall on global steps (0, every interval of the whole run, the last
        # step; checkpoints every interval), whatever the phase lengths.
        step, end = offset + dyn.step_count, offset + n_steps
        if step == 0 or (run.restart is not None and run.restart["phase"] == phase):
            hooks.record(step)
        while step < end:
            due = min(
                next_due(step, args.thermo_every, end),
                next_due(step, args.traj_every, end),
                next_due(step, args.checkpoint_every, end),
            )
            dp.run(due - step)
            if offset + dyn.step_count == step:  # converged (a minimiser): no more steps
                break
            step = offset + dyn.step_count
            hooks.record(step)
            hooks.checkpoint(step)
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
    """One rank of ``nvdd run``; returns the process exit status.

    A user's stop (SIGTERM to ``nvdd``, Ctrl-C) ends every rank without a
    traceback: rank 0 writes the plot of the rows so far and prints one line;
    the status is ``128 + signal`` (see :mod:`nvalchemi.distributed._stop`).
    """
    if not die_with_parent(os.environ.get(PARENT_ENV)):
        return 128 + signal.SIGTERM  # torchrun is gone already
    install_warning_format(int(os.environ.get("RANK", "0")))
    quiet_warp()
    backend = "nccl" if args.device == "cuda" else "gloo"
    env = init_distributed(backend=backend)
    install_stop_handlers()
    device, rank = env.device, env.rank
    dtype = getattr(torch, args.dtype)
    run = _Run(args, rank, env.world_size)
    try:
        status = _main(run, env, device, dtype)
    except BaseException:
        signum = stop_signal()
        if signum is None:
            raise
        _stopped(run, signum)  # the stop, or a collective that failed after a peer left
        return 128 + signum
    finally:
        run.close()
    # every rank is done (rank 0 last, after its comparison): the group is destroyed
    # on all ranks together, before any of them ends (record 0090)
    shutdown_distributed(barrier=True)
    return status


def _stopped(run: _Run, signum: int) -> None:
    """Rank 0, after a user's stop: the plot of the rows so far, and one line."""
    if run.rank != 0:
        return
    if run.bar is not None:
        run.bar.close()
    run.close()
    rows = run.thermo.rows if run.thermo is not None else []
    kept = ["thermo.csv"] if rows else []
    if write_plot(rows, run.out / "energies.png"):
        kept.append("energies.png")
    if run.traj is not None and run.traj.frames:
        kept.append("trajectory.extxyz")
    if run.checkpoints or (run.args.restart and Path(run.args.restart) == run.checkpoint_dir):
        kept.append("checkpoint/")
    where = ""
    if run.current is not None:
        dyn, offset = run.current
        where = f" at step {offset + dyn.step_count}"
    print(
        f"stopped by {signal.Signals(signum).name}{where}; outputs kept: "
        + (", ".join(kept) if kept else "none"),
        flush=True,
    )


def _main(run: _Run, env: Any, device: torch.device, dtype: torch.dtype) -> int:
    args, rank = run.args, run.rank
    model = _model(args, device, dtype)
    args.cutoff = float(model.cutoff)  # the halo follows the model (MACE: its r_max)
    start = _load(args, dtype, device) if rank == 0 else None
    restart = run.restart
    if rank == 0:
        for note in missing_outputs(args.traj_every > 0):
            print(note, file=sys.stderr)
        n = start.n_atoms if start is not None else 0
        where = ""
        if restart:
            where = (
                f"; restart from {args.restart} at step {restart['step']}: {_to_run(run)} to run"
            )
        print(
            f"nvdd run: {n} atoms on {env.world_size} {args.device} rank(s) ({env.backend}); "
            f"{args.ensemble} {args.nvt_steps} + NVE {args.nve_steps} steps of {args.dt} fs{where}"
            f"{'' if restart else getattr(args, 'velocity_note', '')}"
        )
        print(
            f"{'':>4} {'step':>7} {'T(K)':>9} {'E_pot(eV)':>14} {'E_tot(eV)':>14} "
            f"{'atoms/rank':>15} {'ms/step':>9}",
            flush=True,
        )
        done = restart["step"] if restart else 0
        run.bar = progress_bar(args.nvt_steps + args.nve_steps, done)  # on a terminal
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
    run.start_logs()  # (a restart with no step left: the files end at the checkpoint)
    if run.bar is not None:
        run.bar.close()
    if rank == 0 and final is not None:
        _report(run, final, model, start, dp, elapsed)
    return 0


def _steps_run(run: _Run) -> int:
    """Steps this run takes: all of both phases, or those after the restart's step."""
    total = int(run.args.nvt_steps) + int(run.args.nve_steps)
    return max(0, total - int(run.restart["step"])) if run.restart else total


def _to_run(run: _Run) -> str:
    n = _steps_run(run)
    return f"{n} step{'' if n == 1 else 's'}"


def _report(
    run: _Run, final: Batch, model: Any, start: Batch | None, dp: DomainParallel, elapsed: float
) -> None:
    args, out = run.args, run.out
    steps = _steps_run(run)
    since = f" (restart from step {run.restart['step']})" if run.restart else ""
    rebuilds = dp.stats.rebuilds
    print(
        f"done: {_to_run(run)}{since} in {elapsed:.1f} s ({1000 * elapsed / max(1, steps):.1f} "
        f"ms/step); the NVE phase built its halo {rebuilds} time{'s' if rebuilds != 1 else ''} "
        "(at its start, then whenever an atom had moved more than half the skin)"
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
