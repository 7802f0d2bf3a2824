"""Functions the halo tests run on every rank (kept free of pytest: a rank
imports this module, and importing pytest would cost each rank a second)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from halo_cases import Case, make_case, owned_slice

from nvdd.halo import HaloPlan, ParticleHaloConfig, build_halo_plan


def config_of(case: Case, **kw: Any) -> ParticleHaloConfig:
    """The case's config (default group)."""
    return ParticleHaloConfig(boxes=case.boxes, pbc=case.pbc, ghost_width=case.ghost_width, **kw)


def rank() -> int:
    """This rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def error_text(call: Callable[[], object], exc_type: type[Exception], typed: bool = False) -> str:
    """Run a collective ``call``; return the message of the ``exc_type`` it raised
    (``"TypeName: message"`` when ``typed``), after a barrier that proves every rank
    left the collective together, or ``"no error"``."""
    try:
        call()
    except exc_type as exc:
        if dist.is_initialized():
            dist.barrier()
        return f"{type(exc).__name__}: {exc}" if typed else str(exc)
    return "no error"


def local_plan(
    case: Case, r: int, dtype: torch.dtype, backend: str = "warp", **kw: Any
) -> tuple[HaloPlan, torch.Tensor]:
    """Rank r's plan of the case, and its owned positions."""
    rows = owned_slice(case, r)
    pos = case.positions[rows].to(dtype)
    plan = build_halo_plan(
        config_of(case, **kw),
        pos,
        case.atom_ids[rows],
        case.system_index[rows],
        case.cell.to(dtype),
        backend=backend,
    )
    return plan, pos


def plan_summary(case: Case, plan: HaloPlan, pos: torch.Tensor, r: int) -> dict[str, Any]:
    """What the plan tests compare against the oracle."""
    return {
        "ids": case.atom_ids[owned_slice(case, r)],
        "ghost_ids": plan.ghost_atom_ids,
        "owner_rank": plan.ghost_owner_rank,
        "owner_row": plan.ghost_owner_row,
        "image": plan.ghost_image,
        "system": plan.ghost_system_index,
        "ghost_pos": plan.ghost_positions(pos, case.cell.to(pos.dtype)),
        "n": (plan.n_owned, plan.n_ghost, plan.n_padded),
        "counts": (plan.send_counts, plan.recv_counts),
    }


def plan_rank(name: str, dtype_name: str, backend: str) -> dict[str, Any]:
    """Build this rank's plan of a named case and summarise it."""
    case = make_case(name)
    plan, pos = local_plan(case, rank(), getattr(torch, dtype_name), backend)
    return plan_summary(case, plan, pos, rank())


def _allsum(v: torch.Tensor) -> torch.Tensor:
    v = v.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(v)
    return v


def adjoint_rank(name: str, trailing: tuple[int, ...]) -> tuple[float, float, float, float]:
    """<forward(x), y> and <x, reverse(y)> summed over ranks, single and packed."""
    case = make_case(name)
    r = rank()
    plan, _ = local_plan(case, r, torch.float64)
    g = torch.Generator().manual_seed(100 + r)
    x = torch.randn(plan.n_owned, *trailing, generator=g, dtype=torch.float64)
    y = torch.randn(plan.n_ghost, *trailing, generator=g, dtype=torch.float64)
    lhs = _allsum((plan.forward(x) * y).sum())
    rhs = _allsum((x * plan.reverse(y)).sum())
    (fx,) = plan.forward_many([x])
    (ry,) = plan.reverse_many([y])
    lhs_many = _allsum((fx * y).sum())
    rhs_many = _allsum((x * ry).sum())
    return float(lhs), float(rhs), float(lhs_many), float(rhs_many)


def phi_energy(padded: torch.Tensor, n_owned: int, cutoff: float) -> torch.Tensor:
    """0.5 * sum over owned i, padded k != i of phi(x_i - x_k) (open boundaries)."""
    from halo_cases import phi

    d = padded[:n_owned, None, :] - padded[None, :, :]
    eye = torch.zeros(n_owned, padded.shape[0], dtype=padded.dtype)
    eye[torch.arange(n_owned), torch.arange(n_owned)] = 10.0 * cutoff
    d = d + eye[:, :, None]
    return 0.5 * phi(d, cutoff).sum()


def energy_rank(name: str, cutoff: float, dtype_name: str) -> dict[str, Any]:
    """Sharded pair energy, forces and cell gradient of this rank."""
    case = make_case(name)
    r = rank()
    dtype = getattr(torch, dtype_name)
    plan, pos = local_plan(case, r, dtype)
    pos = pos.clone().requires_grad_(True)
    cell = case.cell.to(dtype).clone().requires_grad_(True)
    # Each system's atoms only see their own system's ghosts.
    padded = torch.cat([pos, plan.ghost_positions(pos, cell)])
    sys_padded = torch.cat([case.system_index[owned_slice(case, r)], plan.ghost_system_index])
    energy = pos.new_zeros(())
    for s in range(case.cell.shape[0]):
        own_s = (sys_padded[: plan.n_owned] == s).nonzero().flatten()
        ghost_s = (sys_padded[plan.n_owned :] == s).nonzero().flatten() + plan.n_owned
        rows = torch.cat([own_s, ghost_s])
        energy = energy + phi_energy(padded[rows], len(own_s), cutoff)
    energy.backward()
    assert pos.grad is not None and cell.grad is not None
    return {
        "ids": case.atom_ids[owned_slice(case, r)],
        "energy": float(energy.detach()),
        "grad": pos.grad.detach(),
        "cell_grad": cell.grad.detach(),
    }


def many_rank(name: str) -> dict[str, Any]:
    """forward_many of mixed dtypes against single forwards, with autograd."""
    case = make_case(name)
    r = rank()
    plan, _ = local_plan(case, r, torch.float64)
    g = torch.Generator().manual_seed(7 + r)
    n = plan.n_owned
    a = torch.randn(n, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randint(0, 100, (n,), generator=g)
    c = torch.rand(n, generator=g) < 0.5
    d = torch.randn(n, 2, 2, generator=g).requires_grad_(True)
    fa, fb, fc, fd = plan.forward_many([a, b, c, d])
    singles = [plan.forward(t) for t in (a, b, c, d)]
    same = all(torch.equal(u, v) for u, v in zip((fa, fb, fc, fd), singles, strict=True))
    wa = torch.randn(plan.n_ghost, 3, generator=g, dtype=torch.float64)
    wd = torch.randn(plan.n_ghost, 2, 2, generator=g)
    ((fa * wa).sum() + (fd * wd).sum()).backward()
    assert a.grad is not None and d.grad is not None
    ra, rd = plan.reverse_many([wa, wd])
    # refresh / fold / pad / owned
    x = torch.randn(plan.n_padded, 3, generator=g, dtype=torch.float64)
    poisoned = x.clone()
    poisoned[n:] = float("nan")
    refreshed = plan.refresh(poisoned)
    folded = plan.fold(x)
    owned_fold = x[:n] + plan.reverse(x[n:])
    return {
        "same": same,
        "dtypes": [t.dtype for t in (fa, fb, fc, fd)],
        "grad_ok": torch.allclose(a.grad, ra, atol=1e-14, rtol=0)
        and torch.allclose(d.grad, rd, atol=1e-6, rtol=0),
        "requires_grad": [t.requires_grad for t in (fa, fb, fc, fd)],
        "refresh_ok": bool(torch.isfinite(refreshed).all())
        and torch.equal(refreshed[:n], x[:n])
        and torch.equal(refreshed[n:], plan.forward(x[:n])),
        "fold_ok": torch.allclose(folded[:n], owned_fold, atol=1e-14, rtol=0)
        and torch.allclose(folded[n:], plan.forward(owned_fold), atol=1e-14, rtol=0),
        "pad_ok": torch.equal(plan.pad(x[:n]), refreshed)
        and plan.owned(x).data_ptr() == x.data_ptr(),
    }


def bad_plan_rank(name: str, fault: str, bad_rank: int) -> str:
    """Build a plan with one fault injected on ``bad_rank``; return the error text
    (after a barrier that proves every rank left the collective together)."""
    from nvdd.core import NvddError

    case = make_case(name)
    r = rank()
    rows = owned_slice(case, r)
    pos = case.positions[rows].clone()
    ids, sysi, cell = case.atom_ids[rows], case.system_index[rows], case.cell.clone()
    kw: dict[str, Any] = {}
    if r == bad_rank:
        if fault == "nan":
            pos[1, 2] = float("nan")
        elif fault == "singular":
            cell[0, 2] = cell[0, 0] + cell[0, 1]
        elif fault == "shape":
            pos = pos[:, :2]
        elif fault == "system":
            sysi = sysi.clone()
            sysi[0] = 5
    if fault == "capacity":
        kw["max_ghost_rows"] = 3
    if fault == "huge":
        case = Case(**{**case.__dict__, "ghost_width": 1e6})
    return error_text(
        lambda: build_halo_plan(config_of(case, **kw), pos, ids, sysi, cell), NvddError, typed=True
    )


def bad_exchange_rank(bad_rank: int) -> str:
    """A malformed exchange input on one rank, with sync_checks on."""
    from nvdd.core import NvddError

    case = make_case("slab2_cubic")
    r = rank()
    rows = owned_slice(case, r)
    pos = case.positions[rows]
    plan = build_halo_plan(
        config_of(case),
        pos,
        case.atom_ids[rows],
        case.system_index[rows],
        case.cell,
        sync_checks=True,
    )
    x = pos[:-1] if r == bad_rank else pos
    return error_text(lambda: plan.forward(x), NvddError, typed=True)


def device_rank(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plan and its exchanges on the CPU and on the fake accelerator."""
    from nvdd.halo import reshard_by_destination
    from nvdd.testing import fake_accelerator

    case = make_case(name)
    r = rank()

    def run(dev: torch.device) -> dict[str, Any]:
        rows = owned_slice(case, r)
        pos = case.positions[rows].to(dev)
        plan = build_halo_plan(
            config_of(case),
            pos,
            case.atom_ids[rows].to(dev),
            case.system_index[rows].to(dev),
            case.cell.to(dev),
        )
        ghost = plan.ghost_positions(pos, case.cell.to(dev))
        values = torch.arange(plan.n_ghost * 2, dtype=torch.float64, device=dev).reshape(-1, 2)
        folded = plan.reverse(values)
        pos.requires_grad_(True)
        plan.ghost_positions(pos, case.cell.to(dev)).sum().backward()
        assert pos.grad is not None
        dest = torch.arange(pos.shape[0], device=dev) % plan.world_size
        moved = reshard_by_destination({"x": pos.detach(), "id": case.atom_ids[rows].to(dev)}, dest)
        devices = {
            t.device.type for t in (ghost, folded, pos.grad, moved["x"], plan.ghost_atom_ids)
        }
        return {
            "ghost_ids": plan.ghost_atom_ids.cpu(),
            "ghost": ghost.detach().cpu(),
            "folded": folded.cpu(),
            "grad": pos.grad.cpu(),
            "moved": moved["id"].cpu(),
            "devices": sorted(devices),
        }

    cpu = run(torch.device("cpu"))
    with fake_accelerator() as dev:
        fake = run(dev)
    return cpu, fake
