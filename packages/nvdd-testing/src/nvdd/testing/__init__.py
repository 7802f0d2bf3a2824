"""nvdd.testing: repo-internal test helpers (never a runtime dependency)."""

from nvdd.testing.__about__ import __version__
from nvdd.testing._fake_device import (
    FAKE_DEVICE,
    DeviceMixingError,
    FakeDeviceTensor,
    fake_accelerator,
    to_fake,
)
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
    "FAKE_DEVICE",
    "DeviceMixingError",
    "FakeDeviceTensor",
    "TOLERANCES",
    "RankFailedError",
    "RankTimeoutError",
    "Tolerance",
    "__version__",
    "assert_close_by_id",
    "assert_same_ids",
    "fake_accelerator",
    "gather_by_id",
    "run_ranks",
    "to_fake",
    "tolerance_for",
]
