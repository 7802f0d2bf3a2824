"""StrategyKind.GRAPH_PARTITION: N ranks equal 1 rank by atom id (reference MPNN,
LJ and MACE).

The model builds its own neighbour list on each rank's index block plus the atoms
its edges read, with the real cell and pbc; float64 forces within 1e-10 eV/A.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from it_ranks import run_dd, single, steady_collectives
from it_systems import mace_model, oxide, wrapped_max_diff

from nvdd.core import Batch, ConfigurationError, maxwell_boltzmann, shutdown_distributed
from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet
from nvdd.spec import DistributionSpec, StrategyKind
from nvdd.testing import assert_close_by_id, assert_same_ids, run_ranks

pytestmark = pytest.mark.gloo

SPECIES = (18, 36)

# (id, world, system, model, steps)
CASES = [
    ("mpnn2-periodic-2", 2, "periodic", "mpnn2", 40),
    ("mpnn2-cluster-2", 2, "cluster", "mpnn2", 40),
    ("mpnn3-triclinic-3", 3, "triclinic", "mpnn3", 40),
    ("mpnn2-cluster-3", 3, "cluster", "mpnn2", 40),
    ("mpnn2-slab-4", 4, "slab", "mpnn2", 40),
    ("mpnn2-cluster-4", 4, "cluster", "mpnn2", 40),
    ("lj-periodic-4", 4, "periodic", "lj", 40),
]


def _check(got: dict, ref: dict, dx_max: float) -> None:
    assert_same_ids(got["ids"], ref["ids"], "atom set after the run")
    order = ref["ids"].argsort()
    dx = wrapped_max_diff(got["positions"], ref["positions"][order], ref["cell"], ref["pbc"])
    assert dx < dx_max, f"positions differ by {dx:.3e} A"
    assert_close_by_id(
        got["ids"], got["forces"], ref["ids"], ref["forces"], atol=1e-10, what="forces"
    )
    assert float((got["energy"] - ref["energy"]).abs().max()) < 1e-10


@pytest.mark.parametrize(
    ("name", "world", "kind", "model", "steps"), CASES, ids=[c[0] for c in CASES]
)
def test_graph_partition_equals_one_rank_by_id(
    name: str, world: int, kind: str, model: str, steps: int
) -> None:
    species = SPECIES if model.startswith("mpnn") else (18,)
    dt = 1.0 if model.startswith("mpnn") else 4.0
    got = run_ranks(
        run_dd,
        world,
        kind,
        model,
        steps,
        dt,
        None,
        species=species,
        temperature_k=300.0,
        strategy="graph_partition",
        timeout_s=600,
    )[0]
    ref = single(kind, model, steps, dt, species=species, temperature_k=300.0)
    _check(got, ref, 1e-8)
    assert got["rebuilds"] >= 1 and got["n_ghost"] > 0


def test_graph_partition_500_step_nve_conserves_atoms_and_energy() -> None:
    steps, every = 500, 50
    got = run_ranks(
        run_dd,
        2,
        "periodic",
        "mpnn2",
        steps,
        1.0,
        None,
        species=SPECIES,
        every=every,
        temperature_k=300.0,
        strategy="graph_partition",
        timeout_s=900,
    )[0]
    ref = single("periodic", "mpnn2", steps, 1.0, species=SPECIES, every=every, temperature_k=300.0)
    assert got["ids_checks"] == steps // every  # a GLOBAL hook saw every id once, 10 times
    assert got["rebuilds"] > 1
    _check(got, ref, 1e-6)
    drift_dd = max(abs(e - got["energies"][0]) for e in got["energies"])
    drift_1 = max(abs(e - ref["energies"][0]) for e in ref["energies"])
    assert abs(drift_dd - drift_1) < 1e-8, (drift_dd, drift_1)


# ------------------------------------------------------------------------ MACE
GP = StrategyKind.GRAPH_PARTITION
MACE_LAYERS = 3  # two refreshes per forward: interactions 1 and 2 read neighbours
MACE_DT, MACE_STEPS, MACE_SKIN = 1.0, 8, 0.3


def _mace_system(kind: str) -> Batch:
    """36 O/Si atoms (8 x 6 x 6 A), hot enough (3000 K) to rebuild within the run;
    ``kind``: ``periodic`` or ``open`` (the same atoms, pbc all False)."""
    batch = oxide((4, 3, 3))
    if kind == "open":
        batch = batch.replace(pbc=torch.zeros_like(batch.pbc))
    return batch.replace(velocities=maxwell_boltzmann(batch.masses, 3000.0, seed=5))


def _mace_gp_rank(
    kinds: tuple[str, ...], steps: int, adapters: bool = True, stale: bool = False
) -> list[Any]:
    """Rank body: MACE under ``DomainParallel`` with ``StrategyKind.GRAPH_PARTITION``
    on every system of ``kinds``; rank 0 returns the state at t = 0 and after
    ``steps`` NVE steps, the collectives of each step that rebuilt nothing and the
    stats. ``adapters=False``: ``SPEC_MACE_GP`` without its adapters (no refresh).
    ``stale``: then one more entry, the periodic system at t = 0 without the
    adapters (the same world serves both tests)."""
    if stale:
        return [*_mace_gp_rank(kinds, steps, adapters), *_mace_gp_rank(("periodic",), 0, False)]
    out = []
    for kind in kinds:
        model = mace_model(MACE_LAYERS)
        spec = model.distribution_spec(GP)
        if not adapters:
            spec = spec.replace(distribution=DistributionSpec(storage=GP))
        dyn = VelocityVerlet(model, _mace_system(kind), dt_fs=MACE_DT)
        config = DomainConfig(cutoff=model.cutoff, skin=MACE_SKIN, strategy=GP)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # small systems: degenerate partitions
            with DomainParallel(dyn, config, spec=spec, count_collectives=True) as dp:
                dp.partition()
                dyn.ensure_forces()
                first = dp.gather(0)
                n_ghost = dp.stats.n_ghost
                quiet = steady_collectives(dp, steps)
                last = dp.gather(0)
                rebuilds = dp.stats.rebuilds
        out.append(
            {"first": first, "last": last, "quiet": quiet, "rebuilds": rebuilds, "n_ghost": n_ghost}
        )
    return out


def _mace_reference(kind: str, steps: int) -> tuple[dict[str, torch.Tensor], Batch]:
    """The single-process outputs at t = 0 and the state after ``steps`` steps."""
    batch = _mace_system(kind)
    outputs = dict(mace_model(MACE_LAYERS)(batch))
    dyn = VelocityVerlet(mace_model(MACE_LAYERS), batch, dt_fs=MACE_DT)
    dyn.run(steps)
    return outputs, dyn.batch


@functools.cache
def _mace_gp_world(world: int) -> list[Any]:
    """Every rank's :func:`_mace_gp_rank` on the periodic and the open system; on 2
    ranks also the periodic one without the adapters (cached: two tests read it)."""
    stale = world == 2
    return run_ranks(
        _mace_gp_rank, world, ("periodic", "open"), MACE_STEPS, stale=stale, timeout_s=600
    )


@pytest.mark.parametrize("world", [2, 3])
def test_mace_graph_partition_equals_one_process_by_id(world: int) -> None:
    """MACE (3 interactions) on a periodic and an open system: forces by atom id,
    energy and stress at t = 0 within 1e-10 (float64), and a short NVE run through
    a Verlet rebuild equal to one process. Each step that rebuilds nothing costs
    2 * L = 6 all_to_all_single (ghost positions, the L - 1 = 2 feature
    refreshes and their adjoints in the backward, the force fold) and 2
    all-reduces (the step's flag, the replicated energy)."""
    kinds = ("periodic", "open")
    got = _mace_gp_world(world)
    per_rank_ghosts = [[case["n_ghost"] for case in rank] for rank in got]
    for k, kind in enumerate(kinds):
        run = got[0][k]
        ref, ref_last = _mace_reference(kind, MACE_STEPS)
        first, last = run["first"], run["last"]
        assert_same_ids(first.atom_ids, ref_last.atom_ids, f"{kind}: atom set")
        assert_close_by_id(
            first.atom_ids, first.forces, ref_last.atom_ids, ref["forces"], atol=1e-10,
            what=f"{kind} forces",
        )  # fmt: skip
        torch.testing.assert_close(first.energy, ref["energy"], rtol=0, atol=1e-10)
        torch.testing.assert_close(first.stress, ref["stress"], rtol=0, atol=1e-10)
        assert float(ref["stress"].abs().max()) > 1e-4  # a stress worth comparing
        _check(
            {"ids": last.atom_ids, "positions": last.positions, "forces": last.forces,
             "energy": last.energy},
            {"ids": ref_last.atom_ids, "positions": ref_last.positions, "forces": ref_last.forces,
             "energy": ref_last.energy, "cell": ref_last.cell[0], "pbc": ref_last.pbc[0]},
            1e-8,
        )  # fmt: skip
        assert run["rebuilds"] >= 2, run["rebuilds"]  # the partition's and one in the run
        for rank in got:
            quiet = rank[k]["quiet"]
            assert quiet, f"{kind}: every step rebuilt"
            expected = {"all_to_all_single": 2 * MACE_LAYERS, "all_reduce": 2}
            assert all(c == expected for c in quiet), (kind, quiet)
        assert all(ghosts[k] > 0 for ghosts in per_rank_ghosts), per_rank_ghosts


def test_mace_graph_partition_without_the_refresh_is_detected() -> None:
    """``SPEC_MACE_GP`` with its adapters left out: the ghost rows keep features
    computed from incomplete neighbourhoods, and the forces show it."""
    got = _mace_gp_world(2)  # its last entry: the periodic system without the adapters
    first = got[0][-1]["first"]
    ref, _ = _mace_reference("periodic", 0)
    batch = _mace_system("periodic")
    with pytest.raises(AssertionError, match="forces differ"):
        assert_close_by_id(
            first.atom_ids, first.forces, batch.atom_ids, ref["forces"], atol=1e-6, what="forces"
        )


@pytest.mark.parametrize(("strategy", "other"), [(GP, StrategyKind.HALO), (StrategyKind.HALO, GP)])
def test_a_mace_spec_of_the_other_strategy_is_refused(
    strategy: StrategyKind, other: StrategyKind
) -> None:
    """A spec written for one strategy never runs under the other (no silent fallback)."""
    model = mace_model(2)
    spec = model.distribution_spec(other)
    dyn = VelocityVerlet(model, _mace_system("periodic"), dt_fs=MACE_DT)
    config = DomainConfig(cutoff=model.cutoff, skin=MACE_SKIN, strategy=strategy)
    try:
        with pytest.raises(ConfigurationError, match=rf"{spec.name} declares storage {other}"):
            DomainParallel(dyn, config, spec=spec)
    finally:
        shutdown_distributed()  # DomainParallel made a world of one in this process
