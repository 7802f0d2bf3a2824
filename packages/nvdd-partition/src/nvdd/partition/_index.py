"""`IndexPartitioner`: balanced contiguous index blocks (graph-partition strategy)."""

from __future__ import annotations

from typing import overload

import torch

from nvdd.core import ConfigurationError, ValidationError

__all__ = ["IndexPartitioner"]


class IndexPartitioner:
    """``n_items`` indices split into ``world_size`` contiguous, balanced blocks.

    The one rule, used by every method: the first ``n_items % world_size`` ranks
    get one item more than the others (the split of ``torch.tensor_split`` and
    ``numpy.array_split``). Block ``r`` is ``[start_r, stop_r)`` with
    ``start_r = r * q + min(r, m)``, ``q, m = divmod(n_items, world_size)``.

    Parameters
    ----------
    n_items:
        Number of items (atoms), >= 0.
    world_size:
        Number of ranks, >= 1.

    Raises
    ------
    ConfigurationError
        On a negative ``n_items`` or a ``world_size`` below 1.
    """

    __slots__ = ("_m", "_n", "_q", "_world")

    def __init__(self, n_items: int, world_size: int) -> None:
        for name, value, least in (("n_items", n_items, 0), ("world_size", world_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigurationError(f"{name} must be an int >= {least}, got {value!r}")
        self._n = n_items
        self._world = world_size
        self._q, self._m = divmod(n_items, world_size)

    @property
    def n_items(self) -> int:
        """Number of items split."""
        return self._n

    @property
    def world_size(self) -> int:
        """Number of blocks."""
        return self._world

    def _rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self._world:
            raise ValidationError(f"rank {rank!r} is outside [0, {self._world})")
        return rank

    def bounds(self, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of ``rank``'s block (``stop`` excluded)."""
        r = self._rank(rank)
        start = r * self._q + min(r, self._m)
        return start, start + self._q + (1 if r < self._m else 0)

    def counts(self) -> tuple[int, ...]:
        """Block sizes of every rank (they differ by at most one)."""
        return tuple(self._q + (1 if r < self._m else 0) for r in range(self._world))

    def offsets(self) -> tuple[int, ...]:
        """Block starts of every rank, then ``n_items``: length ``world_size + 1``."""
        return (*(self.bounds(r)[0] for r in range(self._world)), self._n)

    def local_slice(self, rank: int) -> slice:
        """``slice(start, stop)`` of ``rank``'s block."""
        return slice(*self.bounds(rank))

    @overload
    def owner_of(self, index: int) -> int: ...

    @overload
    def owner_of(self, index: torch.Tensor) -> torch.Tensor: ...

    def owner_of(self, index: int | torch.Tensor) -> int | torch.Tensor:
        """The rank whose block holds ``index`` (an int, or an integer tensor of any
        shape, answered element-wise as int64 on its device).

        Raises
        ------
        ValidationError
            If an index is outside ``[0, n_items)``.
        """
        q, m = self._q, self._m
        edge = m * (q + 1)  # first index of the short blocks
        if isinstance(index, torch.Tensor):
            if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
                raise ValidationError(f"index must be an integer tensor, got {index.dtype}")
            idx = index.to(torch.int64)
            if idx.numel() and bool(((idx < 0) | (idx >= self._n)).any()):
                bad = int(idx[(idx < 0) | (idx >= self._n)][0])
                raise ValidationError(f"index {bad} is outside [0, {self._n})")
            long_block = torch.div(idx, q + 1, rounding_mode="floor")
            short_block = m + torch.div(idx - edge, max(q, 1), rounding_mode="floor")
            return torch.where(idx < edge, long_block, short_block)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self._n:
            raise ValidationError(f"index {index!r} is outside [0, {self._n})")
        return index // (q + 1) if index < edge else m + (index - edge) // q

    def __repr__(self) -> str:
        return f"IndexPartitioner(n_items={self._n}, world_size={self._world})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IndexPartitioner):
            return NotImplemented
        return (self._n, self._world) == (other._n, other._world)

    def __hash__(self) -> int:
        return hash((IndexPartitioner, self._n, self._world))
