"""The partitioner's boxes and domain cell drive nvdd.halo's plan as documented."""

from __future__ import annotations

import pytest
from partition_ranks import halo_contract

from nvdd.testing import run_ranks


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("kind", "n_systems", "ghost_width", "covered"),
    [("mixed", 2, 2.0, False), ("open", 1, 40.0, True)],
)
def test_halo_plan_from_partitioner_boxes(
    kind: str, n_systems: int, ghost_width: float, covered: bool
) -> None:
    out = run_ranks(halo_contract, 3, 60, kind, n_systems, ghost_width)
    total = 60 * n_systems
    assert sum(o[0] for o in out) == total
    assert all(o[1] > 0 for o in out)  # every rank has a halo
    if covered:
        # degeneracies() said so: every rank then holds every atom, owned or ghost.
        assert all(o[2] == total for o in out)
    else:
        assert all(o[2] < total for o in out)
