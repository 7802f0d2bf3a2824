"""build_halo_plan against the brute-force oracle over the global system.

For every case (periodic, open and mixed boundaries; cubic and triclinic cells;
slab, 2-D, 3-D, uneven and bisection cuts; multi-hop halos wider than a box and
than the cell; two systems in one batch) and every rank: the ghost rows are
exactly the (atom, image) pairs whose image lies in the rank's expanded box,
each once; every pair within ghost_width of an owned atom is present; the rows
are ordered by (source rank, source row, image); ghost positions are right.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from halo_cases import (
    CASES,
    Case,
    as_single_rank,
    expected_ghosts,
    make_case,
    neighbour_keys,
    owners,
)
from halo_rankfns import config_of, local_plan, plan_rank, plan_summary

from nvdd.halo import build_halo_plan
from nvdd.testing import run_ranks


def check_plan(case: Case, out: list[dict[str, Any]], atol: float) -> None:
    gidx = torch.full((int(case.atom_ids.max()) + 1,), -1, dtype=torch.int64)
    gidx[case.atom_ids] = torch.arange(case.atom_ids.numel())
    own = owners(case)
    for r, o in enumerate(out):
        got = sorted(
            (int(i), *(int(v) for v in n))
            for i, n in zip(o["ghost_ids"], o["image"].tolist(), strict=True)
        )
        want = expected_ghosts(case, r)
        assert got == want, (
            f"{case.name} rank {r}: missing {sorted(set(want) - set(got))[:8]}, "
            f"extra {sorted(set(got) - set(want))[:8]}, {len(got)} vs {len(want)} rows"
        )
        assert o["n"] == (len(o["ids"]), len(want), len(o["ids"]) + len(want))
        # Order: source rank, then source row, then image; no duplicate row.
        keys = torch.cat([o["owner_rank"][:, None], o["owner_row"][:, None], o["image"]], 1)
        keys_list = [tuple(k) for k in keys.tolist()]
        assert keys_list == sorted(keys_list) and len(set(keys_list)) == len(keys_list)
        # Owner metadata points at the right atom; system and positions are right.
        for src in range(len(out)):
            sel = o["owner_rank"] == src
            assert torch.equal(out[src]["ids"][o["owner_row"][sel]], o["ghost_ids"][sel])
        g = gidx[o["ghost_ids"]]
        assert torch.equal(o["system"], case.system_index[g])
        assert torch.equal(o["owner_rank"], own[g])
        expect = case.positions[g] + torch.bmm(
            o["image"].double().unsqueeze(1), case.cell[case.system_index[g]]
        ).squeeze(1)
        torch.testing.assert_close(o["ghost_pos"].double(), expect, atol=atol, rtol=0)
        # Splits agree between sender and receiver.
        for src in range(len(out)):
            assert out[src]["counts"][0][r] == o["counts"][1][src]


def check_neighbours(case: Case, out: list[dict[str, Any]]) -> None:
    """Every image within ghost_width of an owned atom is on the owner's rank."""
    for r, o in enumerate(out):
        present = {
            (int(i), *(int(v) for v in n)) for i, n in zip(o["ghost_ids"], o["image"], strict=False)
        }
        missing = neighbour_keys(case, r) - present
        assert not missing, f"{case.name} rank {r}: neighbours missing {sorted(missing)[:8]}"


@pytest.mark.gloo
@pytest.mark.parametrize("name", CASES)
def test_plan_matches_brute_force_float64(name: str) -> None:
    case = make_case(name)
    out = run_ranks(plan_rank, case.world, name, "float64", "warp", timeout_s=180)
    check_plan(case, out, atol=1e-12)
    check_neighbours(case, out)


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["slab3_uneven_triclinic", "two_systems", "wider_than_cell"])
def test_plan_torch_backend_is_identical(name: str) -> None:
    case = make_case(name)
    warp = run_ranks(plan_rank, case.world, name, "float64", "warp", timeout_s=180)
    ref = run_ranks(plan_rank, case.world, name, "float64", "torch", timeout_s=180)
    for a, b in zip(warp, ref, strict=True):
        for key in ("ghost_ids", "owner_rank", "owner_row", "image", "system"):
            assert torch.equal(a[key], b[key]), key
    check_plan(case, ref, atol=1e-12)


@pytest.mark.gloo
def test_plan_float32_grid() -> None:
    case = make_case("grid2x2_mixed")
    out = run_ranks(plan_rank, case.world, case.name, "float32", "warp", timeout_s=180)
    check_plan(case, out, atol=1e-5)


@pytest.mark.parametrize("name", ["single_periodic", "two_systems", "wider_than_cell"])
def test_plan_without_process_group_self_images(name: str) -> None:
    assert not dist.is_initialized()
    case = as_single_rank(make_case(name))
    plan, pos = local_plan(case, 0, torch.float64)
    out = [plan_summary(case, plan, pos, 0)]
    check_plan(case, out, atol=1e-12)
    check_neighbours(case, out)
    assert plan.n_ghost > 0 and bool((plan.ghost_image != 0).any(dim=1).all())
    assert plan.send_counts == plan.recv_counts == (plan.n_ghost,)


def test_plan_unwrapped_positions_keep_their_images() -> None:
    """Images are relative to the positions as given (no wrapping inside the plan).

    Shifting every atom by a lattice vector moves the owned rows out of the box;
    the expanded box then holds the same Cartesian images as before, and none of
    them is an owned row any more: the ghosts are the old ghosts plus the old
    owned positions.
    """
    case = make_case("single_periodic")
    plan, pos = local_plan(case, 0, torch.float64)
    shift = torch.tensor([2.0, -1.0, 0.0], dtype=torch.float64) @ case.cell[0]
    moved = build_halo_plan(
        config_of(case), pos + shift, case.atom_ids, case.system_index, case.cell
    )

    def points(ids: torch.Tensor, xyz: torch.Tensor) -> list[tuple[int, ...]]:
        q = torch.round(xyz * 1e6).long()
        return sorted((int(i), *(int(v) for v in p)) for i, p in zip(ids, q, strict=True))

    before = points(
        torch.cat([plan.ghost_atom_ids, case.atom_ids]),
        torch.cat([plan.ghost_positions(pos, case.cell), pos]),
    )
    after = points(moved.ghost_atom_ids, moved.ghost_positions(pos + shift, case.cell))
    assert after == before
    assert moved.n_ghost == plan.n_ghost + plan.n_owned


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["two_systems", "wider_than_cell", "grid2x2_mixed"])
def test_plan_on_cuda_matches_cpu(name: str, float_dtype: torch.dtype) -> None:
    case = as_single_rank(make_case(name))
    cpu_plan, pos = local_plan(case, 0, float_dtype, backend="torch")
    cuda_plan = build_halo_plan(
        config_of(case),
        pos.cuda(),
        case.atom_ids.cuda(),
        case.system_index.cuda(),
        case.cell.to(float_dtype).cuda(),
    )
    for key in ("ghost_atom_ids", "ghost_owner_row", "ghost_image", "ghost_system_index"):
        assert torch.equal(getattr(cuda_plan, key).cpu(), getattr(cpu_plan, key)), key
    x = pos.cuda().requires_grad_(True)
    cell = case.cell.to(float_dtype).cuda().requires_grad_(True)
    ghosts = cuda_plan.ghost_positions(x, cell)
    tol = 1e-12 if float_dtype == torch.float64 else 1e-5
    torch.testing.assert_close(
        ghosts.detach().cpu(),
        cpu_plan.ghost_positions(pos, case.cell.to(float_dtype)),
        atol=tol,
        rtol=tol,
    )
    w = torch.randn_like(ghosts)
    (ghosts * w).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad.cpu(), cpu_plan.reverse(w.cpu()), atol=tol, rtol=tol)
    # Deterministic fold on CUDA (Warp CSR kernel): bit-identical twice.
    assert torch.equal(cuda_plan.reverse(w), cuda_plan.reverse(w))
