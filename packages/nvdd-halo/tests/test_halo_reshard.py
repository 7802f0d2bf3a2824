"""reshard_by_destination over gloo: rows land where they were sent, nothing lost."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from halo_rankfns import error_text

from nvdd.core import ValidationError
from nvdd.halo import reshard_by_destination
from nvdd.testing import run_ranks


def _rows(rank: int, world: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """This rank's rows before resharding (deterministic in rank, world, seed)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    n = (0, 7, 13, 1, 20, 5, 9, 11)[(rank + seed) % 8]
    ids = rank * 1000 + torch.arange(n, dtype=torch.int64)
    fields = {
        "atom_ids": ids,
        "positions": torch.randn(n, 3, generator=g, dtype=torch.float64),
        "charges": torch.randn(n, generator=g, dtype=torch.float32),
        "frames": torch.randn(n, 2, 2, generator=g, dtype=torch.float32),
        "frozen": torch.rand(n, generator=g) < 0.5,
        "species": torch.randint(0, 90, (n,), generator=g, dtype=torch.int64),
        "empty": torch.zeros(n, 0, dtype=torch.float64),
    }
    return fields, torch.randint(0, world, (n,), generator=g, dtype=torch.int64)


def _reshard(seed: int) -> dict[str, torch.Tensor]:
    fields, dest = _rows(dist.get_rank(), dist.get_world_size(), seed)
    return reshard_by_destination(fields, dest)


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("seed", [0, 3])
def test_reshard_rows_land_where_sent_and_nothing_is_lost(world: int, seed: int) -> None:
    out = run_ranks(_reshard, world, seed, timeout_s=120)
    sent = [_rows(r, world, seed) for r in range(world)]
    for dst in range(world):
        got = out[dst]
        # Expected: rows sent to dst, by source rank then by original row order.
        expect = {k: torch.cat([f[k][d == dst] for f, d in sent]) for k in sent[0][0]}
        assert set(got) == set(expect)
        for k, v in expect.items():
            assert got[k].dtype == v.dtype, k
            assert got[k].shape == v.shape, k
            assert torch.equal(got[k], v), k  # bit-exact: bytes are moved, not converted
    # Conservation: the multiset of ids over all ranks is unchanged.
    before = torch.sort(torch.cat([f["atom_ids"] for f, _ in sent])).values
    after = torch.sort(torch.cat([o["atom_ids"] for o in out])).values
    assert torch.equal(before, after)


def _bad_destination(bad_rank: int) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    fields, dest = _rows(rank, world, 1)
    if rank == bad_rank:
        dest = dest.clone()
        dest[2] = world + 5
    return error_text(lambda: reshard_by_destination(fields, dest), ValidationError)


@pytest.mark.gloo
def test_reshard_destination_out_of_range_raises_on_every_rank() -> None:
    out = run_ranks(_bad_destination, 3, 1, timeout_s=120)
    assert len(set(out)) == 1, out
    assert "rank 1: destination[2] = 8 is outside [0, 3)" in out[0]


def _mismatched_layout() -> str:
    rank = dist.get_rank()
    fields = {"x": torch.zeros(4, 3, dtype=torch.float64 if rank == 0 else torch.float32)}
    return error_text(
        lambda: reshard_by_destination(fields, torch.zeros(4, dtype=torch.int64)), ValidationError
    )


@pytest.mark.gloo
def test_reshard_mismatched_field_layouts_raise_on_every_rank() -> None:
    out = run_ranks(_mismatched_layout, 2, timeout_s=120)
    assert all("differs between ranks" in o for o in out), out
    assert "x: float64 (3,)" in out[0] and "x: float32 (3,)" in out[0]


def test_reshard_single_process_is_identity_and_checks_range() -> None:
    fields, dest = _rows(0, 1, 2)
    out = reshard_by_destination(fields, dest)
    assert out.keys() == fields.keys()
    assert all(out[k] is fields[k] for k in fields)
    with pytest.raises(ValidationError, match=r"rank 0: destination\[0\] = 1 is outside \[0, 1\)"):
        reshard_by_destination({"x": torch.zeros(2)}, torch.tensor([1, 0]))
    with pytest.raises(ValidationError, match=r"expected first dimension 2"):
        reshard_by_destination({"x": torch.zeros(3)}, torch.tensor([0, 0]))
    with pytest.raises(ValidationError, match="expected int64"):
        reshard_by_destination({"x": torch.zeros(2)}, torch.tensor([0.0, 0.0]))


def _reshard_nccl() -> list[int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    fields, dest = _rows(rank, world, 0)
    out = reshard_by_destination({k: v.to(dev) for k, v in fields.items()}, dest.to(dev))
    assert all(v.device == dev for v in out.values())
    return out["atom_ids"].cpu().tolist()


@pytest.mark.multigpu
def test_reshard_over_nccl_keeps_every_row() -> None:
    out = run_ranks(_reshard_nccl, 2, timeout_s=300, backend="nccl")
    sent = [_rows(r, 2, 0) for r in range(2)]
    for dst in range(2):
        expect = torch.cat([f["atom_ids"][d == dst] for f, d in sent]).tolist()
        assert out[dst] == expect


@pytest.mark.parametrize("m", [0, 1, 2, 5])
def test_packed_rows_of_any_width_unpack_exactly(m: int) -> None:
    """Rows whose width is no multiple of a field's size (12 bytes: int64 + float32,
    a float32 batch's species and mass) come back bit for bit, one row included
    (a single row of a wider buffer is 'contiguous' with the buffer's stride,
    which a dtype view used to reject)."""
    from nvdd.halo._packing import pack_rows, row_layout, unpack_rows

    g = torch.Generator().manual_seed(m)
    fields = [
        torch.randint(0, 90, (m,), generator=g, dtype=torch.int64),
        torch.randn(m, generator=g, dtype=torch.float32),
        torch.randn(m, 3, generator=g, dtype=torch.float64),
        torch.rand(m, generator=g) < 0.5,
    ]
    for k in range(1, len(fields) + 1):
        part = fields[:k]
        layout = row_layout([f"f{i}" for i in range(k)], part)
        for rows in (None, torch.arange(m - 1, -1, -1)):
            buffer = pack_rows(part, layout, index=rows)
            back = unpack_rows(buffer, layout)
            for want, got in zip(part, back, strict=True):
                want = want if rows is None else want[rows]
                assert got.dtype == want.dtype and torch.equal(got, want)
            for r in range(m):  # one row of the buffer alone, as a peer may send it
                one = unpack_rows(buffer[r : r + 1], layout)
                for want, got in zip(part, one, strict=True):
                    want = want if rows is None else want[rows]
                    assert torch.equal(got, want[r : r + 1])
