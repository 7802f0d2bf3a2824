"""`build_request_plan`: ghost rows chosen by the receiver (graph partition)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nvdd.core import ValidationError
from nvdd.halo import build_request_plan
from nvdd.testing import run_ranks

pytestmark = pytest.mark.gloo

COUNTS = (5, 0, 7, 3)  # owned rows of ranks 0..3 (rank 1 owns none)


def _requests(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic, rank-dependent request list, own rows included, sorted by owner."""
    g = torch.Generator().manual_seed(rank)
    ranks, rows = [], []
    for owner in range(world):
        n = COUNTS[owner]
        if n == 0:
            continue
        pick = torch.randperm(n, generator=g)[: max(1, n // 2 + rank % 2)]
        ranks.append(torch.full((int(pick.numel()),), owner))
        rows.append(pick)
    return torch.cat(ranks), torch.cat(rows)


def _value(owner: int, row: int) -> float:
    return 100.0 * owner + row + 0.25


def _rank_body(world: int) -> dict:
    rank = dist.get_rank()
    owner_rank, owner_row = _requests(rank, world)
    ids = owner_rank * 1000 + owner_row
    plan = build_request_plan(owner_rank, owner_row, COUNTS[rank], atom_ids=ids)
    owned = torch.tensor([_value(rank, r) for r in range(COUNTS[rank])], dtype=torch.float64)
    ghosts = plan.forward(owned[:, None].expand(-1, 2).contiguous())
    # adjoint identity: <forward(x), y> == <x, reverse(y)>, summed over ranks
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(COUNTS[rank], 3, generator=g, dtype=torch.float64)
    y = torch.randn(plan.n_ghost, 3, generator=g, dtype=torch.float64)
    sums = torch.tensor(
        [float((plan.forward(x) * y).sum()), float((x * plan.reverse(y)).sum())],
        dtype=torch.float64,
    )
    dist.all_reduce(sums)
    expect = torch.tensor(
        [_value(int(o), int(r)) for o, r in zip(owner_rank, owner_row, strict=True)]
    )
    return {
        "ghosts": ghosts,
        "expect": expect.to(torch.float64),
        "ids": plan.ghost_atom_ids,
        "want_ids": ids,
        "image": plan.ghost_image,
        "explicit": plan.explicit_images,
        "n_padded": plan.n_padded,
        "n": (COUNTS[rank], int(owner_rank.numel())),
        "sums": sums.tolist(),
    }


@pytest.mark.parametrize("world", [1, 3, 4])
def test_requested_rows_arrive_in_request_order_and_exchanges_are_adjoint(world: int) -> None:
    out = run_ranks(_rank_body, world, world, timeout_s=60)
    for rank, o in enumerate(out):
        assert o["n_padded"] == sum(o["n"])
        assert o["ghosts"].shape == (o["n"][1], 2)
        torch.testing.assert_close(o["ghosts"][:, 0], o["expect"], rtol=0, atol=0)
        torch.testing.assert_close(o["ghosts"][:, 1], o["expect"], rtol=0, atol=0)
        assert torch.equal(o["ids"], o["want_ids"])
        assert not bool(o["image"].any()) and o["explicit"] is False
        lhs, rhs = o["sums"]
        assert abs(lhs) > 1e-3, f"rank {rank}: trivial pairing"
        assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs))


def _bad_body(kind: str) -> str:
    rank = dist.get_rank()
    owner_rank = torch.tensor([0, 1], dtype=torch.int64)
    owner_row = torch.tensor([0, 0], dtype=torch.int64)
    if rank == 1 and kind == "row":
        owner_row = torch.tensor([0, 9], dtype=torch.int64)  # rank 1 owns 3 rows
    if rank == 0 and kind == "unsorted":
        owner_rank = torch.tensor([1, 0], dtype=torch.int64)
    try:
        build_request_plan(owner_rank, owner_row, 3)
    except ValidationError as exc:
        dist.barrier()  # nobody hangs
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("kind", "text"),
    [("row", "requested row 9 of rank 1, which owns 3 rows"), ("unsorted", "must be sorted")],
)
def test_a_bad_request_raises_on_every_rank(kind: str, text: str) -> None:
    out = run_ranks(_bad_body, 2, kind, timeout_s=60)
    assert all(text in o for o in out), out
