"""Fixtures every nvdd-models test module uses."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# The toolkit's electrostatics package and mace-torch take seconds to import; the
# gloo ranks of the long-range and MACE tests get them from the forkserver instead
# of each importing them on its own (models_preload imports mace the nvdd way).
os.environ.setdefault(
    "NVDD_SPAWN_PRELOAD",
    "nvalchemiops.torch.interactions.electrostatics.pme,nvalchemiops.torch.spline,tad_dftd3,"
    "models_preload",
)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the test machine's two cores are shared (and so is vesin's pool)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
