"""The object collectives of ``nvdd.core._comm`` over gloo, against an unsharded oracle."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from nvdd.core import all_gather_object, broadcast_object, count_collectives
from nvdd.testing import run_ranks


def _payload(rank: int) -> dict[str, Any]:
    """What global rank ``rank`` contributes (the oracle rebuilds it from the rank)."""
    return {"rank": rank, "items": list(range(rank + 2)), "t": torch.arange(rank + 1.0)}


def _rank_body(src: int) -> dict[str, Any]:
    rank = dist.get_rank()
    sub = dist.new_group([1, 2])  # every rank creates it; ranks 1 and 2 use it
    with count_collectives() as counts:
        gathered = all_gather_object(_payload(rank))
        # non-source ranks pass something else: it is ignored
        got = broadcast_object(_payload(rank) if rank == src else "ignored", src)
        in_sub = None
        if rank in (1, 2):  # src is a rank of the group: 1 is global rank 2
            in_sub = (
                broadcast_object(_payload(rank) if rank == 2 else None, 1, sub),
                all_gather_object(rank * 10, sub),
            )
    return {"gathered": gathered, "got": got, "in_sub": in_sub, "counts": dict(counts)}


def _same(a: Any, b: Any) -> bool:
    return a["rank"] == b["rank"] and a["items"] == b["items"] and torch.equal(a["t"], b["t"])


@pytest.mark.gloo
def test_object_collectives_equal_the_unsharded_values() -> None:
    world, src = 3, 1
    out = run_ranks(_rank_body, world, src, timeout_s=60)
    everyone = [_payload(r) for r in range(world)]  # the oracle: every rank's object
    for rank, o in enumerate(out):
        assert len(o["gathered"]) == world
        assert all(_same(g, e) for g, e in zip(o["gathered"], everyone, strict=True))
        assert _same(o["got"], everyone[src])
        if rank in (1, 2):
            bcast, gathered = o["in_sub"]
            assert _same(bcast, everyone[2]) and gathered == [10, 20]
            assert o["counts"] == {"all_gather_object": 2, "broadcast_object": 2}
        else:
            assert o["in_sub"] is None
            assert o["counts"] == {"all_gather_object": 1, "broadcast_object": 1}


def test_a_world_of_one_returns_at_once_and_counts_nothing() -> None:
    assert not dist.is_initialized()
    obj = {"x": 1}
    with count_collectives() as counts:
        assert all_gather_object(obj) == [obj]
        assert broadcast_object(obj, 0) is obj
    assert counts == {}
