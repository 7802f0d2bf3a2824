"""Degenerate partitions: empty ranks, and halos that already hold every atom."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from nvdd.core import ValidationError

__all__ = [
    "DegeneratePartitionWarning",
    "coverage_reasons",
    "empty_rank_reasons",
    "enforce",
]


class DegeneratePartitionWarning(UserWarning):
    """The partition is valid but wasteful: a rank owns no atom, or every rank's
    halo covers a whole system (every rank holds every atom of it)."""


def coverage_reasons(
    boxes: torch.Tensor,
    pbc: torch.Tensor,
    ghost_frac: torch.Tensor,
    extent: torch.Tensor,
    ghost_width: float,
) -> list[str]:
    """Systems whose every box, grown by the ghost width, covers the whole system.

    Parameters
    ----------
    boxes:
        float64, shape ``(n_systems, world_size, 2, 3)``.
    pbc:
        bool, shape ``(n_systems, 3)``.
    ghost_frac:
        float64, shape ``(n_systems, 3)``: the ghost width in fractional units.
    extent:
        float64, shape ``(n_systems, 2, 3)``: the atoms' fractional range per axis
        (NaN where unknown; then a cut open axis never counts as covered).

    Returns
    -------
    list of str
        One reason per covered system; empty with one rank (nothing to share).
    """
    n_systems, world = int(boxes.shape[0]), int(boxes.shape[1])
    if world == 1:
        return []
    out: list[str] = []
    for s in range(n_systems):
        lo, hi = boxes[s, :, 0], boxes[s, :, 1]
        w = ghost_frac[s].view(1, 3)
        periodic_ok = (hi - lo) + 2.0 * w >= 1.0
        open_ok = ((lo - w <= extent[s, 0].view(1, 3)) | torch.isneginf(lo)) & (
            (hi + w >= extent[s, 1].view(1, 3)) | torch.isposinf(hi)
        )
        covered = torch.where(pbc[s].view(1, 3), periodic_ok, open_ok)
        if bool(covered.all()):
            out.append(
                f"system {s}: with ghost_width {ghost_width} every one of the {world} boxes' "
                "halos covers the whole system, so every rank holds every atom (use fewer "
                "ranks or a larger system)"
            )
    return out


def empty_rank_reasons(owned_counts: Sequence[int]) -> list[str]:
    """One reason naming the ranks that own no atom (if any)."""
    empty = [r for r, c in enumerate(owned_counts) if int(c) == 0]
    if not empty or len(owned_counts) == 1:
        return []
    return [
        f"rank(s) {empty} of {len(owned_counts)} own no atom (owned counts "
        f"{[int(c) for c in owned_counts]})"
    ]


def enforce(reasons: Sequence[str], require_nondegenerate: bool) -> None:
    """Warn (``DegeneratePartitionWarning``) or raise ``ValidationError``.

    The caller passes reasons computed from data identical on every rank (the
    broadcast boxes, all-reduced counts), so every rank reaches the same verdict
    without another collective.
    """
    if not reasons:
        return
    text = "degenerate partition: " + "; ".join(reasons)
    if require_nondegenerate:
        raise ValidationError(text)
    warnings.warn(text, DegeneratePartitionWarning, stacklevel=3)
