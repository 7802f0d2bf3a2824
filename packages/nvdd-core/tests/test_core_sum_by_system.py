"""`sum_by_system`: per-system sums without atomic contention, on each of its paths."""

from __future__ import annotations

import pytest
import torch

from nvdd.core import sum_by_system


@pytest.mark.parametrize("n_systems", [1, 3, 40])
def test_system_sum_equals_index_add_on_every_path(n_systems: int) -> None:
    """One system (a column sum), a few (a one-hot product), many (index_add):
    the per-system sums of index_add, to rounding; empty systems give zero."""
    g = torch.Generator().manual_seed(n_systems)
    system_index = torch.randint(0, n_systems, (500,), generator=g)
    system_index[system_index == n_systems - 1] = 0  # the last system holds no atom
    rows = torch.randn(500, 3, 3, generator=g, dtype=torch.float64)
    want = torch.zeros(n_systems, 3, 3, dtype=torch.float64).index_add_(0, system_index, rows)
    got = sum_by_system(rows, system_index, n_systems)
    assert got.shape == (n_systems, 3, 3) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    if n_systems > 1:
        assert float(got[-1].abs().max()) == 0.0
    assert sum_by_system(rows[:0], system_index[:0], n_systems).abs().sum() == 0
