"""nvdd.testing: repo-internal test helpers (never a runtime dependency)."""

from nvdd.testing.__about__ import __version__
from nvdd.testing._oracle import (
    TOLERANCES,
    Tolerance,
    assert_close_by_id,
    assert_same_ids,
    gather_by_id,
    tolerance_for,
)
from nvdd.testing._ranks import RankFailedError, RankTimeoutError, run_ranks

__all__ = [
    "TOLERANCES",
    "RankFailedError",
    "RankTimeoutError",
    "Tolerance",
    "__version__",
    "assert_close_by_id",
    "assert_same_ids",
    "gather_by_id",
    "run_ranks",
    "tolerance_for",
]
