"""The correctness oracle: N ranks against one, compared by global atom id."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nvdd.core import all_gather_object

__all__ = [
    "TOLERANCES",
    "Tolerance",
    "assert_close_by_id",
    "assert_same_ids",
    "gather_by_id",
    "tolerance_for",
]


@dataclass(frozen=True)
class Tolerance:
    """Absolute and relative tolerance for one floating dtype."""

    atol: float
    rtol: float


#: The project's equivalence tolerances (forces: float64 1e-10, float32 1e-5).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    """The tolerance of ``dtype``; raises ``KeyError`` for other dtypes."""
    return TOLERANCES[dtype]


def gather_by_id(
    ids: torch.Tensor, *values: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, ...]:
    """Gather rows from every rank and sort them by id; same result on every rank.

    **Collective** over ``group`` (all-gather of objects; for tests only).

    Returns ``(ids_sorted, *values_sorted)`` on CPU. Duplicated ids are kept, so
    a caller can detect them.
    """
    local = [ids.detach().cpu(), *(v.detach().cpu() for v in values)]
    if dist.is_initialized():
        parts: list[list[torch.Tensor] | None] = all_gather_object(local, group)
        cols = [torch.cat([p[i] for p in parts if p is not None]) for i in range(len(local))]
    else:
        cols = local
    order = torch.argsort(cols[0], stable=True)
    return tuple(c[order] for c in cols)


def assert_same_ids(ids_a: torch.Tensor, ids_b: torch.Tensor, what: str = "atom ids") -> None:
    """Assert both id tensors hold the same set, each id exactly once."""
    a, b = torch.sort(ids_a.cpu()).values, torch.sort(ids_b.cpu()).values
    for name, s in (("first", a), ("second", b)):
        dup = s[1:] == s[:-1]
        assert not bool(dup.any()), f"{what}: {name} has duplicate ids {s[1:][dup][:10].tolist()}"
    if not torch.equal(a, b):
        only_a = sorted(set(a.tolist()) - set(b.tolist()))[:10]
        only_b = sorted(set(b.tolist()) - set(a.tolist()))[:10]
        raise AssertionError(f"{what} differ: only in first {only_a}, only in second {only_b}")


def assert_close_by_id(
    ids_a: torch.Tensor,
    a: torch.Tensor,
    ids_b: torch.Tensor,
    b: torch.Tensor,
    *,
    atol: float,
    rtol: float = 0.0,
    what: str = "values",
) -> None:
    """Assert ``a`` and ``b`` agree row by row after matching rows by id.

    The id sets must be equal (each id once). The message names the worst id.
    """
    assert_same_ids(ids_a, ids_b, what=f"{what} ids")
    ra, rb = (
        a.detach().cpu()[torch.argsort(ids_a.cpu())],
        b.detach().cpu()[torch.argsort(ids_b.cpu())],
    )
    assert ra.shape == rb.shape, f"{what}: shapes {tuple(ra.shape)} vs {tuple(rb.shape)}"
    diff = (ra.double() - rb.double()).abs()
    bound = atol + rtol * rb.double().abs()
    bad = diff > bound
    if bool(bad.any()):
        flat = (diff - bound).reshape(diff.shape[0], -1).max(dim=1).values
        worst = int(torch.argmax(flat))
        wid = int(torch.sort(ids_a.cpu()).values[worst])
        raise AssertionError(
            f"{what} differ at {int(bad.reshape(diff.shape[0], -1).any(dim=1).sum())} ids; "
            f"worst id {wid}: {ra[worst].tolist()} vs {rb[worst].tolist()} "
            f"(max abs diff {float(diff.max()):.3e}, atol {atol}, rtol {rtol})"
        )
