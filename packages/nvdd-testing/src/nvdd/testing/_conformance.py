"""`assert_dd_equivalent`: the conformance kit a model author runs on their own model.

For every boundary variant of the author's batch (periodic, triclinic, mixed,
open: ``_systems``) and every world size, ranks are spawned on the CPU (gloo)
and run the public API exactly as a user does (``DomainParallel`` around a
``VelocityVerlet``): forces, energy and stress at t = 0, then a short NVE
trajectory. Everything is compared by atom id with the same model on one
process. A wrong spec (a missing ghost refresh, a wrong output rule) shows as
a difference; the failure names the spec in use and where to look next
(``trace_and_validate``).

A check that cannot fail is no check: a decomposition in which no pair of
atoms within the cutoff straddles two ranks would pass for any spec, so the
kit fails on it too, asking for a larger or denser system.

Needs nvdd-dynamics (``pip install 'nvdd-testing[conformance]'``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nvdd.core import (
    Batch,
    ConfigurationError,
    OptionalDependencyError,
    RankFailedError,
    all_gather_object,
)
from nvdd.testing._ranks import run_ranks
from nvdd.testing._systems import SYSTEMS, variants

if TYPE_CHECKING:
    from nvdd.spec import MLIPSpec

__all__ = ["ConformanceError", "ConformanceReport", "DDTolerances", "assert_dd_equivalent"]


class ConformanceError(AssertionError):
    """The decomposed model differs from the single-process model (or could not be
    checked); the message holds every failing case and the spec in use."""


@dataclass(frozen=True)
class DDTolerances:
    """Tolerances of the kit.

    Attributes
    ----------
    forces:
        Max ``|dF|`` by atom id (eV/A); relative to ``max |F|`` when ``relative``.
    energy:
        Max ``|dE|`` per system, per 1000 atoms (eV); relative to ``|E|`` when ``relative``.
    stress:
        Max ``|d stress|`` (eV/A^3); relative to ``max |stress|`` when ``relative``.
    positions:
        Max position difference after the trajectory (A, modulo lattice vectors on
        periodic axes), always absolute.
    relative:
        Whether ``forces``, ``energy`` and ``stress`` scale with the reference.
    """

    forces: float
    energy: float
    stress: float
    positions: float
    relative: bool = False

    @staticmethod
    def for_dtype(dtype: torch.dtype) -> DDTolerances:
        """The project's targets: float64 1e-10 absolute; float32 1e-5 relative."""
        if dtype == torch.float64:
            return DDTolerances(forces=1e-10, energy=1e-10, stress=1e-10, positions=1e-8)
        if dtype == torch.float32:
            return DDTolerances(
                forces=1e-5, energy=1e-5, stress=1e-4, positions=1e-4, relative=True
            )
        raise ConfigurationError(f"no default tolerances for {dtype}; pass tolerances=")


@dataclass(frozen=True)
class CaseResult:
    """One (system, world size) case: the largest differences found.

    ``errors`` maps ``forces``, ``energy``, ``stress`` (t = 0) and
    ``positions``, ``velocities``, ``forces_final``, ``energy_final`` (after the
    trajectory) to their maxima, and ``cross_rank_pairs`` to the number of
    owned-ghost pairs within the cutoff at t = 0; ``limits`` the tolerances
    applied; ``n_ghost`` the ghost atoms of every rank.
    """

    system: str
    world_size: int
    errors: dict[str, float]
    limits: dict[str, float]
    n_ghost: tuple[int, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """No problem found."""
        return not self.problems


@dataclass
class ConformanceReport:
    """Every case the kit ran, and the spec it ran with."""

    spec: str
    steps: int
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Every case passed."""
        return all(c.passed for c in self.cases)

    def summary(self) -> str:
        """A table of the largest differences, and every problem."""
        keys = ("forces", "energy", "stress", "positions", "forces_final")
        lines = [
            f"assert_dd_equivalent: {'PASSED' if self.passed else 'FAILED'} "
            f"({self.steps} NVE steps)",
            *("  " + line for line in self.spec.splitlines()),
            "  system     ranks  " + "  ".join(f"{k:>12}" for k in keys) + "  ghosts",
        ]
        for c in self.cases:
            errs = "  ".join(f"{c.errors.get(k, float('nan')):12.3e}" for k in keys)
            lines.append(f"  {c.system:<10} {c.world_size:>5}  {errs}  {list(c.n_ghost)}")
        for c in self.cases:
            lines += [f"  {c.system}, {c.world_size} ranks: {p}" for p in c.problems]
        return "\n".join(lines)


def _dynamics() -> Any:
    try:
        import nvdd.dynamics
    except ImportError as exc:
        raise OptionalDependencyError(
            "nvdd-dynamics",
            "nvdd.testing.assert_dd_equivalent",
            "nvdd-testing[conformance]",
            cause=exc,
        ) from exc
    return nvdd.dynamics


def _state(batch: Batch) -> dict[str, torch.Tensor]:
    keys = ("atom_ids", "positions", "velocities", "forces", "energy", "stress")
    return {k: getattr(batch, k).detach().cpu() for k in keys}


def _dd_rank(
    model: Any,
    cases: list[tuple[str, Batch]],
    spec: MLIPSpec | None,
    skin: float,
    steps: int,
    dt_fs: float,
    strategy: Any = None,
) -> list[dict[str, Any]]:
    """Rank body: every case through ``DomainParallel``; rank 0 returns the states.

    **Collective** over the default group (every rank runs every case).
    """
    dyn_mod = _dynamics()
    out: list[dict[str, Any]] = []
    for _, batch in cases:
        dyn = dyn_mod.VelocityVerlet(model, batch.clone(), dt_fs=dt_fs)
        config = dyn_mod.DomainConfig(cutoff=float(model.cutoff), skin=skin, strategy=strategy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # small systems: degenerate partitions
            with dyn_mod.DomainParallel(dyn, config, spec=spec) as dp:
                dp.partition()
                dyn.ensure_forces()
                ghosts = all_gather_object(_halo_pairs(dp, float(model.cutoff)))
                first = dp.gather(0)
                dp.run(steps)
                last = dp.gather(0)
        if first is not None and last is not None:
            out.append({"first": _state(first), "last": _state(last), "n_ghost": ghosts})
    return out


def _halo_pairs(dp: Any, cutoff: float) -> tuple[int, int]:
    """``(ghost atoms, owned-ghost pairs within the cutoff)`` of this rank's halo: the
    pairs whose interaction crosses a rank boundary (what a wrong spec gets wrong).

    Halo ghosts are explicit images (plain distances); graph-partition ghosts sit
    at their own positions in the real cell, so their distances are taken to the
    nearest periodic image (a lower bound on the pairs where an atom meets
    several images of one ghost: enough for "at least one pair crosses")."""
    plan = dp.model.plan
    local = dp.sharded.local_batch
    ghost = plan.ghost_positions(local.positions, local.cell)
    if ghost.shape[0] == 0 or local.n_atoms == 0:
        return int(ghost.shape[0]), 0
    x, g = local.positions.double(), ghost.double()
    if getattr(plan, "explicit_images", True) or not bool(local.pbc.any()):
        pairs = int((torch.cdist(x, g) < cutoff).sum())
        return int(ghost.shape[0]), pairs
    cell = local.cell[0].double()  # a single system: the kit's variants have one
    periodic = local.pbc[0].to(torch.float64)
    frac = (g[None, :, :] - x[:, None, :]) @ torch.linalg.inv(cell)
    frac = frac - torch.round(frac) * periodic
    pairs = int((torch.linalg.vector_norm(frac @ cell, dim=-1) < cutoff).sum())
    return int(ghost.shape[0]), pairs


def _reference(model: Any, batch: Batch, steps: int, dt_fs: float) -> dict[str, Any]:
    dyn_mod = _dynamics()
    dyn = dyn_mod.VelocityVerlet(model, batch.clone(), dt_fs=dt_fs)
    dyn.ensure_forces()
    first = _state(dyn.batch)
    dyn.run(steps)
    return {"first": first, "last": _state(dyn.batch)}


def _by_id(state: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    return state[key][torch.argsort(state["atom_ids"])].double()


def _wrapped(d: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Position differences with lattice vectors removed on periodic axes (one cell
    per atom, by id order)."""
    order = torch.argsort(batch.atom_ids.cpu())
    cell = batch.cell.double().cpu().index_select(0, batch.system_index.cpu()[order])
    pbc = batch.pbc.cpu().index_select(0, batch.system_index.cpu()[order])
    frac = torch.linalg.solve(cell.transpose(1, 2), d.unsqueeze(2)).squeeze(2)
    frac = torch.where(pbc, frac - torch.round(frac), frac)
    return torch.bmm(frac.unsqueeze(1), cell).squeeze(1)


def _compare(
    name: str,
    world: int,
    batch: Batch,
    ref: dict[str, Any],
    got: dict[str, Any],
    tol: DDTolerances,
    energy_optional: bool = False,
) -> CaseResult:
    problems: list[str] = []
    errors: dict[str, float] = {}
    limits: dict[str, float] = {}
    ids = torch.sort(batch.atom_ids.cpu()).values
    per_1000 = max(1.0, batch.n_atoms / 1000.0)
    for when, suffix in (("first", ""), ("last", "_final")):
        r, g = ref[when], got[when]
        if not torch.equal(torch.sort(g["atom_ids"]).values, ids):
            problems.append(
                f"the atom set after {'partition' if when == 'first' else 'the run'} "
                f"is not the input's (ids lost or duplicated)"
            )
            continue
        fr, fg = _by_id(r, "forces"), _by_id(g, "forces")
        scale_f = float(fr.abs().max()) if tol.relative and fr.numel() else 1.0
        checks = {
            f"forces{suffix}": ((fr - fg).abs(), tol.forces * scale_f, fg, fr),
            f"energy{suffix}": (
                (r["energy"].double() - g["energy"].double()).abs(),
                tol.energy * (float(r["energy"].abs().max()) if tol.relative else per_1000),
                None,
                None,
            ),
        }
        if energy_optional and bool(torch.isnan(g["energy"]).all()):
            # a receptive-field spec without atom_energies: no per-system energy
            # under DD (NaN, never a number); forces and the trajectory still count
            del checks[f"energy{suffix}"]
        if when == "first":
            scale_s = float(r["stress"].abs().max()) if tol.relative else 1.0
            checks["stress"] = (
                (r["stress"].double() - g["stress"].double()).abs(),
                tol.stress * max(scale_s, 1e-30),
                None,
                None,
            )
        else:
            dpos = _wrapped(_by_id(g, "positions") - _by_id(r, "positions"), batch).abs()
            checks["positions"] = (dpos, tol.positions, None, None)
            errors["velocities"] = float(
                (_by_id(g, "velocities") - _by_id(r, "velocities")).abs().max()
            )
        for key, (diff, limit, got_v, ref_v) in checks.items():
            worst = float(diff.max()) if diff.numel() else 0.0
            errors[key], limits[key] = worst, limit
            if not worst <= limit:  # NaN fails too
                where = ""
                if got_v is not None and ref_v is not None and diff.numel():
                    row = int(diff.reshape(diff.shape[0], -1).max(dim=1).values.argmax())
                    where = (
                        f" (worst atom id {int(ids[row])}: {got_v[row].tolist()} decomposed vs "
                        f"{ref_v[row].tolist()} single-process)"
                    )
                problems.append(f"{key} differ by {worst:.3e} > {limit:.3e}{where}")
    n_ghost = tuple(int(n) for n, _ in got["n_ghost"])
    cross = sum(int(p) for _, p in got["n_ghost"])
    errors["cross_rank_pairs"] = float(cross)
    if cross == 0:
        problems.append(
            "no pair of atoms within the cutoff straddles two ranks: this decomposition "
            "cannot detect a wrong spec; use a larger or denser system (or fewer ranks)"
        )
    return CaseResult(name, world, errors, limits, n_ghost, tuple(problems))


def assert_dd_equivalent(
    model: Any,
    batch: Batch,
    *,
    ranks: Sequence[int] = (2, 3, 4),
    steps: int = 20,
    systems: Sequence[str] = SYSTEMS,
    dt_fs: float = 0.5,
    skin: float = 0.3,
    spec: MLIPSpec | None = None,
    tolerances: DDTolerances | None = None,
    temperature_K: float = 300.0,
    timeout_s: float = 900.0,
    strategy: Any = None,
) -> ConformanceReport:
    """Check that ``model`` under domain decomposition equals ``model`` on one process.

    For every variant in ``systems`` of ``batch`` and every world size in
    ``ranks``: forces, energy and stress at t = 0 and the state after ``steps``
    velocity-Verlet steps (positions, forces, energy), by atom id, against the
    single-process run; the atom set is checked too. Ranks are CPU processes over
    gloo spawned from here (the model is moved to the CPU and pickled to them: its
    class must be importable, and a script must call this under
    ``if __name__ == "__main__":``). Call it from one process (a test), not from
    every rank of a torchrun job.

    Parameters
    ----------
    model:
        An ``nvdd.spec.BaseModelMixin`` (``cutoff``, ``distribution_spec``).
    batch:
        A small representative system (a few hundred atoms), float32 or float64,
        with a cell unless ``systems`` is ``("given",)`` or ``("open",)``.
        Without velocities, thermal ones at ``temperature_K`` are drawn.
    ranks:
        World sizes to run (each >= 2).
    steps:
        NVE steps of the trajectory check (0: single point only).
    systems:
        Boundary variants (``periodic``, ``triclinic``, ``mixed``, ``open``,
        ``given``).
    dt_fs, skin:
        Time step and Verlet skin of the decomposition.
    spec:
        Validate this spec instead of ``model.distribution_spec(strategy)``.
    tolerances:
        Default :meth:`DDTolerances.for_dtype` of the batch.
    timeout_s:
        Per world size; ranks still running then are killed.
    strategy:
        An ``nvdd.spec.StrategyKind`` (default ``HALO``): run the decomposition
        with ``DomainConfig(strategy=...)`` and the model's spec for it, e.g.
        ``StrategyKind.GRAPH_PARTITION`` for a model that opts in to graph
        partition.

    Returns
    -------
    ConformanceReport
        When every case passed (print ``.summary()`` for the numbers).

    Raises
    ------
    ConformanceError
        (an ``AssertionError``) naming every failing case, the largest
        differences, the worst atom id and the spec in use.
    ConfigurationError
        On bad arguments.
    OptionalDependencyError
        Without nvdd-dynamics.
    """
    dyn_mod = _dynamics()
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 2]
    if not ranks or bad:
        raise ConfigurationError(f"ranks must be ints >= 2, got {list(ranks)}")
    if steps < 0 or not dt_fs > 0 or skin < 0:
        raise ConfigurationError(
            f"need steps >= 0, dt_fs > 0 and skin >= 0, got {steps}, {dt_fs}, {skin}"
        )
    if isinstance(model, torch.nn.Module):
        model.to("cpu")  # the kit's ranks are CPU processes
    tol = tolerances if tolerances is not None else DDTolerances.for_dtype(batch.dtype)
    from nvdd.spec import StrategyKind

    kind = StrategyKind.HALO if strategy is None else StrategyKind(strategy)
    in_use = spec if spec is not None else model.distribution_spec(kind)
    cases = variants(batch.to("cpu"), systems, temperature_K)
    described = dyn_mod.describe_spec(in_use)
    if in_use.owned_rows_exact:
        described += (
            "\n  energy: compared only where the decomposed run has one (the receptive-field "
            "spec gives it from 'atom_energies')"
        )
    report = ConformanceReport(spec=described, steps=steps)
    refs = [_reference(model, b, steps, dt_fs) for _, b in cases]
    for world in ranks:
        try:
            got = run_ranks(
                _dd_rank,
                world,
                model,
                cases,
                spec,
                skin,
                steps,
                dt_fs,
                kind,
                timeout_s=timeout_s,
            )[0]
        except RankFailedError as exc:
            last = str(exc).strip().splitlines()[-1]
            report.cases += [
                CaseResult(name, world, {}, {}, (), (f"the decomposed run raised: {last}",))
                for name, _ in cases
            ]
            continue
        for (name, b), ref, g in zip(cases, refs, got, strict=True):
            report.cases.append(
                _compare(name, world, b, ref, g, tol, energy_optional=in_use.owned_rows_exact)
            )
    if not report.passed:
        raise ConformanceError(
            report.summary()
            + "\n  next: nvdd.dynamics.trace_and_validate(model, batch) names the first module "
            "whose per-atom output differs"
        )
    return report
