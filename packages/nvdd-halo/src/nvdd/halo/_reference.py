"""Pure-torch versions of the plan kernels, with the same semantics.

They are the oracle of the kernel tests, a selectable backend of plan building
(``backend="torch"``), and the baseline of the benchmark.
"""

from __future__ import annotations

import torch

from nvdd.halo._kernels import _COUNT_LIMIT, MAX_IMAGE_SPAN, META_WIDTH

__all__ = ["compute_fractional_torch", "count_images_torch", "fill_images_torch"]


def compute_fractional_torch(
    positions: torch.Tensor, system: torch.Tensor, inv_cell: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`nvdd.halo._kernels.compute_fractional`."""
    n_sys = int(inv_cell.shape[0])
    outside = (system < 0) | (system >= n_sys)
    if n_sys == 1:
        frac = positions @ inv_cell[0]
    else:
        safe = system.clamp(0, n_sys - 1)
        frac = torch.bmm(positions.unsqueeze(1), inv_cell[safe]).squeeze(1)
    frac = torch.where(outside[:, None], positions * 0, frac)
    bad = torch.maximum(
        (~torch.isfinite(positions)).any().to(torch.int32), 2 * outside.any().to(torch.int32)
    ).reshape(1)
    return frac, bad


def _ranges(
    frac: torch.Tensor,
    system: torch.Tensor,
    cand_rank: torch.Tensor,
    elo: torch.Tensor,
    ehi: torch.Tensor,
    periodic: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """first, last int64 shape (n_atoms, n_cand, 3) and an overflow flag."""
    ranks = cand_rank.long()
    lo = elo[system][:, ranks]  # (n, U, 3)
    hi = ehi[system][:, ranks]
    f = frac[:, None, :]
    per = periodic[system][:, None, :].bool()
    pfirst = torch.ceil(lo - f)
    plast = torch.ceil(hi - f) - 1
    limit = float(1 << 30)
    bad = per & (
        (pfirst.abs() > limit) | (plast.abs() > limit) | (plast - pfirst >= MAX_IMAGE_SPAN)
    )
    inside = (lo <= f) & (f < hi)
    zero = torch.zeros((), dtype=torch.int64, device=frac.device)
    first = torch.where(per & ~bad, pfirst.clamp(-limit, limit).long(), zero)
    last = torch.where(
        per & ~bad,
        plast.clamp(-limit, limit).long(),
        torch.where(bad, zero - 2, torch.where(inside, zero, zero - 1)),
    )
    return first, last, bad.any().to(torch.int32).reshape(1)


def count_images_torch(
    frac: torch.Tensor,
    system: torch.Tensor,
    cand_rank: torch.Tensor,
    cand_ok: torch.Tensor,
    elo: torch.Tensor,
    ehi: torch.Tensor,
    periodic: torch.Tensor,
    my_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`nvdd.halo._kernels.count_images`."""
    first, last, overflow = _ranges(frac, system, cand_rank, elo, ehi, periodic)
    span = (last - first + 1).clamp(min=0)
    total = span.prod(dim=-1)
    has_zero = ((first <= 0) & (last >= 0)).all(dim=-1)
    own = (cand_rank.long() == my_rank)[None, :]
    total = total - (own & has_zero & (total > 0)).long()
    too_big = total > _COUNT_LIMIT
    overflow = torch.maximum(overflow, too_big.any().to(torch.int32).reshape(1))
    total = torch.where(too_big, 0, total) * cand_ok[system].long()
    return total.T.contiguous().to(torch.int32), overflow


def fill_images_torch(
    frac: torch.Tensor,
    system: torch.Tensor,
    atom_ids: torch.Tensor,
    cand_rank: torch.Tensor,
    cand_ok: torch.Tensor,
    elo: torch.Tensor,
    ehi: torch.Tensor,
    periodic: torch.Tensor,
    my_rank: int,
    offsets: torch.Tensor,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`nvdd.halo._kernels.fill_images` (``offsets`` is not needed: the
    rows come out in the same order by construction; only its shape is checked)."""
    n, n_cand = int(frac.shape[0]), int(cand_rank.shape[0])
    if tuple(offsets.shape) != (n_cand, n):
        raise ValueError(f"offsets has shape {tuple(offsets.shape)}, expected {(n_cand, n)}")
    first, last, _ = _ranges(frac, system, cand_rank, elo, ehi, periodic)
    span = (last - first + 1).clamp(min=0)
    full = span.prod(dim=-1) * cand_ok[system].long()  # (n, U), self image included
    # Entry order (candidate, atom): transpose to candidate-major.
    full_t = full.T.reshape(-1)
    first_t = first.transpose(0, 1).reshape(-1, 3)
    span_t = span.transpose(0, 1).reshape(-1, 3)
    entry = torch.repeat_interleave(torch.arange(full_t.numel(), device=frac.device), full_t)
    start = torch.cumsum(full_t, 0) - full_t
    k = torch.arange(entry.numel(), device=frac.device) - start[entry]
    sp = span_t[entry]
    n2 = k % sp[:, 2]
    n1 = (k // sp[:, 2]) % sp[:, 1]
    n0 = k // (sp[:, 2] * sp[:, 1])
    image = first_t[entry] + torch.stack([n0, n1, n2], dim=1)
    u, i = entry // n, entry % n
    keep = ~((cand_rank.long()[u] == my_rank) & (image == 0).all(dim=1))
    i, image = i[keep], image[keep]
    meta = torch.stack([i, image[:, 0], image[:, 1], image[:, 2], atom_ids[i], system[i]], dim=1)
    overflow = torch.tensor([int(meta.shape[0] > capacity)], dtype=torch.int32)
    out = torch.zeros(capacity, META_WIDTH, dtype=torch.int64, device=frac.device)
    m = min(capacity, int(meta.shape[0]))
    out[:m] = meta[:m]
    return out, overflow.to(frac.device)
