"""Fixtures of the UMA tests (run by the ``e3nn06`` nox session, whose environment
has the ``nvdd-models[uma]`` and ``[sevenn]`` extras and not ``[mace]``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# fairchem takes seconds to import: once, in the rank forkserver, instead of in every
# rank of every world size (added to what the SevenNet tests of the session preload).
_PRELOAD = ["fairchem.core.models.base", "fairchem.core.models.uma.escn_moe", "nvdd.dynamics"]
_have = [m for m in os.environ.get("NVDD_SPAWN_PRELOAD", "").split(",") if m]
os.environ["NVDD_SPAWN_PRELOAD"] = ",".join(_have + [m for m in _PRELOAD if m not in _have])


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the test machine's two cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
