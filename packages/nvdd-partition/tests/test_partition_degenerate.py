"""Degenerate partitions: warned (or refused) with the same verdict on every rank."""

from __future__ import annotations

import pytest
import torch
from partition_ranks import degenerate

from nvdd.partition import DegeneratePartitionWarning, SpatialPartitioner
from nvdd.testing import run_ranks


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("case", "world", "text"),
    [
        ("empty_rank", 4, r"rank\(s\) \[.*\] of 4 own no atom"),
        ("covered", 2, "every one of the 2 boxes' halos covers the whole system"),
        ("migrate_empties", 3, r"rank\(s\) \[.*\] of 3 own no atom"),
    ],
)
@pytest.mark.parametrize("require", [False, True])
def test_degenerate_verdict_is_the_same_on_every_rank(
    case: str, world: int, text: str, require: bool
) -> None:
    out = run_ranks(degenerate, world, case, require)
    assert all(o == out[0] for o in out), out
    outcome, message = out[0]
    assert outcome == ("raised" if require else "warned")
    assert text in message or __import__("re").search(text, message), message
    assert message.startswith("degenerate partition: ")


def test_degeneracies_of_a_partitioner() -> None:
    cube = torch.eye(3) * 10.0
    # Boxes of 5 A with a 3 A halo on both sides: 5 + 6 >= 10 on the cut axis, and the
    # uncut axes are covered anyway: every rank holds every atom.
    covered = SpatialPartitioner(cube, [True] * 3, 2, 3.0)
    assert len(covered.degeneracies()) == 1
    assert SpatialPartitioner(cube * 3, [True] * 3, 2, 3.0).degeneracies() == []
    assert SpatialPartitioner(cube, [True] * 3, 1, 3.0).degeneracies() == []  # one rank
    reasons = SpatialPartitioner(cube * 3, [True] * 3, 2, 3.0).degeneracies([5, 0])
    assert reasons == ["rank(s) [1] of 2 own no atom (owned counts [5, 0])"]
    # An open cluster cut in two: covered only when both halves reach past the atoms.
    pos = torch.randn(50, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    blob = SpatialPartitioner(torch.zeros(3, 3), [False] * 3, 2, 50.0, positions=pos)
    assert "covers the whole system" in blob.degeneracies()[0]
    apart = SpatialPartitioner(torch.zeros(3, 3), [False] * 3, 2, 0.1, positions=pos)
    assert apart.degeneracies() == []


def test_single_process_warning_is_a_user_warning() -> None:
    assert issubclass(DegeneratePartitionWarning, UserWarning)
