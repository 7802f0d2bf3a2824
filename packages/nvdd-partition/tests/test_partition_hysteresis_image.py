"""An atom kept by hysteresis across a periodic face stays next to its owner's box."""

from __future__ import annotations

import pytest
from partition_ranks import kept_across_periodic_face

from nvdd.testing import run_ranks


@pytest.mark.gloo
def test_kept_atom_sits_at_the_image_next_to_its_owner_box() -> None:
    on_rank0, on_rank1 = run_ranks(kept_across_periodic_face, 2, timeout_s=120)
    assert on_rank1 == []  # not migrated
    assert on_rank0 == [pytest.approx(-0.1, abs=1e-12)]  # not wrapped to 9.9
