"""nvdd.testing: test helpers (never a runtime dependency) and the conformance kit.

- :func:`run_ranks`: run a function on N CPU ranks over gloo.
- The by-id oracle: :func:`assert_close_by_id`, :func:`assert_same_ids`,
  :func:`gather_by_id`, per-dtype :data:`TOLERANCES`.
- The conformance kit a model author runs on their own model:
  :func:`assert_dd_equivalent` (needs ``nvdd-testing[conformance]``, i.e.
  nvdd-dynamics) and :func:`boundary_variant`.
- :func:`importorskip_extra`: ``pytest.importorskip`` that fails instead of
  skipping under ``NVDD_REQUIRE_EXTRAS=1`` (CI sessions that install the extras);
  :func:`assert_needs_extra`: the install hint a user without the extra gets.
- :func:`binary_lattice`: a small periodic two-element test system (silica-like).
"""

from nvdd.testing.__about__ import __version__
from nvdd.testing._conformance import (
    CaseResult,
    ConformanceError,
    ConformanceReport,
    DDTolerances,
    assert_dd_equivalent,
)
from nvdd.testing._extras import REQUIRE_EXTRAS_ENV, assert_needs_extra, importorskip_extra
from nvdd.testing._fake_device import (
    FAKE_DEVICE,
    DeviceMixingError,
    FakeDeviceTensor,
    fake_accelerator,
    record_host_syncs,
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
from nvdd.testing._systems import binary_lattice, boundary_variant

__all__ = [
    "FAKE_DEVICE",
    "DeviceMixingError",
    "REQUIRE_EXTRAS_ENV",
    "FakeDeviceTensor",
    "TOLERANCES",
    "CaseResult",
    "ConformanceError",
    "ConformanceReport",
    "DDTolerances",
    "RankFailedError",
    "RankTimeoutError",
    "Tolerance",
    "__version__",
    "assert_close_by_id",
    "assert_dd_equivalent",
    "assert_needs_extra",
    "assert_same_ids",
    "fake_accelerator",
    "record_host_syncs",
    "binary_lattice",
    "boundary_variant",
    "gather_by_id",
    "importorskip_extra",
    "run_ranks",
    "to_fake",
    "tolerance_for",
]
