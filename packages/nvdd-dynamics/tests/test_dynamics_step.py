"""The step in one place (issue 35): DomainParallel binds a StepState to the
integrator and never sets its attributes."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from ckpt_ranks import gas
from dyn_models import SoftPair

from nvdd.core import shutdown_distributed
from nvdd.dynamics import DomainConfig, DomainParallel, HookStage, VelocityVerlet

#: What the integrator's own step writes on itself (its scalars and outputs).
OWN = {"step_count", "converged", "outputs"}


class Recording(VelocityVerlet):
    """Records every attribute set on it after construction, with the file of
    the code that set it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__["sets"] = []

    def __setattr__(self, name: str, value: Any) -> None:
        sets = self.__dict__.get("sets")
        if sets is not None:
            sets.append((name, sys._getframe(1).f_code.co_filename.rsplit("/", 1)[-1]))
        super().__setattr__(name, value)


def _identities(dyn: Recording) -> dict[str, int]:
    return {k: id(v) for k, v in vars(dyn).items() if k not in OWN | {"sets"}}


@pytest.mark.parametrize("halo", [False, True], ids=["whole-batch", "halo"])
def test_domain_parallel_sets_no_attribute_on_the_integrator(halo: bool) -> None:
    """partition, step, run and close of DomainParallel leave every attribute of
    the integrator as it was (the wiring is one StepState, bound and unbound);
    only the integrator's own step writes its scalars and outputs. The old
    partition() swapped force_provider, reducer, hook_runner, heartbeat,
    _forces_ready and the state owner."""
    dyn = Recording(SoftPair(), gas(n=24), dt_fs=1.0)
    dyn.register_hook(HookStage.AFTER_STEP, lambda ctx: None, needs=["energy"])
    before = _identities(dyn)
    config = DomainConfig(cutoff=2.5, skin=0.4, halo_on_one_rank=halo)
    dp = DomainParallel(dyn, config, watchdog_s=0)
    try:
        dp.partition()
        assert dyn.step_state is dp.step_state and dyn.batch is dp.sharded.local_batch
        assert dyn.reducer is dp.step_state.reducer and dyn.force_provider is dp.model
        dp.step()
        dp.run(2)
        assert dyn.step_count == 3
        dp.close()
        foreign = [(n, f) for n, f in dyn.sets if n not in OWN or f != "_step.py"]
        assert foreign == [], foreign
        assert _identities(dyn) == before
        assert dyn.step_state is not dp.step_state and dyn.step_state.heartbeat is None
        assert torch.isfinite(dyn.batch.forces).all() and dyn.batch.n_atoms == 24
        dyn.run(1)  # the integrator steps on alone, on the atoms it kept
        assert dyn.step_count == 4
    finally:
        dp.close()
        shutdown_distributed()  # the world of one this process created


#: Distinct project source files (modules of ``nvdd`` / ``nvalchemi``) one
#: steady 2-rank LJ step enters. Issue 35 asks for at most 15 (:data:`TARGET_STEP_FILES`); 36 were
#: entered before the step was written in one place (commit a463bcf), this many
#: now: lower it when a module on the path goes, never raise it.
STEADY_STEP_FILES = 15
TARGET_STEP_FILES = 15
#: Calls of project functions in that step, on each rank: a measure of its
#: per-step host work (record 0083). About 570 before the Warp launcher read
#: its arguments in one pass and the device list asked ``capturing()`` once a
#: call, about 200 after; a few more or fewer from run to run (a launch
#: converts only the tensors not at the addresses it held). Lower it with the
#: work, never raise it.
STEADY_STEP_CALLS = 240


def _lattice() -> Any:
    from nvdd.core import Batch

    g = torch.Generator().manual_seed(0)
    axes = (torch.arange(10), torch.arange(5), torch.arange(5))
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3).double() * 1.4
    return Batch(
        positions=grid + 0.02 * torch.randn(grid.shape, generator=g, dtype=torch.float64),
        atomic_numbers=torch.full((grid.shape[0],), 18),
        velocities=torch.randn(grid.shape, generator=g, dtype=torch.float64) * 0.002,
        cell=torch.diag(torch.tensor([14.0, 7.0, 7.5], dtype=torch.float64)),
        pbc=[True, True, True],
    )


def _files_of_a_steady_step() -> tuple[list[str], int, int, int]:
    from nvdd.models import LennardJones, LJConfig

    dyn = VelocityVerlet(LennardJones(LJConfig(cutoff=2.5, epsilon=0.02, sigma=1.05)), _lattice())
    config = DomainConfig(cutoff=2.5, skin=0.6, grid_dims=(2, 1, 1))
    with DomainParallel(dyn, config) as dp:
        dp.partition()
        dp.run(3)  # warm-up: the first forces, the first plan, first-call allocations
        rebuilds = dp.stats.rebuilds
        modules: list[str] = []

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                modules.append(str(frame.f_globals.get("__name__", "")))

        sys.setprofile(profile)
        try:
            dp.step()
        finally:
            sys.setprofile(None)
        # by module name, so the count is the same whether the packages run from
        # their source folders (PYTHONPATH) or installed (CI's environment)
        calls = [m for m in modules if m.split(".", 1)[0] in ("nvdd", "nvalchemi")]
        return sorted(set(calls)), len(calls), rebuilds, dp.stats.rebuilds


@pytest.mark.gloo
def test_a_steady_two_rank_step_enters_few_source_files() -> None:
    """One steady step (no rebuild) of velocity Verlet with Lennard-Jones on 2
    gloo ranks, traced with ``sys.setprofile``: the project source files it
    enters stay at :data:`STEADY_STEP_FILES` or fewer (the issue's target:
    :data:`TARGET_STEP_FILES`), the calls of their functions at
    :data:`STEADY_STEP_CALLS` or fewer."""
    from nvdd.testing import run_ranks

    for files, calls, before, after in run_ranks(_files_of_a_steady_step, 2, timeout_s=120):
        assert after == before, "the traced step rebuilt: it is not a steady step"
        assert "nvdd.dynamics._step" in files, files
        assert len(files) <= STEADY_STEP_FILES, "\n".join(files)
        assert 100 < calls <= STEADY_STEP_CALLS, calls


def test_output_rules_are_the_spec_s_own_derived_once() -> None:
    """Consolidation reads a spec's rules from a table made at its first use (a
    step calls nothing of the spec): the same rules the spec declares."""
    from nvdd.dynamics._provider import output_rules
    from nvdd.spec import SPEC_EWALD_HALO, SPEC_LJ_HALO, SPEC_MPNN_GP, SPEC_MPNN_HALO

    for spec in (SPEC_LJ_HALO, SPEC_MPNN_HALO, SPEC_MPNN_GP, SPEC_EWALD_HALO):
        rules = output_rules(spec)
        assert output_rules(spec) is rules
        assert rules.folds_forces == spec.folds_forces
        assert rules.owned_rows_exact == spec.owned_rows_exact
        assert rules.rules == {n: (o.kind, o.effective_reduce()) for n, o in spec.outputs.items()}
