"""The steady state of LJ under DomainParallel: 1 all_to_all (the ghosts out; LJ's
owned rows are complete, nothing comes back: record 0093) + 1 small all-reduce,
under both strategies, compiled or not (the compiled core agrees on its capacities
at rebuilds only)."""

from __future__ import annotations

import pytest
from it_ranks import lj_steady_state

from nvdd.testing import run_ranks

pytestmark = pytest.mark.gloo


@pytest.mark.parametrize(
    ("world", "strategy", "compiled"),
    [(2, "halo", False), (4, "halo", False), (2, "graph_partition", False), (2, "halo", True)],
)
def test_lj_non_rebuild_steps_cost_one_all_to_all_and_one_all_reduce(
    world: int, strategy: str, compiled: bool
) -> None:
    for out in run_ranks(lj_steady_state, world, strategy, compiled, timeout_s=300):
        assert len(out["quiet_steps"]) >= 4  # a 1 A skin at 20 K: no rebuild
        for counts in out["quiet_steps"]:
            assert counts == {"all_to_all_single": 1, "all_reduce": 1}
