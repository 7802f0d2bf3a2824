"""Scatter memory is O(N / P) on the ranks that do not hold the batch.

Measured as the growth of each rank's peak resident set across
``ShardedBatch.from_batch`` (``/proc/self/status`` VmHWM after resetting it, after
a small warm-up scatter that pays the one-off costs): it includes every transient
buffer (count exchange, packed receive buffer, unpacking), which a count of the
tensors held would miss, and a broadcast of the whole batch would show at once.
"""

from __future__ import annotations

import pytest
from partition_ranks import scatter_memory

from nvdd.testing import run_ranks

N = 240_000
WORLD = 8


@pytest.mark.gloo
def test_scatter_memory_is_per_rank_share_not_whole_system() -> None:
    src = 2
    out = run_ranks(scatter_memory, WORLD, N, src, timeout_s=240)
    row = out[src][3]
    whole = N * row  # bytes of every per-atom field of the whole system
    assert sum(o[2] for o in out) == N
    for rank, (growth, held, owned, _) in enumerate(out):
        assert held == owned * row
        assert abs(owned - N / WORLD) < 0.05 * N / WORLD  # uniform atoms, uniform boxes
        if rank != src:
            # A broadcast would grow every rank by at least `whole`; a true scatter by
            # about two copies of its share (receive buffer + unpacked rows).
            assert growth < 3 * held + 2**21, (rank, growth, held)
            assert growth < 0.4 * whole, (rank, growth, whole)
    # The measurement does see data: src held and packed the whole system.
    assert out[src][0] > 0.5 * whole
