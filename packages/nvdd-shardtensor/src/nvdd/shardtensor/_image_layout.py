"""A single-process halo layout whose ghosts are images of this rank's own atoms."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nvdd.core import ValidationError, get_rank

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["SelfImageLayout"]


class SelfImageLayout:
    """A :class:`~nvdd.shardtensor.HaloLayout` with no remote ranks.

    Every ghost row is a copy of one of this rank's own owned rows, as the
    periodic images of a small periodic system are on a single rank. Both
    exchanges are plain differentiable torch ops (no communication, no host
    synchronisation, traceable by ``torch.compile``), so it serves as the
    single-process layout and as the in-process fake in tests of code built on
    ShardTensor.

    Parameters
    ----------
    n_owned:
        Number of owned rows.
    ghost_source:
        ``shape (n_ghost,)``, integer: the owned row each ghost row copies.
        Checked once here (this synchronises with the host).
    group:
        Reported as :attr:`group`. ``None`` (the default) means "the default
        group" to collectives; inside a multi-rank job pass a group holding
        only this rank so per-system reductions stay local.

    Raises
    ------
    ValidationError
        If ``ghost_source`` is not a 1-D integer tensor with values in
        ``[0, n_owned)``, or ``n_owned`` is negative.
    """

    def __init__(
        self, n_owned: int, ghost_source: torch.Tensor, group: ProcessGroup | None = None
    ) -> None:
        rank = get_rank()
        if not isinstance(n_owned, int) or n_owned < 0:
            raise ValidationError(f"rank {rank}: n_owned must be an int >= 0, got {n_owned!r}")
        if (
            not isinstance(ghost_source, torch.Tensor)
            or ghost_source.ndim != 1
            or ghost_source.dtype.is_floating_point
            or ghost_source.dtype.is_complex
            or ghost_source.dtype == torch.bool
        ):
            what = (
                f"shape {tuple(ghost_source.shape)} dtype {ghost_source.dtype}"
                if isinstance(ghost_source, torch.Tensor)
                else type(ghost_source).__name__
            )
            raise ValidationError(
                f"rank {rank}: ghost_source must be a 1-D integer tensor, got {what}"
            )
        if ghost_source.numel() > 0:
            lo, hi = int(ghost_source.min()), int(ghost_source.max())
            if lo < 0 or hi >= n_owned:
                raise ValidationError(
                    f"rank {rank}: ghost_source values must lie in [0, {n_owned}), got "
                    f"[{lo}, {hi}] (shape {tuple(ghost_source.shape)})"
                )
        self._n_owned = n_owned
        self._source = ghost_source.to(torch.int64)
        self._n_padded = n_owned + int(ghost_source.shape[0])
        self._group = group

    @property
    def n_owned(self) -> int:
        """Number of owned rows."""
        return self._n_owned

    @property
    def n_padded(self) -> int:
        """Owned plus ghost rows."""
        return self._n_padded

    @property
    def group(self) -> ProcessGroup | None:
        """The group given at construction."""
        return self._group

    @property
    def ghost_source(self) -> torch.Tensor:
        """``shape (n_ghost,)``: the owned row each ghost row copies."""
        return self._source

    def _check(self, x: torch.Tensor, verb: str) -> None:
        if x.ndim == 0 or x.shape[0] != self.n_padded:
            raise ValidationError(
                f"rank {get_rank()}: SelfImageLayout.{verb} needs shape (n_padded="
                f"{self.n_padded}, ...), got shape {tuple(x.shape)}"
            )

    def refresh(self, x: torch.Tensor) -> torch.Tensor:
        """Ghost rows set to copies of their source rows; owned rows unchanged.

        Parameters
        ----------
        x:
            ``shape (n_padded, ...)``.

        Returns
        -------
        torch.Tensor
            ``shape (n_padded, ...)``, a new tensor (differentiable: the
            backward sums ghost gradients into their source rows).
        """
        self._check(x, "refresh")
        owned = x[: self._n_owned]
        return torch.cat([owned, owned.index_select(0, self._source.to(x.device))], dim=0)

    def fold(self, x: torch.Tensor) -> torch.Tensor:
        """Ghost rows summed into their source rows, then refreshed.

        Parameters
        ----------
        x:
            ``shape (n_padded, ...)``.

        Returns
        -------
        torch.Tensor
            ``shape (n_padded, ...)``, a new tensor (differentiable).
        """
        self._check(x, "fold")
        src = self._source.to(x.device)
        owned = x[: self._n_owned].index_add(0, src, x[self._n_owned :])
        return torch.cat([owned, owned.index_select(0, src)], dim=0)

    def __repr__(self) -> str:
        return (
            f"SelfImageLayout(n_owned={self._n_owned}, n_padded={self.n_padded}, "
            f"group={self._group!r})"
        )
