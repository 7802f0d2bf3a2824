"""Fixtures of the SevenNet tests (run by the ``sevenn`` nox session, whose
environment has the ``nvdd-models[sevenn]`` extra and not ``[mace]``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# sevenn pulls in e3nn and torch_geometric, and nvdd.dynamics takes seconds too: all
# imported once, in the rank forkserver, instead of in every rank of every world size.
os.environ.setdefault(
    "NVDD_SPAWN_PRELOAD",
    "sevenn.nn.sequential,sevenn.nn.node_embedding,nvdd.dynamics,nvdd.models,nvdd.testing",
)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the test machine's two cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
