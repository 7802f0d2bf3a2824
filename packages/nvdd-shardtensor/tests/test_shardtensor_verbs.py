"""The intent vocabulary and the DD context in one process."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from shardtensor_fakes import HostSyncCounter

from nvdd.core import ConfigurationError, ValidationError
from nvdd.shardtensor import (
    DDContext,
    Scope,
    SelfImageLayout,
    ShardTensor,
    autograd_target,
    current_dd_context,
    dd_scope,
    localize,
    refresh_neighbors,
    scatter_to_owners,
    system_sum,
    to_local,
)

SOURCE = torch.tensor([0, 1, 2, 4])  # 6 owned rows, ghosts copy rows 0, 1, 2, 4
OWNER_OF = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 4])


def _layout() -> SelfImageLayout:
    return SelfImageLayout(6, SOURCE)


def test_outside_any_scope_the_context_is_inert_and_the_verbs_are_identities() -> None:
    ctx = current_dd_context()
    assert ctx.layout is None and ctx.group is None and not ctx.is_distributed
    assert ctx.world_size == 1 and ctx.n_owned is None
    x = torch.randn(5, 3)
    assert refresh_neighbors(x) is x
    assert scatter_to_owners(x) is x
    assert to_local(x) is x and to_local(3) == 3
    assert autograd_target(x) is x
    idx = torch.tensor([0, 1, 1, 0, 2])
    want = torch.zeros(3, 3).index_add_(0, idx, x)
    for scope in Scope:
        torch.testing.assert_close(system_sum(x, idx, 3, scope), want)


def test_verbs_on_plain_tensors_use_the_context_layout() -> None:
    layout = _layout()
    stale = torch.arange(10.0)[:, None] * torch.tensor([[1.0, -1.0]])
    with dd_scope(DDContext(layout=layout)) as ctx:
        assert current_dd_context() is ctx and ctx.is_distributed
        fresh = refresh_neighbors(stale)
        assert type(fresh) is torch.Tensor
        torch.testing.assert_close(fresh, stale[OWNER_OF])
        folded = scatter_to_owners(stale)
        owned = stale[:6].index_add(0, SOURCE, stale[6:])
        torch.testing.assert_close(folded, owned[OWNER_OF])
        with pytest.raises(
            ValidationError, match=r"rank 0: scatter_to_owners needs shape \(n_padded=10"
        ):
            scatter_to_owners(torch.zeros(9, 2))


def test_verbs_on_shard_tensors_use_their_own_layout_and_return_shard_tensors() -> None:
    own, other = _layout(), SelfImageLayout(6, torch.tensor([5, 5, 5, 5]))
    stale = torch.arange(10.0)
    x = ShardTensor.from_local(stale.clone(), own)
    with dd_scope(DDContext(layout=other)):  # the context's layout must not be used
        fresh = refresh_neighbors(x)
        folded = scatter_to_owners(x)
    assert type(fresh) is ShardTensor and fresh.halo_layout is own
    torch.testing.assert_close(fresh.to_local(), stale[OWNER_OF])
    assert type(folded) is ShardTensor and folded.halo_layout is own
    torch.testing.assert_close(folded.to_local(), own.fold(stale))


def test_system_sum_counts_owned_rows_once_with_trailing_dims() -> None:
    layout = _layout()
    vir = torch.randn(10, 3, 3, dtype=torch.float64)
    sys_idx = torch.tensor([0, 0, 1, 1, 1, 0, 0, 0, 1, 1])
    want = torch.zeros(2, 3, 3, dtype=torch.float64).index_add_(0, sys_idx[:6], vir[:6])
    with dd_scope(DDContext(layout=layout, n_systems=2)):
        for scope in Scope:
            torch.testing.assert_close(system_sum(vir, sys_idx, 2, scope), want)
    st = ShardTensor.from_local(vir, layout)
    got = system_sum(st, ShardTensor.from_local(sys_idx, layout), 2)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, want)
    # rows already cut to the owned ones are accepted as well
    torch.testing.assert_close(system_sum(st[:6], sys_idx[:6], 2), want)


def test_system_sum_backward_is_the_identity_on_owned_rows() -> None:
    layout = _layout()
    values = torch.randn(10, dtype=torch.float64, requires_grad=True)
    sys_idx = torch.tensor([0, 1] * 5)
    with dd_scope(DDContext(layout=layout, n_systems=2)):
        total = system_sum(values, sys_idx, 2)
    (g,) = torch.autograd.grad(total @ torch.tensor([1.0, 10.0], dtype=torch.float64), values)
    want = torch.tensor([1.0, 10.0] * 3 + [0.0] * 4, dtype=torch.float64)
    torch.testing.assert_close(g, want, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (
            (torch.zeros(4), torch.zeros(4, dtype=torch.long), 2, "owned"),
            ConfigurationError,
            "scope",
        ),
        ((torch.zeros(4), torch.zeros(4, dtype=torch.long), -1), ConfigurationError, "n_systems"),
        (
            (torch.zeros(4), torch.zeros(3, dtype=torch.long), 2),
            ValidationError,
            r"\(4,\) and \(3,\)",
        ),
        ((torch.zeros(4), torch.zeros(4), 2), ValidationError, "integer tensor"),
        ((torch.tensor(1.0), torch.zeros(1, dtype=torch.long), 2), ValidationError, "n_rows"),
    ],
)
def test_system_sum_rejects_bad_arguments(args: tuple[Any, ...], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        system_sum(*args)


def test_system_sum_needs_the_owned_rows() -> None:
    with dd_scope(DDContext(layout=_layout())), pytest.raises(ValidationError, match="n_owned=6"):
        system_sum(torch.zeros(4), torch.zeros(4, dtype=torch.long), 1)


def test_localize_and_to_local() -> None:
    layout = _layout()
    x = ShardTensor.from_local(torch.randn(10, 2), layout)
    plain = torch.ones(3)
    d = localize({"x": x, "plain": plain, "n": 3})
    assert type(d["x"]) is torch.Tensor and d["x"].data_ptr() == x.data_ptr()
    assert d["plain"] is plain and d["n"] == 3
    assert type(to_local(x)) is torch.Tensor


def test_autograd_target_prefers_the_context_positions_when_distributed() -> None:
    layout = _layout()
    pos = torch.zeros(10, 3, requires_grad=True)
    other = torch.zeros(10, 3)
    with dd_scope(DDContext(layout=layout, positions=pos)):
        assert autograd_target(other) is pos
        assert autograd_target() is pos
    with dd_scope(DDContext(positions=pos)):  # inert context with positions
        assert autograd_target(other) is other
        assert autograd_target() is pos
    with pytest.raises(ConfigurationError, match="no x"):
        autograd_target()


def test_dd_scope_nests_and_restores_on_error() -> None:
    outer, inner = DDContext(layout=_layout()), DDContext(n_systems=3)
    seen: list[DDContext] = []

    def fail_inside() -> None:
        with dd_scope(inner):
            seen.append(current_dd_context())
            raise RuntimeError("boom")

    with dd_scope(outer):
        with pytest.raises(RuntimeError, match="boom"):
            fail_inside()
        assert seen == [inner]
        assert current_dd_context() is outer
        with dd_scope(None):
            assert current_dd_context().layout is None
        assert current_dd_context() is outer
    assert current_dd_context().layout is None
    with pytest.raises(ConfigurationError, match="needs a DDContext"), dd_scope("ctx"):  # type: ignore[arg-type]
        pass


def test_each_thread_sees_its_own_context() -> None:
    seen: dict[str, Any] = {}
    ready = threading.Barrier(2)

    def worker() -> None:
        seen["before"] = current_dd_context().layout
        with dd_scope(DDContext(n_systems=7)):
            ready.wait()
            seen["inside"] = current_dd_context().n_systems
            ready.wait()

    with dd_scope(DDContext(layout=_layout())):
        t = threading.Thread(target=worker)
        t.start()
        ready.wait()  # the worker is inside its own scope now
        assert current_dd_context().layout is not None
        ready.wait()
        t.join()
    assert seen == {"before": None, "inside": 7}


def test_dd_context_fields_and_helpers() -> None:
    layout = _layout()
    ctx = DDContext(layout=layout, n_systems=2, topology_version=4)
    assert ctx.group is layout.group and ctx.n_owned == 6 and ctx.world_size == 1
    assert ctx.owned_mask().tolist() == [True] * 6 + [False] * 4
    assert ctx.owned_mask(7).tolist() == [True] * 6 + [False]
    inert = DDContext(positions=torch.zeros(4, 3))
    assert inert.n_owned == 4 and inert.owned_mask().tolist() == [True] * 4
    with pytest.raises(ConfigurationError, match="needs n_rows"):
        DDContext().owned_mask()
    with pytest.raises(ConfigurationError, match="n_systems must be an int >= 0, got -1"):
        DDContext(n_systems=-1)
    with pytest.raises(ConfigurationError, match="topology_version"):
        DDContext(topology_version=-2)
    with pytest.raises(ValidationError, match="is not a HaloLayout"):
        DDContext(layout=object())  # type: ignore[arg-type]
    with pytest.raises(
        ValidationError, match=r"rank 0: DDContext.positions must have shape \(n_padded=10, 3\)"
    ):
        DDContext(layout=layout, positions=torch.zeros(9, 3)).validate()
    DDContext(layout=layout, positions=torch.zeros(10, 3)).validate()


def test_self_image_layout_checks_its_table() -> None:
    with pytest.raises(ValidationError, match=r"values must lie in \[0, 3\), got \[0, 3\]"):
        SelfImageLayout(3, torch.tensor([0, 3]))
    with pytest.raises(ValidationError, match="1-D integer tensor"):
        SelfImageLayout(3, torch.tensor([0.0]))
    with pytest.raises(ValidationError, match="n_owned must be an int >= 0"):
        SelfImageLayout(-1, torch.tensor([], dtype=torch.long))
    empty = SelfImageLayout(2, torch.tensor([], dtype=torch.long))
    assert empty.n_padded == 2
    x = torch.randn(2, 3)
    torch.testing.assert_close(empty.refresh(x), x)
    torch.testing.assert_close(empty.fold(x), x)
    with pytest.raises(ValidationError, match=r"SelfImageLayout\.refresh needs shape"):
        _layout().refresh(torch.zeros(3))


def test_the_sync_counter_sees_host_synchronisations() -> None:
    x = torch.ones(3)
    with HostSyncCounter() as guard:
        x.sum().item()
        bool(x.any())
        x.tolist()
    assert guard.calls == ["item", "__bool__", "tolist"]
    assert "item" not in vars(torch.Tensor)  # restored: the patch is gone


@pytest.mark.parametrize("distributed", [False, True], ids=["inert", "self-image"])
def test_no_verb_synchronises_with_the_host(distributed: bool) -> None:
    layout = _layout() if distributed else None
    n = 10
    pos = torch.randn(n, 3, requires_grad=True)
    x = torch.randn(n, 4)
    sys_idx = torch.tensor([0, 1] * 5)
    st = ShardTensor.from_local(x.clone(), _layout())
    counts: dict[str, list[str]] = {}
    calls: list[tuple[str, Any]] = [
        ("refresh_neighbors", lambda: refresh_neighbors(x)),
        ("refresh_neighbors(st)", lambda: refresh_neighbors(st)),
        ("scatter_to_owners", lambda: scatter_to_owners(x)),
        ("scatter_to_owners(st)", lambda: scatter_to_owners(st)),
        ("system_sum", lambda: system_sum(x, sys_idx, 2)),
        ("system_sum(LOCAL)", lambda: system_sum(x, sys_idx, 2, Scope.LOCAL)),
        ("to_local", lambda: to_local(st)),
        ("localize", lambda: localize({"a": st, "b": x})),
        ("autograd_target", lambda: autograd_target(pos)),
        ("current_dd_context", current_dd_context),
        ("index_add_ dispatch", lambda: st.index_add_(0, sys_idx, x)),
    ]
    with dd_scope(DDContext(layout=layout, n_systems=2, positions=pos if distributed else None)):
        for name, fn in calls:
            with HostSyncCounter() as guard:
                fn()
            counts[name] = guard.calls
    assert all(not c for c in counts.values()), counts
