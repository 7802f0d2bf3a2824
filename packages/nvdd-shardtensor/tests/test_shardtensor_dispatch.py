"""ShardTensor dispatch in one process, on a SelfImageLayout.

The oracle: ghost row ``g`` is an image of owned row ``source[g]``, so a
scatter into padded row ``r`` is a scatter into owned row ``owner_of[r]``, and
every padded row of a consistent tensor equals ``owned[owner_of]``.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch

from nvdd.core import ValidationError
from nvdd.shardtensor import HaloLayout, SelfImageLayout, ShardTensor, to_local

N_OWNED = 6
SOURCE = [0, 1, 2, 4]  # ghost rows 6..9 copy owned rows 0, 1, 2, 4
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class CountingLayout:
    """Wraps a layout and counts its exchanges."""

    def __init__(self, inner: SelfImageLayout) -> None:
        self.inner = inner
        self.refreshes = 0
        self.folds = 0

    @property
    def n_owned(self) -> int:
        return self.inner.n_owned

    @property
    def n_padded(self) -> int:
        return self.inner.n_padded

    @property
    def group(self) -> None:
        return None

    def refresh(self, x: torch.Tensor) -> torch.Tensor:
        self.refreshes += 1
        return self.inner.refresh(x)

    def fold(self, x: torch.Tensor) -> torch.Tensor:
        self.folds += 1
        return self.inner.fold(x)


def _layout(device: str = "cpu") -> CountingLayout:
    return CountingLayout(SelfImageLayout(N_OWNED, torch.tensor(SOURCE, device=device)))


def _owner_of(device: str = "cpu") -> torch.Tensor:
    return torch.tensor([*range(N_OWNED), *SOURCE], device=device)


def _consistent(
    layout: HaloLayout, width: int = 3, dtype: torch.dtype = torch.float64, device: str = "cpu"
) -> tuple[ShardTensor, torch.Tensor]:
    """A ShardTensor whose ghosts equal their owners, and its owned rows."""
    g = torch.Generator().manual_seed(0)
    owned = torch.randn(N_OWNED, width, generator=g, dtype=dtype).to(device)
    return ShardTensor.from_local(owned[_owner_of(device)], layout), owned


def test_row_local_ops_keep_the_layout_and_the_values() -> None:
    layout = _layout()
    x, _ = _consistent(layout)
    w = torch.randn(3, 5, dtype=torch.float64)
    ref = x.to_local()
    cases: dict[str, tuple[Any, torch.Tensor]] = {
        "elementwise": (torch.tanh(x) * 2.0 + x, torch.tanh(ref) * 2.0 + ref),
        "matmul": (x @ w, ref @ w),
        "linear": (torch.nn.functional.linear(x, w.T), ref @ w),
        "cat dim 1": (torch.cat([x, x], dim=1), torch.cat([ref, ref], dim=1)),
        "clone": (x.clone(), ref),
        "detach": (x.detach(), ref),
        "to float32": (x.to(torch.float32), ref.float()),
        "zeros_like": (torch.zeros_like(x), torch.zeros_like(ref)),
        "new_zeros": (x.new_zeros(x.shape[0], 2), torch.zeros(x.shape[0], 2, dtype=x.dtype)),
        "column slice": (x[:, 1:], ref[:, 1:]),
        "column index": (x[..., torch.tensor([2, 0])], ref[..., torch.tensor([2, 0])]),
        "index_select dim 1": (x.index_select(1, torch.tensor([1])), ref[:, [1]]),
    }
    for name, (got, want) in cases.items():
        assert type(got) is ShardTensor, name
        assert got.halo_layout is layout, name
        torch.testing.assert_close(got.to_local(), want, atol=0, rtol=0, msg=name)
    assert layout.refreshes == layout.folds == 0


def test_results_without_per_atom_rows_are_plain() -> None:
    layout = _layout()
    x, _ = _consistent(layout)
    ref = x.to_local()
    cases = {
        "sum over rows": (x.sum(0), ref.sum(0)),
        "scalar": (x.sum(), ref.sum()),
        "cat dim 0": (torch.cat([x, x]), torch.cat([ref, ref])),
        "stack": (torch.stack([x, x]), torch.stack([ref, ref])),
        "transpose": (x.T, ref.T),
        "owned rows": (x[: layout.n_owned], ref[: layout.n_owned]),
    }
    for name, (got, want) in cases.items():
        assert type(got) is torch.Tensor, name
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)


def test_row_mixing_ops_give_plain_tensors() -> None:
    layout = _layout()
    x, _ = _consistent(layout)
    for got in (
        torch.sort(x, dim=0).values,
        x.argsort(dim=0),
        x.flip(0),
        torch.roll(x, 1, 0),
        x.cumsum(0),
        torch.nonzero(x),
    ):
        assert type(got) is torch.Tensor


def test_gathers_along_rows_are_plain_and_need_no_communication() -> None:
    layout = _layout()
    x, owned = _consistent(layout)
    idx = torch.tensor([7, 0, 9, 9, 3])  # ghost rows included
    truth = owned[_owner_of()[idx]]
    mask = torch.zeros(layout.n_padded, dtype=torch.bool)
    mask[idx] = True
    cases = {
        "getitem tensor": (x[idx], truth),
        "getitem list": (x[idx.tolist()], truth),
        "getitem tuple": (x[idx, :], truth),
        "index_select": (x.index_select(0, idx), truth),
        "torch.index_select": (torch.index_select(x, 0, idx), truth),
        "gather": (x.gather(0, idx[:, None].expand(-1, 3)), truth),
        "torch.gather": (torch.gather(x, 0, idx[:, None].expand(-1, 3)), truth),
        "mask": (x[mask], x.to_local()[mask]),
    }
    for name, (got, want) in cases.items():
        assert type(got) is torch.Tensor, name
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)
    # a permutation of all rows keeps the row count but is not per-atom any more
    perm = torch.randperm(layout.n_padded)
    assert type(x[perm]) is torch.Tensor
    assert layout.refreshes == layout.folds == 0


def test_lookup_by_a_per_atom_index_is_per_atom() -> None:
    layout = _layout()
    species = ShardTensor.from_local(torch.tensor([0, 1, 2, 0, 1, 2])[_owner_of()], layout)
    table = torch.randn(3, 4)
    emb = table[species]
    assert type(emb) is ShardTensor and emb.halo_layout is layout
    torch.testing.assert_close(emb.to_local(), table[species.to_local()])


def _oracle_scatter_add(owned: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Padded result of adding ``src`` into padded ``rows`` of the consistent tensor."""
    new_owned = owned.index_add(0, _owner_of(str(owned.device))[rows], src)
    return new_owned[_owner_of(str(owned.device))]


Scatter = Callable[[ShardTensor, torch.Tensor, torch.Tensor], Any]
_SCATTERS: dict[str, tuple[Scatter, float, bool]] = {
    # name: (call, factor on src, in place)
    "index_add_": (lambda x, i, s: x.index_add_(0, i, s), 1.0, True),
    "index_add_ alpha": (lambda x, i, s: x.index_add_(0, i, s, alpha=-0.5), -0.5, True),
    "index_add": (lambda x, i, s: x.index_add(0, i, s), 1.0, False),
    "torch.index_add": (lambda x, i, s: torch.index_add(x, 0, i, s), 1.0, False),
    "scatter_add_": (lambda x, i, s: x.scatter_add_(0, i[:, None].expand_as(s), s), 1.0, True),
    "scatter_add": (lambda x, i, s: x.scatter_add(0, i[:, None].expand_as(s), s), 1.0, False),
    "torch.scatter_add": (
        lambda x, i, s: torch.scatter_add(x, 0, i[:, None].expand_as(s), s),
        1.0,
        False,
    ),
    "scatter_reduce_ sum": (
        lambda x, i, s: x.scatter_reduce_(0, i[:, None].expand_as(s), s, "sum"),
        1.0,
        True,
    ),
    "torch.scatter_reduce sum": (
        lambda x, i, s: torch.scatter_reduce(x, 0, i[:, None].expand_as(s), s, reduce="sum"),
        1.0,
        False,
    ),
    "index_put_ accumulate": (
        lambda x, i, s: x.index_put_((i,), s, accumulate=True),
        1.0,
        True,
    ),
    "torch.index_put accumulate": (
        lambda x, i, s: torch.index_put(x, (i,), s, True),
        1.0,
        False,
    ),
    "dim -2": (lambda x, i, s: x.index_add_(-2, i, s), 1.0, True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(_SCATTERS))
def test_scatters_along_rows_fold_ghost_contributions(
    name: str, device: str, float_dtype: torch.dtype, tolerance: Any
) -> None:
    call, factor, inplace = _SCATTERS[name]
    layout = _layout(device)
    x, owned = _consistent(layout, dtype=float_dtype, device=device)
    rows = torch.tensor([0, 6, 6, 9, 3, 8, 7, 1], device=device)  # owned and ghost receivers
    src = torch.randn(rows.shape[0], 3, dtype=float_dtype).to(device)
    out = call(x, rows, src)
    assert type(out) is ShardTensor and out.halo_layout is layout
    if inplace:
        assert out is x  # no rebinding needed
    else:
        torch.testing.assert_close(x.to_local(), owned[_owner_of(device)], atol=0, rtol=0)
    tol = tolerance(float_dtype)
    want = _oracle_scatter_add(owned, rows, factor * src)
    torch.testing.assert_close(out.to_local(), want, atol=tol.atol, rtol=tol.rtol)
    assert layout.folds >= 1


def test_scatter_reduce_without_self_replaces_touched_rows_on_every_copy() -> None:
    layout = _layout()
    x, owned = _consistent(layout)
    rows = torch.tensor([6, 6, 0, 3])  # owned row 0 is touched through its image 6 and itself
    src = torch.randn(4, 3, dtype=torch.float64)
    out = x.scatter_reduce(0, rows[:, None].expand(-1, 3), src, "sum", include_self=False)
    new_owned = owned.clone()
    new_owned[0] = src[0] + src[1] + src[2]
    new_owned[3] = src[3]
    torch.testing.assert_close(out.to_local(), new_owned[_owner_of()], atol=1e-12, rtol=0)


def test_non_sum_scatter_reduce_on_owned_receivers_is_refreshed() -> None:
    layout = _layout()
    x, owned = _consistent(layout)
    rows = torch.tensor([0, 0, 2, 4])  # owned receivers only (the halo contract)
    src = torch.randn(4, 3, dtype=torch.float64) + 3.0
    out = x.scatter_reduce(0, rows[:, None].expand(-1, 3), src, "amax")
    new_owned = owned.scatter_reduce(0, rows[:, None].expand(-1, 3), src, "amax")
    torch.testing.assert_close(out.to_local(), new_owned[_owner_of()], atol=0, rtol=0)
    assert layout.refreshes == 1 and layout.folds == 0


def test_scatters_that_are_not_along_rows_stay_local() -> None:
    layout = _layout()
    x, _ = _consistent(layout)
    ref = x.to_local().clone()
    cols = torch.tensor([2, 0])
    src = torch.randn(layout.n_padded, 2, dtype=torch.float64)
    x.index_add_(1, cols, src)
    torch.testing.assert_close(x.to_local(), ref.index_add(1, cols, src), atol=0, rtol=0)
    # a scatter into a plain destination is the caller's business
    dest = torch.zeros(layout.n_padded, 3, dtype=torch.float64)
    got = dest.index_add_(0, torch.tensor([6]), x[torch.tensor([0])])
    assert type(got) is torch.Tensor and got is dest
    assert float(dest[0].abs().sum()) == 0.0 and float(dest[6].abs().sum()) > 0.0
    assert layout.folds == 0


def test_index_put_without_accumulate_writes_locally() -> None:
    layout = _layout()
    x, _ = _consistent(layout)
    x.index_put_((torch.tensor([1]),), torch.full((1, 3), 7.0, dtype=torch.float64))
    assert float(x.to_local()[1, 0]) == 7.0 and layout.folds == 0


def test_inplace_ops_act_on_the_shard_tensor_itself() -> None:
    layout = _layout()
    x, _ = _consistent(layout)
    ref = x.to_local().clone()
    same = [x.add_(1.0), x.mul_(2.0), x.clamp_(min=-10.0)]
    x += x
    x -= 1.0
    x **= 1
    assert all(s is x for s in same)
    assert type(x) is ShardTensor and x.halo_layout is layout
    torch.testing.assert_close(x.to_local(), (ref + 1.0) * 4.0 - 1.0, atol=1e-12, rtol=0)
    x[0] = 5.0
    x.copy_(torch.zeros_like(ref))
    assert float(x.to_local().abs().sum()) == 0.0


def test_python_operators_dispatch_and_compute_like_plain_tensors() -> None:
    layout = _layout()
    x, _ = _consistent(layout)
    x = x.abs() + 0.5
    ref = x.to_local()
    w = torch.randn(4, layout.n_padded, dtype=torch.float64)
    cases = [
        (x**2, ref**2, ShardTensor),
        (2.0**x, 2.0**ref, ShardTensor),
        (1.0 - x, 1.0 - ref, ShardTensor),
        (2.0 / x, 2.0 / ref, ShardTensor),
        (x // 0.3, ref // 0.3, ShardTensor),
        (3.0 % x, 3.0 % ref, ShardTensor),
        (-x, -ref, ShardTensor),
        (w @ x, w @ ref, torch.Tensor),
    ]
    for got, want, kind in cases:
        assert type(got) is kind
        torch.testing.assert_close(to_local(got), want, atol=0, rtol=0)


def test_mixing_two_layouts_raises_naming_both() -> None:
    a, _ = _consistent(_layout())
    b, _ = _consistent(SelfImageLayout(N_OWNED, torch.tensor(SOURCE)))
    with pytest.raises(ValidationError, match=r"rank 0: .*add.* two different layouts"):
        _ = a + b
    with pytest.raises(ValidationError, match="n_owned=6, n_padded=10"):
        torch.cat([a, b], dim=1)


def test_from_local_checks_rows_and_layout() -> None:
    layout = _layout()
    with pytest.raises(
        ValidationError, match=r"rank 0: .*shape \(n_padded=10, \.\.\.\), got shape \(9, 3\)"
    ):
        ShardTensor.from_local(torch.zeros(9, 3), layout)
    with pytest.raises(ValidationError, match="is not a HaloLayout"):
        ShardTensor.from_local(torch.zeros(10, 3), object())  # type: ignore[arg-type]
    x = ShardTensor.from_local(torch.zeros(10), layout)
    assert (x.n_owned, x.n_padded, x.halo_layout) == (6, 10, layout)
    assert x.layout == torch.strided  # torch's own attribute is untouched


def test_shard_tensor_is_a_view_of_its_local_tensor_in_the_graph() -> None:
    layout = _layout()
    local = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    x = ShardTensor.from_local(local, layout)
    (g,) = torch.autograd.grad((x * x).sum(), local)
    torch.testing.assert_close(g, 2 * local.detach())
    plain = torch.zeros(10)
    y = ShardTensor.from_local(plain, layout)
    y.add_(1.0)
    assert float(plain.sum()) == 10.0  # same storage
    assert to_local(y).data_ptr() == plain.data_ptr()


def test_gradient_through_scatters_matches_the_image_oracle() -> None:
    layout = _layout()
    g = torch.Generator().manual_seed(3)
    owned = torch.randn(N_OWNED, 3, generator=g, dtype=torch.float64)
    w = torch.randn(3, 3, generator=g, dtype=torch.float64)
    send = torch.tensor([1, 7, 8, 9, 2, 4, 6])  # padded rows
    recv = torch.tensor([0, 1, 2, 3, 4, 5, 5])  # owned receivers

    leaf = ShardTensor.from_local(owned[_owner_of()].clone(), layout).requires_grad_()
    agg = torch.zeros_like(leaf)
    agg.index_add_(0, recv, torch.tanh(leaf[send] @ w))
    energy = ((leaf + agg) ** 2)[: layout.n_owned].sum()
    (grad,) = torch.autograd.grad(energy, leaf)
    grad_owned = layout.fold(grad)[: layout.n_owned]  # ghost partials to owners

    o = owned.clone().requires_grad_()
    owner = _owner_of()
    agg_o = torch.zeros_like(o).index_add(0, recv, torch.tanh(o[owner[send]] @ w))
    (want,) = torch.autograd.grad(((o + agg_o) ** 2).sum(), o)
    torch.testing.assert_close(grad_owned, want, atol=1e-12, rtol=0)


def test_repr_copy_and_pickle() -> None:
    layout = _layout()
    x, _ = _consistent(layout)
    assert repr(x).startswith("ShardTensor(n_owned=6, n_padded=10, layout=CountingLayout, local=")
    y = copy.deepcopy(x)
    assert type(y) is ShardTensor and y.halo_layout is layout
    assert y.to_local().data_ptr() != x.to_local().data_ptr()
    torch.testing.assert_close(y.to_local(), x.to_local())
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(x)
