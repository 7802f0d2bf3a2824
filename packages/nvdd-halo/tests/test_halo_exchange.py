"""Forward / reverse exchanges: adjoint identity, autograd against the unsharded
computation, packed multi-field exchanges and the halo-layout protocol."""

from __future__ import annotations

import pytest
import torch
from halo_cases import make_case, owners, pair_energy_reference
from halo_rankfns import adjoint_rank, energy_rank, local_plan, many_rank

from nvdd.testing import assert_close_by_id, run_ranks


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("name", "trailing"),
    [
        ("slab3_uneven_triclinic", (3,)),
        ("two_systems", (2, 2)),
        ("grid2x2_mixed", ()),
        ("empty_rank", (3,)),
    ],
)
def test_forward_and_reverse_are_adjoint(name: str, trailing: tuple[int, ...]) -> None:
    case = make_case(name)
    out = run_ranks(adjoint_rank, case.world, name, trailing, timeout_s=120)
    lhs, rhs, lhs_many, rhs_many = out[0]
    assert all(o == out[0] for o in out)  # the sums were all-reduced
    assert abs(lhs) > 1e-3  # a non-trivial pairing
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs))
    assert abs(lhs_many - rhs_many) <= 1e-12 * max(1.0, abs(lhs))
    assert abs(lhs_many - lhs) <= 1e-12 * max(1.0, abs(lhs))


@pytest.mark.gloo
@pytest.mark.parametrize(
    "name", ["slab3_uneven_triclinic", "two_systems", "multihop_slab4", "wider_than_cell"]
)
def test_autograd_through_ghost_positions_matches_unsharded(name: str) -> None:
    case = make_case(name)
    cutoff = case.ghost_width * 0.95
    out = run_ranks(energy_rank, case.world, name, cutoff, "float64", timeout_s=180)
    pos = case.positions.clone().requires_grad_(True)
    cell = case.cell.clone().requires_grad_(True)
    ref = pair_energy_reference(pos, cell, case, cutoff)
    ref.backward()
    assert pos.grad is not None and cell.grad is not None
    assert float(ref.detach()) != 0.0
    total = sum(o["energy"] for o in out)
    assert abs(total - float(ref.detach())) <= 1e-10 * max(1.0, abs(float(ref.detach())))
    ids = torch.cat([o["ids"] for o in out])
    grads = torch.cat([o["grad"] for o in out])
    assert_close_by_id(ids, grads, case.atom_ids, pos.grad, atol=1e-10, what="dE/dx")
    cell_grad = sum(o["cell_grad"] for o in out)
    torch.testing.assert_close(cell_grad, cell.grad, atol=1e-10, rtol=0)


@pytest.mark.gloo
def test_autograd_float32_matches_float64_reference() -> None:
    case = make_case("slab3_uneven_triclinic")
    cutoff = case.ghost_width * 0.95
    out = run_ranks(energy_rank, case.world, case.name, cutoff, "float32", timeout_s=180)
    pos = case.positions.clone().requires_grad_(True)
    pair_energy_reference(pos, case.cell, case, cutoff).backward()
    assert pos.grad is not None
    ids = torch.cat([o["ids"] for o in out])
    grads = torch.cat([o["grad"] for o in out]).double()
    assert_close_by_id(ids, grads, case.atom_ids, pos.grad, atol=1e-5, rtol=1e-5, what="dE/dx")


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["slab2_cubic", "two_systems"])
def test_forward_many_protocol_and_packed_autograd(name: str) -> None:
    case = make_case(name)
    for o in run_ranks(many_rank, case.world, name, timeout_s=120):
        assert o["same"]
        assert o["dtypes"] == [torch.float64, torch.int64, torch.bool, torch.float32]
        assert o["requires_grad"] == [True, False, False, True]
        assert o["grad_ok"] and o["refresh_ok"] and o["fold_ok"] and o["pad_ok"]


def test_gradcheck_single_process_exchanges() -> None:
    case = make_case("wider_than_cell")  # 12 atoms; one rank holds every image
    case = type(case)(**{**case.__dict__, "world": 1, "boxes": case.boxes[:, :1].clone()})
    case.boxes[0, 0, 1, 0] = 1.0
    plan, pos = local_plan(case, 0, torch.float64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(plan.n_owned, 2, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(plan.n_ghost, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(plan.forward, (x,), fast_mode=True)
    assert torch.autograd.gradcheck(plan.reverse, (y,), fast_mode=True)
    p = pos.clone().requires_grad_(True)
    c = case.cell.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(plan.ghost_positions, (p, c), fast_mode=True)
    # Every owned atom with ghosts gets its ghost rows back, summed.
    ones = plan.reverse(torch.ones(plan.n_ghost, dtype=torch.float64))
    assert torch.equal(ones, torch.bincount(plan.ghost_owner_row, minlength=plan.n_owned).double())


def test_reverse_is_deterministic_and_exact_in_integers() -> None:
    case = make_case("single_periodic")
    plan, _ = local_plan(case, 0, torch.float64)
    vals = torch.randn(plan.n_ghost, 3, dtype=torch.float64)
    a, b = plan.reverse(vals), plan.reverse(vals)
    assert torch.equal(a, b)
    ints = torch.arange(plan.n_ghost, dtype=torch.int64)
    expect = torch.zeros(plan.n_owned, dtype=torch.int64).index_add_(0, plan.ghost_owner_row, ints)
    assert torch.equal(plan.reverse(ints), expect)
    assert owners(case).max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_warp_fold_equals_index_add_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """The CUDA fold (Warp, runs of the sorted owner rows) run on the CPU: the
    same sums as ``index_add_`` in the same order, so equal bit for bit, and
    reached through ``HaloPlan.reverse`` as on a GPU."""
    from nvdd.halo import _plan

    case = make_case("single_periodic")
    plan, _ = local_plan(case, 0, dtype)
    g = torch.Generator().manual_seed(4)
    vals = torch.randn(plan.n_ghost, 3, generator=g, dtype=torch.float64).to(dtype)
    expect = plan.reverse(vals)  # index_add_ on the CPU
    calls: list[int] = []
    real = _plan._kernels.fold_rows

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(int(args[1].shape[0]))
        return real(*args)

    monkeypatch.setattr(_plan, "FOLD_WITH_WARP", ("cpu", "cuda"))
    monkeypatch.setattr(_plan._kernels, "fold_rows", counted)
    got = plan.reverse(vals)
    assert calls == [plan.n_ghost]  # the Warp path ran, over every sent row
    assert torch.equal(got, expect)
    assert int(torch.unique(plan.ghost_owner_row).numel()) < plan.n_ghost  # runs of >1 row


@pytest.mark.parametrize("per_row", [False, True], ids=["one-cell", "cell-per-row"])
def test_image_shift_is_image_at_cell_and_differentiable(per_row: bool) -> None:
    """``_plan.image_shift`` (the ghosts' shift, elementwise) equals the matrix
    product it replaces, with one cell or one per row, and its gradients too."""
    from nvdd.halo._plan import image_shift

    gen = torch.Generator().manual_seed(3)
    image = torch.randint(-2, 3, (257, 3), generator=gen).to(torch.float64)
    shape = (257, 3, 3) if per_row else (3, 3)
    cell = torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
    got = image_shift(image, cell)
    want = torch.bmm(image.unsqueeze(1), cell).squeeze(1) if per_row else image @ cell
    assert got.shape == (257, 3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    weight = torch.randn(257, 3, generator=gen, dtype=torch.float64)
    (g_got,) = torch.autograd.grad((got * weight).sum(), cell)
    (g_want,) = torch.autograd.grad((want * weight).sum(), cell)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-12)
