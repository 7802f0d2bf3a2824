"""ShardedBatch over gloo: scatter, gather, to_global, update, migrate, hysteresis.

Rank bodies live in ``partition_ranks`` (they check each rank's own rows against
the unsharded oracle by atom id); the tests here check what ranks return.
"""

from __future__ import annotations

import re

import pytest
import torch
from partition_ranks import (
    errors,
    expected,
    meshes_and_broadcast,
    migrate_cases,
    migrate_with_a_new_cell,
    ping_pong_cases,
    scatter_gather_cases,
)
from partition_testlib import assert_batches_equal, make_batch

from nvdd.core import ConfigurationError
from nvdd.partition import ShardedBatch, SpatialPartitioner
from nvdd.testing import run_ranks

# (n, kind, n_systems, balance, src, dst, dtype) per world size. Two-system cases
# mix boundary kinds: periodic + open, mixed + triclinic, triclinic + mixed.
_SCATTER_CASES = {
    2: [
        (90, "periodic", 1, "UNIFORM", 0, 1, "float64"),
        (70, "open", 1, "UNIFORM", 1, 0, "float32"),
    ],
    3: [
        (90, "triclinic", 1, "QUANTILE", 2, 0, "float64"),
        (90, "periodic", 2, "QUANTILE", 0, 2, "float64"),
    ],
    4: [
        (90, "open", 1, "QUANTILE", 1, 3, "float64"),
        (90, "mixed", 1, "UNIFORM", 0, 0, "float64"),
        (90, "mixed", 2, "UNIFORM", 3, 1, "float64"),
    ],
    8: [(120, "triclinic", 2, "QUANTILE", 5, 6, "float32")],
}


@pytest.mark.gloo
@pytest.mark.parametrize("world", sorted(_SCATTER_CASES))
def test_scatter_then_gather_is_the_identity(world: int) -> None:
    cases = _SCATTER_CASES[world]
    out = run_ranks(scatter_gather_cases, world, cases)
    for i, (n, _, n_systems, balance, *_rest) in enumerate(cases):
        per_rank = [out[r][i] for r in range(world)]
        assert sum(p[0] for p in per_rank) == n * n_systems
        assert all(p[1] == per_rank[0][1] for p in per_rank), "boxes differ between ranks"
        if balance == "QUANTILE":
            assert per_rank[0][2] <= 1.1  # every system balanced, so the sum is too
            assert min(p[0] for p in per_rank) > 0


def test_single_process_without_a_process_group() -> None:
    batch = make_batch(40, "mixed", seed=3, n_systems=2)
    part = SpatialPartitioner.from_batch(batch, 1, 2.0)
    sb = ShardedBatch.from_batch(batch, None, part)
    assert sb.world_size == 1 and sb.rank == 0 and sb.n_owned == 80 and sb.imbalance == 1.0
    gathered = sb.gather(0)
    assert gathered is not None
    assert_batches_equal(gathered, expected(batch, part))
    assert_batches_equal(sb.to_global(), expected(batch, part))
    assert sb.migrate().n_moved == 0
    assert "n_owned=80" in repr(sb)
    with pytest.raises(ConfigurationError, match="dst 1 is outside"):
        sb.gather(1)
    # The constructor wraps rows that are already distributed.
    again = ShardedBatch(sb.local_batch, part)
    assert again.owned_counts == (80,) and again.last_migration is None


@pytest.mark.gloo
def test_mesh_may_be_a_devicemesh_a_group_or_none_and_partitioners_broadcast() -> None:
    out = run_ranks(meshes_and_broadcast, 2)
    ids = sorted(make_batch(50, "periodic", seed=4).atom_ids.tolist())
    for k in range(3):  # DeviceMesh, ProcessGroup, default group
        assert sorted(out[0][0][k] + out[1][0][k]) == ids
        assert not set(out[0][0][k]) & set(out[1][0][k])
    assert out[0][1] == out[1][1]  # identical boxes (and imbalance) after the broadcast


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("world", "cases"),
    [
        (2, [("periodic", 1, 0.0)]),
        (3, [("mixed", 1, 0.5)]),
        (4, [("triclinic", 2, 0.0), ("open", 2, 0.0)]),
    ],
)
def test_migrate_conserves_ids_and_puts_atoms_on_their_owner(
    world: int, cases: list[tuple[str, int, float]]
) -> None:
    out = run_ranks(migrate_cases, world, cases)
    for i in range(len(cases)):
        moved = [out[r][i] for r in range(world)]
        assert all(m == moved[0] for m in moved)  # the same total on every rank
        assert sum(moved[0]) > 0  # the displacements did move atoms


@pytest.mark.gloo
def test_migration_wraps_and_assigns_with_the_current_cell() -> None:
    out = run_ranks(migrate_with_a_new_cell, 2)
    assert out[0]["owner_changed_by_the_cell"] > 0  # the new cell changes owners
    assert out[0]["moved"] == out[1]["moved"] > 0


@pytest.mark.gloo
def test_hysteresis_stops_ping_pong_across_a_face() -> None:
    out = run_ranks(ping_pong_cases, 2, [(0.5, 0.2), (0.0, 0.2), (0.5, 0.7)])
    # Oscillating 0.2 A across the face with a 0.5 A hysteresis: it never moves and
    # stays on rank 1 throughout.
    assert [m for m, _ in out[0][0]] == [0] * 6
    assert [held for _, held in out[1][0]] == [1] * 6
    # Without hysteresis the same oscillation moves it every step.
    assert [m for m, _ in out[0][1]] == [1] * 6
    assert [held for _, held in out[0][1]] == [1, 0, 1, 0, 1, 0]
    # Hysteresis is not a wall: 0.65 A beyond the face moves it to rank 0; coming
    # back 0.05 A past the face is within rank 0's grown box, so it stays there.
    assert [m for m, _ in out[0][2]] == [1, 0, 0, 0, 0, 0]
    assert [held for _, held in out[0][2]] == [1] * 6


_ERRORS = [
    ("empty_system", "ValidationError", r"^rank 0: system\(s\) \[1\] have no atoms"),
    ("world", "ConfigurationError", "^rank 0: the partitioner has 4 boxes .* the mesh has 3"),
    ("no_batch", "ValidationError", "^rank 0: from_batch needs a Batch on src, got NoneType"),
    ("factory", "ConfigurationError", "^rank 0: the partitioner factory returned str"),
    ("update", "ValidationError", "^rank 1: update_from_batch: atom ids differ"),
    ("nan", "ValidationError", "^rank 1: migrate: 1 of .* owned atoms have non-finite positions"),
]


@pytest.mark.gloo
def test_errors_are_raised_on_every_rank_together() -> None:
    out = run_ranks(errors, 3, [case for case, _, _ in _ERRORS])
    for i, (case, error, pattern) in enumerate(_ERRORS):
        per_rank = [out[r][i] for r in range(3)]
        assert all(p == per_rank[0] for p in per_rank), (case, per_rank)
        assert per_rank[0][0] == error, (case, per_rank[0])
        assert re.search(pattern, per_rank[0][1]), (case, per_rank[0][1])


def test_migrate_hysteresis_must_stay_below_the_skin() -> None:
    batch = make_batch(20, "periodic", seed=8)
    part = SpatialPartitioner.from_batch(batch, 1, 2.0, skin=0.4)
    sb = ShardedBatch.from_batch(batch, None, part)
    with pytest.raises(ConfigurationError, match=r"hysteresis 0\.4 must be below the skin 0\.4"):
        sb.migrate(0.4)
    with pytest.raises(ConfigurationError, match="hysteresis must be finite and >= 0"):
        sb.migrate(-1.0)
    assert sb.migrate(0.39).n_moved == 0


def test_update_from_batch_replaces_rows_in_any_order() -> None:
    batch = make_batch(30, "triclinic", seed=9)
    part = SpatialPartitioner.from_batch(batch, 1, 2.0)
    sb = ShardedBatch.from_batch(batch, None, part)
    shuffled = sb.local_batch.reorder(
        torch.randperm(30, generator=torch.Generator().manual_seed(1))
    )
    sb.update_from_batch(shuffled.replace(velocities=shuffled.velocities * 2))
    assert sb.local_batch is not None
    gathered = sb.gather()
    assert gathered is not None
    assert torch.equal(gathered.velocities, expected(batch, part).velocities * 2)


@pytest.mark.gloo
def test_constructor_wraps_distributed_rows_and_checks_partitioners_agree() -> None:
    from partition_ranks import wrap_distributed

    out = run_ranks(wrap_distributed, 3, False)
    assert all(msg == "" for msg, _ in out)
    assert sorted(i for _, ids in out for i in ids) == sorted(
        make_batch(60, "triclinic", seed=61).atom_ids.tolist()
    )
    out = run_ranks(wrap_distributed, 3, True)
    assert all("partitioners differ between ranks" in msg for msg, _ in out)


@pytest.mark.gloo
def test_rebalance_restores_balance_after_a_drift() -> None:
    from partition_ranks import drift_and_rebalance

    out = run_ranks(drift_and_rebalance, 4)
    before, drifted, after, fingerprint, _ = out[0]
    assert before <= 1.1 and after <= 1.1
    assert drifted > 1.3  # the old cuts no longer fit the atoms
    assert all(o[3] == fingerprint for o in out)  # one new partitioner everywhere
    assert all(o[:3] == out[0][:3] for o in out)
    assert sum(o[4] for o in out) == 240
