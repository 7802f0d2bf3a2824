"""Nothing silent (issue 17): non-finite values stop the run on every rank, the
runtime follows the spec's force rule, and a fixed structure has a single-point
API whose forces are computed (never the zeros of an untouched batch)."""

from __future__ import annotations

import pytest
import torch
from dyn_models import SoftPair
from test_dynamics_domain_parallel import make_gas

from nvdd.core import ValidationError
from nvdd.dynamics import DomainConfig, DomainParallel, HookStage, VelocityVerlet
from nvdd.spec import SPEC_LJ_HALO, OutputKind, OutputSpec, Reduce
from nvdd.testing import assert_close_by_id, run_ranks

pytestmark = pytest.mark.gloo


def _nan_mid_run(field: str, bad_rank: int) -> str:
    import torch.distributed as dist

    dyn = VelocityVerlet(SoftPair(), make_gas(n=40), dt_fs=0.5)
    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=1.0)) as dp:
        dp.partition()

        def poison(ctx: object) -> None:
            if dist.get_rank() == bad_rank and dyn.step_count == 3 and dyn.batch.n_atoms:
                t = getattr(dyn.batch, field).clone()
                t[0, 1] = float("nan")
                dyn.batch = dyn.batch.replace(**{field: t})

        dp.register_hook(HookStage.AFTER_PRE_UPDATE, poison)
        try:
            dp.run(10)
        except ValidationError as exc:
            return f"step {dyn.step_count}: {exc}"
    return "no error"


@pytest.mark.parametrize("field", ["positions", "velocities", "forces"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_nan_mid_run_stops_every_rank_with_the_atom_named(field: str, world: int) -> None:
    """Two ranks: the rebuild flag carries it (same step). One rank (the whole
    batch, no decision to read): a lazily read flag, at most a few steps late on
    a GPU, at once on the CPU, and always before run() returns."""
    bad = world - 1
    out = run_ranks(_nan_mid_run, world, field, bad, timeout_s=120)
    assert all(o == out[0] for o in out), "the ranks disagree"
    assert out[0].startswith("step 3:"), out[0]
    assert f"rank {bad}: 1 of" in out[0] and f"non-finite {field}" in out[0]
    assert "atom id" in out[0]


def _blown_up(bad_rank: int) -> str:
    import torch.distributed as dist

    dyn = VelocityVerlet(SoftPair(), make_gas(n=40, pbc=(False, False, False)), dt_fs=0.5)
    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=1.0)) as dp:
        dp.partition()

        def fling(ctx: object) -> None:
            if dist.get_rank() == bad_rank and dyn.step_count == 2 and dyn.batch.n_atoms:
                dyn.batch.positions[0] = torch.tensor([2.0e6, 1.0, 1.0], dtype=torch.float64)

        dp.register_hook(HookStage.AFTER_PRE_UPDATE, fling)
        try:
            dp.run(6)
        except ValidationError as exc:
            return f"step {dyn.step_count}: {exc}"
    return "no error"


def test_an_atom_flung_a_million_angstrom_away_is_named_not_a_crash() -> None:
    """An open system whose atom flew 2e6 A away: a named error on every rank (a
    neighbour search there can die with SIGFPE instead of raising)."""
    out = run_ranks(_blown_up, 2, 1, timeout_s=120)
    assert out[0] == out[1]
    assert out[0].startswith("step 2:") and "beyond 1e+06 A" in out[0] and "atom id" in out[0]


def _owned_only_forces() -> dict:
    """SoftPair returns forces on ghost rows (they must be folded); a spec that
    declares them owned-only is followed, so the result is NOT silently fixed."""
    wrong = SPEC_LJ_HALO.replace(
        outputs={
            **SPEC_LJ_HALO.outputs,
            "forces": OutputSpec(OutputKind.PER_NODE, Reduce.OWNED_ONLY),
        }
    )
    out = {}
    for name, spec in (("declared", SPEC_LJ_HALO), ("owned_only", wrong)):
        dyn = VelocityVerlet(SoftPair(), make_gas(n=40), dt_fs=0.5)
        with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=1.0), spec=spec) as dp:
            dp.partition()
            final = dp.gather(0)
        if final is not None:
            out[name] = (final.atom_ids, final.forces)
    return out


def test_the_runtime_follows_the_spec_force_rule() -> None:
    got = run_ranks(_owned_only_forces, 2, timeout_s=120)[0]
    ref = SoftPair()(make_gas(n=40))["forces"]
    ids = make_gas(n=40).atom_ids
    ids_d, f_d = got["declared"]
    assert_close_by_id(ids_d, f_d, ids, ref, atol=1e-12, what="forces (folded, as declared)")
    ids_o, f_o = got["owned_only"]
    order = torch.argsort(ids)
    diff = float((f_o - ref[order][torch.searchsorted(ids[order], ids_o)]).abs().max())
    assert diff > 1e-3, "owned-only forces were folded anyway (the spec was not followed)"


def _single_point() -> dict:
    batch = make_gas(n=40)
    dyn = VelocityVerlet(SoftPair(), batch, dt_fs=0.5)
    out: dict = {}
    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=1.0)) as dp:
        dp.partition()
        first = dp.gather(0)  # no step ran: forces are computed, not zeros
        if first is not None:
            out["gather"] = (first.atom_ids, first.forces, first.energy, first.stress)
        # move every atom (a scan), then a single point at the new positions
        dyn.batch = dyn.batch.replace(positions=dyn.batch.positions * 1.01)
        moved = dp.single_point(dst=None)
        assert moved is not None
        out["single_point"] = (moved.atom_ids, moved.forces, moved.energy, moved.stress)
    return out


def test_gather_after_partition_and_single_point_compute_forces() -> None:
    got = run_ranks(_single_point, 2, timeout_s=120)
    batch = make_gas(n=40)
    ref = {k: v.detach() for k, v in SoftPair()(batch).items()}
    ids, f, e, s = got[0]["gather"]
    assert float(f.abs().max()) > 0
    assert_close_by_id(ids, f, batch.atom_ids, ref["forces"], atol=1e-12, what="forces")
    assert float((e - ref["energy"]).abs().max()) < 1e-12
    assert float(ref["stress"].abs().max()) > 1e-4  # a stress worth comparing
    assert float((s - ref["stress"]).abs().max()) < 1e-12, (s, ref["stress"])
    scaled = batch.replace(positions=batch.positions * 1.01)
    ref2 = {k: v.detach() for k, v in SoftPair()(scaled).items()}
    assert float((ref2["stress"] - ref["stress"]).abs().max()) > 1e-6  # it moved
    for rank in (0, 1):  # dst=None: every rank has the whole system
        ids2, f2, e2, s2 = got[rank]["single_point"]
        assert_close_by_id(ids2, f2, scaled.atom_ids, ref2["forces"], atol=1e-12, what="forces")
        assert float((e2 - ref2["energy"]).abs().max()) < 1e-12
        assert s2.shape == ref2["stress"].shape == (1, 3, 3)
        assert float((s2 - ref2["stress"]).abs().max()) < 1e-12, (rank, s2, ref2["stress"])


@pytest.mark.gpu
def test_the_lazy_flag_reads_a_cuda_nan_without_blocking_each_step() -> None:
    from nvdd.dynamics._finite import LazyFiniteCheck

    batch = make_gas(n=40).to("cuda")
    check = LazyFiniteCheck()
    check.push(batch)
    assert check.poll(block=True) is False
    v = batch.velocities.clone()
    v[3, 0] = float("inf")
    check.push(batch.replace(velocities=v))
    assert check.poll(block=True) is True
