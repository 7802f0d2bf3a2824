"""Graph partition: `graph_ghosts` against a brute force over periodic images, and
`IndexShardedBatch` (scatter by index block, gather, to_global) on gloo ranks."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from nvdd.core import Batch, ValidationError
from nvdd.partition import IndexPartitioner, IndexShardedBatch, graph_ghosts
from nvdd.testing import assert_same_ids, run_ranks


def _brute(
    pos: torch.Tensor,
    si: torch.Tensor,
    cell: torch.Tensor,
    pbc: torch.Tensor,
    owned: torch.Tensor,
    radius: float,
) -> torch.Tensor:
    """Non-owned atoms within ``radius`` of an owned atom, over images -3..3."""
    keep = torch.zeros(pos.shape[0], dtype=torch.bool)
    for s in si.unique().tolist():
        rows = (si == s).nonzero().flatten()
        ranges = [range(-3, 4) if bool(pbc[s, a]) else range(1) for a in range(3)]
        shifts = torch.tensor(list(itertools.product(*ranges)), dtype=torch.float64) @ cell[s]
        x = pos[rows]
        d = x[None, :, None, :] - x[:, None, None, :] + shifts[None, None]
        close = ((d * d).sum(-1) <= radius**2).any(-1)
        mine = owned[rows]
        keep[rows[close[mine].any(0) & ~mine]] = True
    return keep.nonzero().flatten()


def _system(kind: str, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    n = 150
    cells = {
        "cubic": torch.diag(torch.tensor([16.0, 14.0, 15.0])),
        "triclinic": torch.tensor([[16.0, 0, 0], [4.0, 14, 0], [-3.0, 2.5, 15.0]]),
        "thin": torch.diag(torch.tensor([16.0, 7.0, 15.0])),  # y < 2 radius: two images
        "slab": torch.diag(torch.tensor([16.0, 14.0, 0.0])),
        "open": torch.zeros(3, 3),
    }
    cell = cells[kind].double()
    box = cell + torch.diag(torch.tensor([0.0, 0.0, 12.0])) * (kind == "slab")
    box = box + 12.0 * torch.eye(3, dtype=torch.float64) * (kind == "open")
    pos = torch.rand(n, 3, generator=g, dtype=torch.float64) @ box
    pbc = torch.tensor(
        [[kind not in ("open",), kind not in ("open",), kind not in ("slab", "open")]]
    )
    return pos, cell[None], pbc


@pytest.mark.parametrize("kind", ["cubic", "triclinic", "thin", "slab", "open"])
def test_graph_ghosts_are_exactly_the_atoms_within_the_radius(kind: str) -> None:
    g = torch.Generator().manual_seed(len(kind))
    pos, cell, pbc = _system(kind, g)
    si = torch.zeros(pos.shape[0], dtype=torch.int64)
    slab, scattered = pos[:, 0] < 5.0, torch.arange(pos.shape[0]) % 29 == 0
    for owned in (slab, scattered):
        got = graph_ghosts(pos, si, cell, pbc, owned, 4.5)
        ref = _brute(pos, si, cell, pbc, owned, 4.5)
        assert ref.numel() > 0
        assert torch.equal(got, ref)
    assert ref.numel() < int((~owned).sum())  # the scattered block does not reach everything


def test_graph_ghosts_two_systems_and_the_radius_edge() -> None:
    g = torch.Generator().manual_seed(3)
    pa, ca, pa_pbc = _system("cubic", g)
    pb, cb, pb_pbc = _system("triclinic", g)
    pos = torch.cat([pa, pb])
    si = torch.cat([torch.zeros(len(pa)), torch.ones(len(pb))]).long()
    cell, pbc = torch.cat([ca, cb]), torch.cat([pa_pbc, pb_pbc])
    owned = torch.zeros(len(pos), dtype=torch.bool)
    owned[:20] = True  # system 0 only: no ghost may come from system 1
    got = graph_ghosts(pos, si, cell, pbc, owned, 4.0)
    assert torch.equal(got, _brute(pos, si, cell, pbc, owned, 4.0))
    assert bool((got < len(pa)).all())
    # an atom exactly at the radius (through a periodic face) is a ghost
    two = torch.tensor([[0.5, 1.0, 1.0], [13.5 - 1e-15, 1.0, 1.0]], dtype=torch.float64)
    box = torch.diag(torch.tensor([16.0, 16.0, 16.0], dtype=torch.float64))[None]
    own = torch.tensor([True, False])
    zeros = torch.zeros(2, dtype=torch.int64)
    assert graph_ghosts(two, zeros, box, torch.ones(1, 3, dtype=torch.bool), own, 3.0).tolist() == [
        1
    ]


def test_graph_ghosts_bad_input() -> None:
    pos = torch.zeros(3, 3, dtype=torch.float64)
    si = torch.zeros(3, dtype=torch.int64)
    box, pbc = torch.eye(3)[None] * 10, torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValidationError, match="radius must be > 0"):
        graph_ghosts(pos, si, box, pbc, torch.ones(3, dtype=torch.bool), 0.0)
    with pytest.raises(ValidationError, match="owned must be bool"):
        graph_ghosts(pos, si, box, pbc, torch.ones(3), 1.0)
    with pytest.raises(ValidationError, match="not finite"):
        graph_ghosts(pos.fill_(float("nan")), si, box, pbc, torch.ones(3, dtype=torch.bool), 1.0)


def _batch(n: int) -> Batch:
    g = torch.Generator().manual_seed(n)
    return Batch(
        positions=torch.rand(n, 3, generator=g, dtype=torch.float64) * 9.0,
        atomic_numbers=torch.randint(1, 10, (n,), generator=g),
        cell=torch.eye(3, dtype=torch.float64) * 9.0,
        pbc=[True, True, False],
        atom_ids=torch.randperm(n, generator=g) * 5 + 2,
        atom_extras={"tag": torch.arange(n, dtype=torch.float32)[:, None]},
    )


def _scatter_body(n: int, order: str = "id") -> dict:
    rank = dist.get_rank()
    batch = _batch(n) if rank == 0 else None
    sharded = IndexShardedBatch.from_batch(batch, None, src=0, order=order)
    local = sharded.local_batch
    again = IndexShardedBatch(local)  # the constructor accepts the blocks it made
    return {
        "ids": local.atom_ids,
        "bounds": sharded.bounds,
        "counts": sharded.owned_counts,
        "again": again.bounds,
        "gather": sharded.gather(1 % sharded.world_size),
        "all": sharded.to_global(),
    }


@pytest.mark.gloo
@pytest.mark.parametrize(("n", "world"), [(23, 3), (8, 4)])
def test_index_sharded_batch_owns_id_ordered_blocks(n: int, world: int) -> None:
    out = run_ranks(_scatter_body, world, n, timeout_s=60)
    whole = _batch(n).sort_by_id()
    part = IndexPartitioner(n, world)
    for rank, o in enumerate(out):
        start, stop = part.bounds(rank)
        assert o["bounds"] == o["again"] == (start, stop)
        assert o["counts"] == part.counts()
        assert torch.equal(o["ids"], whole.atom_ids[start:stop])
        assert torch.equal(o["all"].positions, whole.positions)
        assert torch.equal(o["all"].atom_extras["tag"], whole.atom_extras["tag"])
    gathered = out[1 % world]["gather"]
    assert_same_ids(gathered.atom_ids, whole.atom_ids)
    assert torch.equal(gathered.positions, whole.positions)
    assert all(o["gather"] is None for r, o in enumerate(out) if r != 1 % world)


def test_space_order_makes_compact_blocks() -> None:
    from nvdd.partition._index_sharded import space_order

    n = 4096
    g = torch.Generator().manual_seed(0)
    b = Batch(
        positions=torch.rand(n, 3, generator=g, dtype=torch.float64) * 30.0,
        atomic_numbers=torch.ones(n, dtype=torch.int64),
        cell=torch.eye(3, dtype=torch.float64) * 30.0,
        pbc=[True, True, True],
        atom_ids=torch.randperm(n, generator=g),
    )
    perm = space_order(b)
    assert torch.equal(torch.sort(perm).values, torch.arange(n))  # a permutation
    si = torch.zeros(n, dtype=torch.int64)
    sizes = {}
    for name, order in (("space", perm), ("id", torch.argsort(b.atom_ids))):
        owned = torch.zeros(n, dtype=torch.bool)
        owned[order[: n // 8]] = True  # the first of 8 blocks
        sizes[name] = graph_ghosts(b.positions, si, b.cell, b.pbc, owned, 3.0).numel()
    # a random block reaches almost everything, a Z-order block a shell around it
    assert sizes["space"] < 0.5 * sizes["id"], sizes


@pytest.mark.gloo
def test_index_sharded_batch_space_order_conserves_every_atom() -> None:
    out = run_ranks(_scatter_body, 3, 40, "space", timeout_s=60)
    whole = _batch(40).sort_by_id()
    assert_same_ids(torch.cat([o["ids"] for o in out]), whole.atom_ids)
    assert torch.equal(out[0]["all"].positions, whole.positions)


def _bad_blocks_body() -> str:
    rank = dist.get_rank()
    whole = _batch(10).sort_by_id()
    rows = slice(0, 6) if rank == 0 else slice(6, 10)  # 6 + 4, not the 5 + 5 split
    try:
        IndexShardedBatch(whole.select(torch.arange(10)[rows]))
    except ValidationError as exc:
        return str(exc)
    return "no error"


@pytest.mark.gloo
def test_index_sharded_batch_rejects_unbalanced_blocks_on_every_rank() -> None:
    out = run_ranks(_bad_blocks_body, 2, timeout_s=60)
    assert all("not the balanced split (5, 5)" in o for o in out), out
