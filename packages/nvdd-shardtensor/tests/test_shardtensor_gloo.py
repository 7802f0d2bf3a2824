"""The verbs and the dispatch on 2-8 CPU ranks over gloo, against the unsharded oracle.

Every rank owns a slab of a toy system and mirrors the remote atoms its owned
atoms' edges touch (``shardtensor_fakes.GlooTableLayout``). Results are gathered
to the parent and compared row by row, by global atom id, with the same
computation on the whole system in one process. Ghost rows are compared too:
the invariant says they equal their owners.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardtensor_fakes import (
    ToySystem,
    as_shard_tensor,
    call_counted,
    make_system,
    shard,
    toy_energy,
    toy_params,
)

from nvdd.core import ValidationError
from nvdd.shardtensor import (
    DDContext,
    Scope,
    ShardTensor,
    autograd_target,
    dd_scope,
    refresh_neighbors,
    scatter_to_owners,
    system_sum,
    to_local,
)
from nvdd.testing import assert_close_by_id, run_ranks

EXACT = 1e-12


def _holders(per_rank_ids: list[torch.Tensor], n_atoms: int) -> torch.Tensor:
    """``shape (world, n_atoms)`` bool: which ranks hold a row of each atom."""
    out = torch.zeros(len(per_rank_ids), n_atoms, dtype=torch.bool)
    for r, ids in enumerate(per_rank_ids):
        out[r, ids] = True
    return out


def _assert_padded(
    results: list[dict[str, Any]], key: str, truth: torch.Tensor, atol: float = EXACT
) -> None:
    """Owned rows of all ranks equal ``truth`` by id (each id owned exactly once);
    every ghost row equals ``truth`` of its id too (the ghost invariant)."""
    owned_ids = torch.cat([r["ids"][: r["n_owned"]] for r in results])
    owned = torch.cat([r[key][: r["n_owned"]] for r in results])
    every = torch.arange(truth.shape[0])
    assert_close_by_id(owned_ids, owned, every, truth, atol=atol, what=key)
    for rank, r in enumerate(results):
        ghost_ids, ghosts = r["ids"][r["n_owned"] :], r[key][r["n_owned"] :]
        bad = ((ghosts - truth[ghost_ids]).abs() > atol).reshape(len(ghost_ids), -1).any(1)
        assert not bool(bad.any()), (
            f"{key}: rank {rank} ghost rows of ids {ghost_ids[bad].tolist()} differ from "
            f"their owners: {ghosts[bad].tolist()} vs {truth[ghost_ids[bad]].tolist()}"
        )


# ----------------------------------------------------------------------------- verbs


def _verbs_on_ranks(system: ToySystem) -> dict[str, Any]:
    rank = dist.get_rank()
    sh = shard(system)
    n_owned = sh.layout.n_owned
    gid = sh.ids.to(torch.float64)
    out: dict[str, Any] = {"ids": sh.ids, "n_owned": n_owned, "syncs": {}}

    # refresh: ghost rows start as garbage and must come back as their owners' values
    stale = torch.stack([gid, gid**2], dim=1)
    stale[n_owned:] = -999.0
    st = ShardTensor.from_local(stale.clone(), sh.layout)
    refreshed, n, calls = call_counted(lambda: refresh_neighbors(st))
    out["refresh_st"], out["refresh_st_type"] = to_local(refreshed), type(refreshed).__name__
    out["syncs"]["refresh_neighbors(ShardTensor)"] = (n, calls)
    with dd_scope(DDContext(layout=sh.layout, n_systems=system.n_systems)):
        plain_ref, n, calls = call_counted(lambda: refresh_neighbors(stale.clone()))
        out["syncs"]["refresh_neighbors(plain)"] = (n, calls)
        out["refresh_plain"], out["refresh_plain_type"] = plain_ref, type(plain_ref).__name__

        # fold: every row (owned and ghost) contributes gid * (rank + 1)
        contrib = torch.stack([gid * (rank + 1), -gid * (rank + 1)], dim=1)
        folded, n, calls = call_counted(lambda: scatter_to_owners(contrib.clone()))
        out["fold_plain"] = folded
        out["syncs"]["scatter_to_owners(plain)"] = (n, calls)
        folded_st, n, calls = call_counted(
            lambda: scatter_to_owners(ShardTensor.from_local(contrib.clone(), sh.layout))
        )
        out["fold_st"] = to_local(folded_st)
        out["syncs"]["scatter_to_owners(ShardTensor)"] = (n, calls)

        # per-system sums with trailing dims (a virial-like (n, 3, 3) field)
        vir = (gid[:, None, None] + torch.arange(9, dtype=torch.float64).view(1, 3, 3)) * 0.5
        vir[n_owned:] = 1e6  # ghosts must never be counted
        sys_idx = sh.rows(system.system_index)
        owned_sum, n, calls = call_counted(lambda: system_sum(vir, sys_idx, system.n_systems))
        out["system_owned"] = owned_sum
        out["syncs"]["system_sum(OWNED)"] = (n, calls)
        local_sum, n, calls = call_counted(
            lambda: system_sum(vir, sys_idx, system.n_systems, Scope.LOCAL)
        )
        out["system_local"] = local_sum
        out["syncs"]["system_sum(LOCAL)"] = (n, calls)
    return out


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("world", "kind", "n_atoms"),
    [(2, "chain", 12), (2, "random", 40), (3, "random", 48), (4, "random", 60)],
)
def test_verbs_match_the_unsharded_computation(world: int, kind: str, n_atoms: int) -> None:
    system = make_system(n_atoms, world, kind=kind, seed=world)
    results = run_ranks(_verbs_on_ranks, world, system, timeout_s=120)
    gid = torch.arange(n_atoms, dtype=torch.float64)
    assert sum(r["n_owned"] for r in results) == n_atoms
    assert any(r["ids"].shape[0] > r["n_owned"] for r in results), "no rank has ghosts"

    truth = torch.stack([gid, gid**2], dim=1)
    for key in ("refresh_st", "refresh_plain"):
        _assert_padded(results, key, truth, atol=0.0)
    assert {r["refresh_st_type"] for r in results} == {"ShardTensor"}
    assert {r["refresh_plain_type"] for r in results} == {"Tensor"}

    # every holder of an atom contributed gid * (rank + 1): the owner must see the sum,
    # and every copy (owned and ghost) must end up equal to it
    holders = _holders([r["ids"] for r in results], n_atoms)
    weight = (
        holders.to(torch.float64) * torch.arange(1, world + 1, dtype=torch.float64)[:, None]
    ).sum(0)
    expected = torch.stack([gid * weight, -gid * weight], dim=1)
    for key in ("fold_plain", "fold_st"):
        _assert_padded(results, key, expected)

    vir = (gid[:, None, None] + torch.arange(9, dtype=torch.float64).view(1, 3, 3)) * 0.5
    total = torch.zeros(system.n_systems, 3, 3, dtype=torch.float64).index_add_(
        0, system.system_index, vir
    )
    for r in results:
        torch.testing.assert_close(r["system_owned"], total, atol=EXACT, rtol=0)
    summed_local = torch.stack([r["system_local"] for r in results]).sum(0)
    torch.testing.assert_close(summed_local, total, atol=EXACT, rtol=0)
    assert not torch.allclose(results[0]["system_local"], total), "LOCAL must be a share"

    for r in results:
        bad = {verb: c for verb, c in r["syncs"].items() if c[0] != 0}
        assert not bad, f"host synchronisations in verbs: {bad}"


# -------------------------------------------------------------------------- dispatch


def _dispatch_on_ranks(system: ToySystem) -> dict[str, Any]:
    sh = shard(system)
    feat = as_shard_tensor(system.features, sh)
    out: dict[str, Any] = {"ids": sh.ids, "n_owned": sh.layout.n_owned, "syncs": {}}

    def run(name: str, fn: Any) -> None:
        value, n, calls = call_counted(fn)
        out[name] = to_local(value).detach()
        out[name + ":type"] = type(value).__name__
        out["syncs"][name] = (n, calls)

    msgs = torch.tanh(feat[sh.send])  # gather of sender rows (some ghosts)

    def index_add_inplace() -> ShardTensor:
        acc = torch.ones_like(feat)
        acc.index_add_(0, sh.recv, msgs)  # no rebinding: acc itself must be folded
        return acc

    run("index_add_", index_add_inplace)
    run("index_add", lambda: torch.index_add(feat, 0, sh.recv, msgs, alpha=2.0))
    # pair-once pattern: both ends of each undirected pair get a contribution, the
    # j end is often a ghost row: its partial must reach the owner on another rank
    pair = feat[sh.half_i] * feat[sh.half_j]
    both = torch.cat([sh.half_i, sh.half_j])
    run(
        "scatter_add_pairs",
        lambda: torch.zeros_like(feat).scatter_add_(
            0, both[:, None].expand(-1, 4), torch.cat([pair, -2.0 * pair])
        ),
    )
    run(
        "scatter_reduce_sum_no_self",
        lambda: feat.scatter_reduce(
            0, sh.recv[:, None].expand(-1, 4), msgs, "sum", include_self=False
        ),
    )
    run(
        "scatter_reduce_amax",
        lambda: feat.scatter_reduce(0, sh.recv[:, None].expand(-1, 4), msgs, "amax"),
    )

    def index_put_acc() -> ShardTensor:
        acc = feat.clone()
        acc.index_put_((sh.recv,), msgs, accumulate=True)
        return acc

    run("index_put_", index_put_acc)
    return out


def _dispatch_oracle(system: ToySystem) -> dict[str, torch.Tensor]:
    feat, send, recv = system.features, system.send, system.recv
    msgs = torch.tanh(feat[send])
    i_lt_j = send < recv
    hi, hj = send[i_lt_j], recv[i_lt_j]
    pair = feat[hi] * feat[hj]
    both = torch.cat([hi, hj])
    return {
        "index_add_": torch.ones_like(feat).index_add_(0, recv, msgs),
        "index_add": torch.index_add(feat, 0, recv, msgs, alpha=2.0),
        "scatter_add_pairs": torch.zeros_like(feat).scatter_add_(
            0, both[:, None].expand(-1, 4), torch.cat([pair, -2.0 * pair])
        ),
        "scatter_reduce_sum_no_self": feat.scatter_reduce(
            0, recv[:, None].expand(-1, 4), msgs, "sum", include_self=False
        ),
        "scatter_reduce_amax": feat.scatter_reduce(0, recv[:, None].expand(-1, 4), msgs, "amax"),
        "index_put_": feat.clone().index_put_((recv,), msgs, accumulate=True),
    }


@pytest.mark.gloo
@pytest.mark.parametrize(("world", "n_atoms"), [(2, 30), (3, 45), (4, 60)])
def test_scatters_into_shard_tensors_fold_like_the_unsharded_model(
    world: int, n_atoms: int
) -> None:
    system = make_system(n_atoms, world, seed=10 + world)
    results = run_ranks(_dispatch_on_ranks, world, system, timeout_s=120)
    oracle = _dispatch_oracle(system)
    for key, truth in oracle.items():
        assert {r[key + ":type"] for r in results} == {"ShardTensor"}, key
        _assert_padded(results, key, truth)
    for r in results:
        bad = {k: c for k, c in r["syncs"].items() if c[0] != 0}
        assert not bad, f"host synchronisations in the dispatch: {bad}"


# --------------------------------------------------------------------- toy energy


def _toy_on_ranks(system: ToySystem, params: dict[str, torch.Tensor]) -> dict[str, Any]:
    sh = shard(system)
    rank = dist.get_rank()
    n_owned = sh.layout.n_owned
    sys_idx = sh.rows(system.system_index)
    feat = as_shard_tensor(system.features, sh)

    # (a) the padded positions are the leaf; ghost gradients are folded afterwards
    pos = as_shard_tensor(system.positions, sh).requires_grad_()
    ctx = DDContext(layout=sh.layout, n_systems=system.n_systems, positions=pos)
    with dd_scope(ctx):

        def forward_backward() -> tuple[torch.Tensor, torch.Tensor]:
            e = toy_energy(pos, feat, sh.send, sh.recv, sys_idx, system.n_systems, params)
            (g,) = torch.autograd.grad(e.sum(), autograd_target())
            return e, scatter_to_owners(g)

        (energy, grad_a), n_syncs, calls = call_counted(forward_backward)

    # (b) only owned positions are a leaf; the padded rows are built by a refresh in the graph
    pos_owned = system.positions[sh.ids[:n_owned]].clone().requires_grad_()
    ghosts = torch.zeros(sh.ids.shape[0] - n_owned, 3, dtype=torch.float64)
    padded = ShardTensor.from_local(torch.cat([pos_owned, ghosts]), sh.layout)
    with dd_scope(DDContext(layout=sh.layout, n_systems=system.n_systems)):
        e_b = toy_energy(
            refresh_neighbors(padded), feat, sh.send, sh.recv, sys_idx, system.n_systems, params
        )
    (grad_b,) = torch.autograd.grad(e_b.sum(), pos_owned)
    return {
        "rank": rank,
        "ids": sh.ids,
        "owned_ids": sh.ids[:n_owned],
        "energy": energy.detach(),
        "energy_b": e_b.detach(),
        "grad_a": to_local(grad_a)[:n_owned],
        "grad_b": grad_b,
        "syncs": (n_syncs, calls),
    }


def _toy_oracle(
    system: ToySystem, params: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    pos = system.positions.clone().requires_grad_()
    e = toy_energy(
        pos,
        system.features,
        system.send,
        system.recv,
        system.system_index,
        system.n_systems,
        params,
    )
    (g,) = torch.autograd.grad(e.sum(), pos)
    return e.detach(), g


@pytest.mark.gloo
@pytest.mark.parametrize(("world", "n_atoms"), [(2, 30), (3, 45), (4, 64), (8, 96)])
def test_toy_message_passing_energy_and_gradients_match_by_id(world: int, n_atoms: int) -> None:
    system = make_system(n_atoms, world, seed=20 + world)
    params = toy_params()
    results = run_ranks(_toy_on_ranks, world, system, params, timeout_s=180)
    energy, grad = _toy_oracle(system, params)
    for r in results:
        torch.testing.assert_close(r["energy"], energy, atol=EXACT, rtol=0)
        torch.testing.assert_close(r["energy_b"], energy, atol=EXACT, rtol=0)
        assert r["syncs"][0] == 0, f"rank {r['rank']} synchronised: {r['syncs'][1]}"
    ids = torch.cat([r["owned_ids"] for r in results])
    for key in ("grad_a", "grad_b"):
        vals = torch.cat([r[key] for r in results])
        assert_close_by_id(ids, vals, torch.arange(n_atoms), grad, atol=EXACT, what=key)
    assert float(grad.abs().max()) > 1e-3, "the oracle gradient is trivially small"


# ------------------------------------------------------------ rank-consistent failure


def _validate_on_ranks(bad_rank: int, what: str) -> str:
    system = make_system(24, dist.get_world_size(), seed=3)
    sh = shard(system)
    rows = sh.ids.shape[0]
    if what == "positions" and dist.get_rank() == bad_rank:
        rows -= 1
    n_systems = 3 if what == "n_systems" and dist.get_rank() == bad_rank else 2
    pos = torch.zeros(rows, 3, dtype=torch.float64)
    try:
        # the constructor checks types only; validate() checks shapes on every rank
        DDContext(layout=sh.layout, n_systems=n_systems, positions=pos).validate()
    except ValidationError as exc:
        dist.barrier()  # nobody is left waiting: every rank got here
        return str(exc)
    dist.barrier()
    return "ok"


@pytest.mark.gloo
@pytest.mark.parametrize("what", ["positions", "n_systems"])
def test_validate_raises_the_same_error_on_every_rank(what: str) -> None:
    out = run_ranks(_validate_on_ranks, 3, 1, what, timeout_s=120)
    assert len(set(out)) == 1, out
    assert "rank 1" in out[0] and ("n_padded" in out[0] or "n_systems=3" in out[0]), out[0]


def _validate_ok_on_ranks() -> str:
    system = make_system(24, dist.get_world_size(), seed=3)
    sh = shard(system)
    pos = torch.zeros(sh.ids.shape[0], 3, dtype=torch.float64)
    DDContext(layout=sh.layout, n_systems=2, positions=pos).validate()
    return "ok"


@pytest.mark.gloo
def test_validate_passes_a_consistent_context() -> None:
    assert run_ranks(_validate_ok_on_ranks, 2, timeout_s=120) == ["ok", "ok"]
