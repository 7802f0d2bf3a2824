"""Fixtures every nvdd-models test module uses."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# The toolkit's electrostatics package takes seconds to import; the gloo ranks of
# the long-range tests import it from the forkserver instead of each on its own.
os.environ.setdefault(
    "NVDD_SPAWN_PRELOAD",
    "nvalchemiops.torch.interactions.electrostatics.pme,nvalchemiops.torch.spline,tad_dftd3",
)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the test machine's two cores are shared (and so is vesin's pool)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
