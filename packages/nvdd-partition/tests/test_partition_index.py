"""IndexPartitioner: one rule (the first n % P ranks get one more) everywhere."""

from __future__ import annotations

import pytest
import torch

from nvdd.core import ConfigurationError, ValidationError
from nvdd.partition import IndexPartitioner


@pytest.mark.parametrize(("n", "world"), [(0, 1), (0, 3), (2, 5), (10, 3), (12, 4), (101, 8)])
def test_blocks_match_tensor_split_and_owner_of(n: int, world: int) -> None:
    part = IndexPartitioner(n, world)
    expected = [len(c) for c in torch.tensor_split(torch.arange(n), world)]
    assert part.counts() == tuple(expected)
    assert max(expected) - min(expected) <= 1
    starts = [part.bounds(r)[0] for r in range(world)]
    stops = [part.bounds(r)[1] for r in range(world)]
    assert starts[0] == 0 and stops[-1] == n
    assert starts[1:] == stops[:-1]  # contiguous, no gap, no overlap
    assert part.offsets() == (*starts, n)
    owners = part.owner_of(torch.arange(n))
    for r in range(world):
        block = torch.arange(n)[part.local_slice(r)]
        assert bool((owners[block] == r).all())
        assert all(part.owner_of(int(i)) == r for i in block)
    assert torch.equal(torch.bincount(owners, minlength=world), torch.tensor(expected))


def test_owner_of_keeps_shape_and_device() -> None:
    part = IndexPartitioner(10, 3)  # blocks 4, 3, 3
    idx = torch.tensor([[0, 3, 4], [6, 7, 9]], dtype=torch.int32)
    assert part.owner_of(idx).tolist() == [[0, 0, 1], [1, 2, 2]]
    assert part.owner_of(idx).dtype == torch.int64


def test_bad_arguments_raise() -> None:
    with pytest.raises(ConfigurationError, match="world_size"):
        IndexPartitioner(4, 0)
    with pytest.raises(ConfigurationError, match="n_items"):
        IndexPartitioner(-1, 2)
    part = IndexPartitioner(5, 2)
    with pytest.raises(ValidationError, match="index 5 is outside"):
        part.owner_of(torch.tensor([0, 5]))
    with pytest.raises(ValidationError, match="outside"):
        part.owner_of(-1)
    with pytest.raises(ValidationError, match="integer tensor"):
        part.owner_of(torch.tensor([0.5]))
    with pytest.raises(ValidationError, match="rank 2"):
        part.bounds(2)


def test_equality_and_repr() -> None:
    assert IndexPartitioner(7, 2) == IndexPartitioner(7, 2)
    assert IndexPartitioner(7, 2) != IndexPartitioner(7, 3)
    assert len({IndexPartitioner(7, 2), IndexPartitioner(7, 2)}) == 1
    assert repr(IndexPartitioner(7, 2)) == "IndexPartitioner(n_items=7, world_size=2)"
