"""OpAdapter around a real torch.library custom op, 2 gloo ranks vs 1 process.

A 1-D periodic chain split in two slabs by a real nvdd.halo plan. The op scatters
``weight(r) * values[sender]`` into receivers. Under DD each rank computes the
edges whose SENDER it owns, so contributions land in ghost receiver rows: the
adapter refreshes the input's ghost rows first and folds the output's ghost rows
into their owners. The result, by atom id, equals the unsharded op.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nvdd.halo import ParticleHaloConfig, build_halo_plan
from nvdd.shardtensor import DDContext, ShardTensor, dd_scope
from nvdd.spec import AdapterRegistry, OpAdapter
from nvdd.testing import assert_close_by_id, gather_by_id, run_ranks

L, RC, N = 12.0, 2.2, 30


@torch.library.custom_op("nvdd_spec_test::edge_scatter", mutates_args=())
def edge_scatter(
    values: torch.Tensor, pos: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> torch.Tensor:
    r = (pos[dst] - pos[src]).norm(dim=1)
    w = (1.0 - r / RC) ** 2
    return torch.zeros_like(values).index_add(0, dst, w * values[src])


@edge_scatter.register_fake
def _(
    values: torch.Tensor, pos: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> torch.Tensor:
    return torch.empty_like(values)


def _system() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.rand(N, generator=g, dtype=torch.float64) * L
    pos = torch.stack(
        [x, torch.zeros(N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)], 1
    )
    values = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    ids = torch.arange(N) * 5 + 1
    cell = torch.diag(torch.tensor([L, 50.0, 50.0], dtype=torch.float64))
    return pos, values, ids, cell


def _edges(
    pos: torch.Tensor, senders: torch.Tensor, periodic: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    d = pos[None, :, :] - pos[:, None, :]  # d[s, r] = pos[r] - pos[s]
    if periodic:
        d[..., 0] -= L * torch.round(d[..., 0] / L)
    r = d.norm(dim=-1)
    ok = (r < RC) & ~torch.eye(len(pos), dtype=torch.bool) & senders[:, None]
    s, t = ok.nonzero(as_tuple=True)
    return s, t


def _unsharded() -> tuple[torch.Tensor, torch.Tensor]:
    pos, values, ids, _ = _system()
    # periodic minimum image (the cell is far longer than twice the cutoff)
    s, t = _edges(pos, torch.ones(N, dtype=torch.bool), periodic=True)
    out = torch.zeros_like(values)
    for a, b in zip(s.tolist(), t.tolist(), strict=True):
        dx = pos[b, 0] - pos[a, 0]
        dx = dx - L * torch.round(dx / L)
        r = abs(float(dx))
        out[b] += (1.0 - r / RC) ** 2 * values[a]
    return ids, out


def _sharded() -> tuple[list[int], list[float], bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    pos, values, ids, cell = _system()
    boxes = torch.zeros(1, world, 2, 3, dtype=torch.float64)
    for r in range(world):
        boxes[0, r, 0] = torch.tensor([r / world, 0.0, 0.0])
        boxes[0, r, 1] = torch.tensor([(r + 1) / world, 1.0, 1.0])
    mine = (pos[:, 0] / L * world).floor().long() == rank
    config = ParticleHaloConfig(boxes=boxes, pbc=torch.tensor([[True, True, True]]), ghost_width=RC)
    plan = build_halo_plan(
        config, pos[mine], ids[mine], torch.zeros(int(mine.sum()), dtype=torch.long), cell[None]
    )
    n = plan.n_owned
    padded_pos = torch.cat([pos[mine], plan.ghost_positions(pos[mine], cell[None])])
    # ghost rows of the input deliberately stale: the adapter must refresh them
    padded_vals = torch.cat([values[mine], torch.full((plan.n_ghost,), -99.0, dtype=torch.float64)])
    x = ShardTensor.from_local(padded_vals, plan)
    senders = torch.arange(plan.n_padded) < n
    s, t = _edges(padded_pos, senders, periodic=False)
    adapter = OpAdapter("nvdd_spec_test::edge_scatter", refresh_inputs=(0,), fold_outputs=(0,))
    with dd_scope(DDContext(layout=plan)), AdapterRegistry([adapter]):
        out = torch.ops.nvdd_spec_test.edge_scatter(x, padded_pos, s, t)
    restored = torch.ops.nvdd_spec_test.edge_scatter is not None
    local = out.to_local() if isinstance(out, ShardTensor) else out
    gids, gout = gather_by_id(ids[mine], local[:n])
    return gids.tolist(), gout.tolist(), restored


@pytest.mark.gloo
def test_op_adapter_with_two_ranks_equals_unsharded() -> None:
    ids, expected = _unsharded()
    for got_ids, got, _ in run_ranks(_sharded, 2, timeout_s=120):
        assert_close_by_id(
            torch.tensor(got_ids),
            torch.tensor(got, dtype=torch.float64),
            ids,
            expected,
            atol=1e-12,
            what="edge_scatter",
        )


def test_op_adapter_is_inert_outside_a_dd_scope_and_restored() -> None:
    pos, values, _, _ = _system()
    s, t = _edges(pos, torch.ones(N, dtype=torch.bool), periodic=False)
    plain = torch.ops.nvdd_spec_test.edge_scatter(values, pos, s, t)
    original = torch.ops.nvdd_spec_test.edge_scatter
    with AdapterRegistry([OpAdapter("nvdd_spec_test::edge_scatter", fold_outputs=(0,))]):
        assert torch.ops.nvdd_spec_test.edge_scatter is not original
        # plain tensors, inert context: identical to the op itself
        torch.testing.assert_close(torch.ops.nvdd_spec_test.edge_scatter(values, pos, s, t), plain)
    assert torch.ops.nvdd_spec_test.edge_scatter is original
