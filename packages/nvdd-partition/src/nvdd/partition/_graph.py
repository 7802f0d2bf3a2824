"""Which atoms a rank's edges read: the ghost rows of the graph-partition strategy.

Under graph partition a rank owns a block of nodes and every edge *into* them;
the senders of those edges that it does not own are its ghost rows. Rather than
running a model's neighbour search on the whole system, the rows are chosen by
distance: every atom within ``radius`` (``cutoff + skin``) of an owned atom, in
any periodic image. A model's own neighbour list on ``[owned | ghost]`` rows
(with the real cell and pbc) then finds every edge into an owned node, for as
long as no atom moved more than ``skin / 2``.

Method (pure torch, no host loop over atoms): a cell list in the fractional
coordinates of the system's domain cell, bins at least ``radius`` wide along
every lattice-plane normal; the bins holding owned atoms are dilated by one bin
(wrapping on periodic axes), which gives candidates; each candidate is then
tested against the owned atoms of its (up to 27) neighbouring bins with the
exact distance, so the result is exactly the atoms within ``radius``. Along a
periodic axis at least three bins wide the nearest image is the only one that
can be within ``radius``; along a thinner one (a cell thinner than
``3 radius``) every image within reach is tried.
"""

from __future__ import annotations

import torch

from nvdd.core import ValidationError
from nvdd.partition._geometry import build_domain_cell, interplanar_spacings

__all__ = ["graph_ghosts"]

#: Bins per system at most this many per atom (coarser bins are still correct).
_MAX_BINS_PER_ATOM = 4
#: Candidate-owned pairs tested at once (bounds the temporary memory).
_PAIR_CHUNK = 1 << 22
#: Relative margin on ``radius**2``: pairs at the radius up to rounding are kept.
_MARGIN = 1e-12


def _bins(
    frac: torch.Tensor, periodic: torch.Tensor, spacing: torch.Tensor, radius: float
) -> tuple[torch.Tensor, list[int]]:
    """Bin coordinates ``(n, 3)`` int64 and bins per axis (each >= ``radius`` wide)."""
    dev = frac.device
    zero = torch.zeros(3, dtype=frac.dtype, device=dev)
    lo = torch.where(periodic, zero, frac.min(dim=0).values)
    hi = torch.where(periodic, zero + 1.0, frac.max(dim=0).values)
    width = (hi - lo).clamp_min(1e-300)
    extent = (width.cpu() * spacing).tolist()  # one host read of three numbers
    counts = [max(1, int(e // radius)) for e in extent]
    n_atoms = int(frac.shape[0])
    while counts[0] * counts[1] * counts[2] > max(64, _MAX_BINS_PER_ATOM * n_atoms):
        a = max(range(3), key=lambda k: counts[k])
        counts[a] = max(1, counts[a] // 2)
    n = torch.tensor(counts, dtype=torch.int64, device=dev)
    coord = torch.floor((frac - lo) / width * n.to(frac.dtype)).to(torch.int64)
    return torch.minimum(coord.clamp_min(0), n - 1), counts


def _neighbour_bins(
    coord: torch.Tensor, counts: list[int], periodic: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear ids ``(n, k)`` of the distinct bins around each coordinate and their validity.

    ``periodic``: bool ``(3,)`` on the CPU (read on the host).

    Along a periodic axis with fewer than three bins the offsets ``-1`` and
    ``+1`` name the same bins as ``0`` and each other, so they are not repeated.
    """
    dev = coord.device
    axes = []
    for a in range(3):
        if bool(periodic[a]) and counts[a] < 3:
            axes.append(torch.arange(counts[a], device=dev))  # (0,) or (0, 1): each bin once
        else:
            axes.append(torch.arange(-1, 2, device=dev))
    offsets = torch.cartesian_prod(*axes).reshape(-1, 3)
    nb = coord[:, None, :] + offsets[None, :, :]
    n = torch.tensor(counts, dtype=torch.int64, device=dev)
    per = periodic.to(dev)
    valid = torch.where(per, torch.ones_like(nb, dtype=torch.bool), (nb >= 0) & (nb < n))
    nb = torch.where(per, torch.remainder(nb, n), torch.minimum(nb.clamp_min(0), n - 1))
    linear = (nb[..., 0] * counts[1] + nb[..., 1]) * counts[2] + nb[..., 2]
    return linear, valid.all(dim=2)


def _images(
    periodic: torch.Tensor, counts: list[int], spacing: torch.Tensor, radius: float
) -> torch.Tensor:
    """Fractional image shifts ``(n_images, 3)`` to try besides the nearest one.

    Zero except along periodic axes with fewer than three bins (cells thinner
    than ``3 radius``), where several images of an atom can lie within ``radius``.
    """
    ranges = []
    for a in range(3):
        if bool(periodic[a]) and counts[a] < 3:
            m = int(radius // float(spacing[a])) + 1
            ranges.append(torch.arange(-m, m + 1, dtype=torch.float64))
        else:
            ranges.append(torch.zeros(1, dtype=torch.float64))
    return torch.cartesian_prod(*ranges).reshape(-1, 3)


def _exact(
    frac: torch.Tensor,
    dom: torch.Tensor,
    periodic: torch.Tensor,
    linear: torch.Tensor,
    owned: torch.Tensor,
    cand: torch.Tensor,
    nb: torch.Tensor,
    nb_valid: torch.Tensor,
    n_bins: int,
    images: torch.Tensor,
    radius: float,
) -> torch.Tensor:
    """Which candidates lie within ``radius`` of an owned atom (bool, per candidate).

    ``d - round(d)`` is the nearest image along each periodic axis at least three
    bins (``3 radius``) wide; along thinner ones every shift in ``images`` is tried.
    """
    dev = frac.device
    own_rows = owned.nonzero().flatten()
    order = torch.argsort(linear[own_rows], stable=True)
    sorted_rows = own_rows[order]
    per_bin = torch.bincount(linear[own_rows], minlength=n_bins)
    start = torch.zeros(n_bins + 1, dtype=torch.int64, device=dev)
    start[1:] = torch.cumsum(per_bin, 0)
    length = torch.where(nb_valid, per_bin[nb], 0)
    r2 = radius * radius * (1.0 + _MARGIN)
    hit = torch.zeros(int(cand.numel()), dtype=torch.bool, device=dev)
    chunk = torch.tensor(_PAIR_CHUNK, device=dev)
    per_cand = length.sum(dim=1) * int(images.shape[0])
    k = int(nb.shape[1])
    first = 0
    while first < int(cand.numel()):
        # as many candidates as fit in one chunk of pairs (at least one)
        csum = torch.cumsum(per_cand[first:], 0)
        last = first + max(1, int(torch.searchsorted(csum, chunk, right=True)))
        seg_len = length[first:last].reshape(-1)
        seg_start = start[nb[first:last].reshape(-1)]
        seg = torch.repeat_interleave(torch.arange(int(seg_len.numel()), device=dev), seg_len)
        offset = torch.cumsum(seg_len, 0) - seg_len
        within = torch.arange(int(seg.numel()), device=dev) - offset[seg]
        other = sorted_rows[seg_start[seg] + within]
        local = torch.div(seg, k, rounding_mode="floor")
        d = frac[cand[first + local]] - frac[other]
        d = torch.where(periodic, d - torch.round(d), d)
        cart = (d[:, None, :] + images[None, :, :]) @ dom
        close = ((cart * cart).sum(dim=2) <= r2).any(dim=1)
        hits = torch.zeros(last - first, dtype=torch.long, device=dev)
        hit[first:last] |= hits.index_add_(0, local, close.to(torch.long)) > 0
        first = last
    return hit


def graph_ghosts(
    positions: torch.Tensor,
    system_index: torch.Tensor,
    cell: torch.Tensor,
    pbc: torch.Tensor,
    owned: torch.Tensor,
    radius: float,
) -> torch.Tensor:
    """Indices of the atoms within ``radius`` of an owned atom that are not owned.

    No communication: ``positions`` hold every atom (the replicated array of a
    rebuild). Distances are taken over every periodic image of the atom's
    system; atoms of other systems never qualify.

    Parameters
    ----------
    positions:
        Shape ``(n_atoms, 3)``, any float dtype (the search runs in float64 on
        the positions' device; the cell geometry is CPU metadata).
    system_index:
        int64, shape ``(n_atoms,)``.
    cell:
        Shape ``(n_systems, 3, 3)``, rows are lattice vectors (zero vectors allowed
        on open axes).
    pbc:
        bool, shape ``(n_systems, 3)``.
    owned:
        bool, shape ``(n_atoms,)``: this rank's atoms.
    radius:
        Distance (Angstrom), > 0: the model's cutoff plus the Verlet skin.

    Returns
    -------
    torch.Tensor
        int64, sorted, on the positions' device: every non-owned atom within ``radius`` of some
        owned atom (distances up to ``radius`` times ``1 + 5e-13`` included, so
        rounding never drops a pair at the radius).

    Raises
    ------
    ValidationError
        On mismatched shapes, a non-positive radius or non-finite positions.
    """
    n = int(positions.shape[0]) if positions.ndim == 2 else -1
    if n < 0 or positions.shape[1] != 3 or tuple(system_index.shape) != (n,):
        raise ValidationError(
            f"graph_ghosts needs positions (n, 3) and system_index (n,), got "
            f"{tuple(positions.shape)} and {tuple(system_index.shape)}"
        )
    if tuple(owned.shape) != (n,) or owned.dtype != torch.bool:
        raise ValidationError(
            f"owned must be bool of shape ({n},), got {owned.dtype} {tuple(owned.shape)}"
        )
    if not radius > 0.0:
        raise ValidationError(f"radius must be > 0, got {radius!r}")
    pos = positions.detach().to(torch.float64)
    dev = pos.device
    if not bool(torch.isfinite(pos).all()):
        raise ValidationError("graph_ghosts: positions are not finite")
    si, own = system_index.to(dev), owned.to(dev)
    found: list[torch.Tensor] = []
    for s in torch.unique(si[own]).tolist():
        rows = (si == s).nonzero().flatten()
        mine = own[rows]
        if bool(mine.all()):
            continue
        periodic_cpu = pbc[s].cpu().to(torch.bool)
        dom_cpu, _ = build_domain_cell(cell[s], periodic_cpu, pos[rows])  # CPU metadata
        spacing = interplanar_spacings(dom_cpu[None])[0]
        dom, periodic = dom_cpu.to(dev), periodic_cpu.to(dev)
        frac = pos[rows] @ torch.linalg.inv(dom_cpu).to(dev)
        frac = torch.where(periodic, frac - torch.floor(frac), frac)
        coord, counts = _bins(frac, periodic, spacing, radius)
        linear = (coord[:, 0] * counts[1] + coord[:, 1]) * counts[2] + coord[:, 2]
        n_bins = counts[0] * counts[1] * counts[2]
        near = torch.zeros(n_bins, dtype=torch.bool, device=dev)
        nb_own, ok_own = _neighbour_bins(coord[mine], counts, periodic_cpu)
        near[nb_own[ok_own]] = True
        cand = (~mine & near[linear]).nonzero().flatten()
        if cand.numel() == 0:
            continue
        nb, ok = _neighbour_bins(coord[cand], counts, periodic_cpu)
        images = _images(periodic_cpu, counts, spacing, radius).to(dev)
        hit = _exact(frac, dom, periodic, linear, mine, cand, nb, ok, n_bins, images, radius)
        found.append(rows[cand[hit]])
    if not found:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    return torch.sort(torch.cat(found)).values
