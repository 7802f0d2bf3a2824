"""Small systems and toy models shared by the nvdd-padding tests (not a test module)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

CUTOFF = 2.5


def random_positions(
    n: int, seed: int, box: float = 6.0, dtype: torch.dtype = torch.float64, device: str = "cpu"
) -> torch.Tensor:
    """``n`` random positions in a cube of side ``box``, shape ``(n, 3)``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, generator=g, dtype=torch.float64) * box).to(dtype).to(device)


def coo_edges(positions: torch.Tensor, cutoff: float = CUTOFF) -> torch.Tensor:
    """Every ordered pair ``i != j`` closer than ``cutoff``: shape ``(2, n_edges)``."""
    x = positions.detach().double()
    d = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist")
    d.fill_diagonal_(float("inf"))
    src, dst = torch.nonzero(d < cutoff, as_tuple=True)
    return torch.stack([src, dst])


def dense_neighbors(
    positions: torch.Tensor,
    cutoff: float = CUTOFF,
    system_index: torch.Tensor | None = None,
    max_neighbors: int | None = None,
    fill_value: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-packed ``(n, K)`` neighbour matrix and counts (nvalchemiops layout).

    Neighbours are atoms of the same system closer than ``cutoff``; unused slots
    hold ``fill_value`` (default ``n``).
    """
    n = positions.shape[0]
    x = positions.detach().double()
    d = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist")
    d.fill_diagonal_(float("inf"))
    near = d < cutoff
    if system_index is not None:
        near &= system_index[:, None] == system_index[None, :]
    counts = near.sum(1)
    k = int(counts.max()) if n else 0
    k = max(k, max_neighbors or 0)
    fill = n if fill_value is None else fill_value
    nbr = torch.full((n, k), fill, dtype=torch.int64, device=positions.device)
    for i in range(n):
        js = torch.nonzero(near[i]).flatten()
        nbr[i, : js.numel()] = js
    return nbr, counts.to(torch.int64)


def pair_energy(r: torch.Tensor) -> torch.Tensor:
    """A pair term singular at r = 0 (so a zero-length padded pair would be inf)."""
    return (CUTOFF - r) ** 2 / r


def coo_model(
    positions: torch.Tensor,
    edge_index: torch.Tensor,
    shifts: torch.Tensor,
    edge_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-atom energies: half of every edge's ``f(r)`` scattered to its destination.

    Without ``edge_mask`` every edge counts (no masking at all).
    """
    src, dst = edge_index[0], edge_index[1]
    vec = positions[dst] - positions[src] + shifts
    r = torch.linalg.vector_norm(vec, dim=-1)
    keep = r < CUTOFF
    if edge_mask is not None:
        keep = keep & edge_mask
    e = torch.where(keep, 0.5 * pair_energy(r), 0.0)
    return torch.zeros(
        positions.shape[0], dtype=positions.dtype, device=positions.device
    ).index_add(0, dst, e)


def dense_model(
    positions: torch.Tensor,
    neighbors: torch.Tensor,
    shifts: torch.Tensor,
    neighbor_mask: torch.Tensor,
) -> torch.Tensor:
    """Per-atom energies from a dense neighbour matrix: half the row sum of ``f(r)``.

    The mask guards the singular pair term before it is evaluated (double
    ``where``), so no padding pair, not even a zero-length one, makes inf or nan.
    """
    vec = positions[neighbors] - positions[:, None, :] + shifts
    r2 = (vec * vec).sum(-1)
    keep = neighbor_mask & (r2 < CUTOFF**2)
    r = torch.sqrt(torch.where(keep, r2, 1.0))
    return torch.where(keep, 0.5 * pair_energy(r), 0.0).sum(1)


def total_energy(
    atom_energies: torch.Tensor, atom_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum of per-atom energies over real atoms."""
    if atom_mask is None:
        return atom_energies.sum()
    return torch.where(atom_mask, atom_energies, 0.0).sum()


def raised_message(call: Callable[[], object], exc_type: type[Exception]) -> str:
    """Run a collective ``call`` on this rank (inside ``run_ranks``).

    Returns the message of the ``exc_type`` it raised, after a barrier (so no rank
    is left hanging in a collective), or ``"no error"``.
    """
    try:
        call()
    except exc_type as exc:
        dist.barrier()
        return str(exc)
    return "no error"
