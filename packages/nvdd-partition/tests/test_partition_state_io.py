"""SpatialPartitioner.to_dict / from_dict: JSON and back, the same boxes bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from nvdd.core import ValidationError
from nvdd.partition import BalanceMode, SpatialPartitioner


def _atoms(n: int, seed: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, generator=g, dtype=torch.float64) * scale, torch.zeros(
        n, dtype=torch.int64
    )


@pytest.mark.parametrize(
    ("pbc", "balance", "world"),
    [
        ([True, True, True], BalanceMode.UNIFORM, 4),
        ([True, True, False], BalanceMode.QUANTILE, 3),
        ([False, False, False], BalanceMode.QUANTILE, 4),
    ],
)
def test_round_trip_through_json_keeps_every_box(
    pbc: list[bool], balance: BalanceMode, world: int
) -> None:
    pos, si = _atoms(200, 1, 9.0)
    cell = torch.tensor([[9.0, 0, 0], [1.5, 8.0, 0], [0.5, -1.0, 9.5]], dtype=torch.float64)
    if not any(pbc):
        cell = torch.zeros(3, 3, dtype=torch.float64)
    part = SpatialPartitioner(
        cell, pbc, world, 3.0, positions=pos, system_index=si, balance=balance, skin=0.5
    )
    data = json.loads(json.dumps(part.to_dict()))  # through text, as a checkpoint stores it
    back = SpatialPartitioner.from_dict(data)
    assert back.fingerprint() == part.fingerprint()
    assert torch.equal(back.boxes, part.boxes)
    assert torch.equal(back.domain_cell(), part.domain_cell())
    assert (back.ghost_width, back.skin, back.balance) == (part.ghost_width, 0.5, balance)
    probe, psi = _atoms(500, 2, 12.0)
    assert torch.equal(back.owner_of(probe - 1.5, psi), part.owner_of(probe - 1.5, psi))
    assert (
        torch.equal(back.owned_counts(pos, si), part.owned_counts(pos, si))
        and back.imbalance() == part.imbalance()
    )


def test_from_dict_rejects_what_to_dict_did_not_write() -> None:
    part = SpatialPartitioner(torch.eye(3, dtype=torch.float64) * 8, [True] * 3, 2, 2.0)
    data = part.to_dict()
    with pytest.raises(ValidationError, match="version"):
        SpatialPartitioner.from_dict({**data, "version": 99})
    with pytest.raises(ValidationError, match="malformed"):
        SpatialPartitioner.from_dict({k: v for k, v in data.items() if k != "tables"})
    with pytest.raises(ValidationError, match="expected a dict"):
        SpatialPartitioner.from_dict([1, 2])  # type: ignore[arg-type]
