"""`DeviceEdges`: a model's edges within the cutoff, kept on the device at fixed
capacities, so that a step of a message-passing model can be captured.

The :class:`~nvdd.models._verlet.VerletList` of the torch models keeps a
candidate list at ``cutoff + skin`` and compacts it to the edges inside the
cutoff on every call: that compaction has a data-dependent size (a host read),
and the reuse test reads a flag too, so no step through it can be captured in
a CUDA graph. Here instead:

1. the candidates are a full :class:`DeviceVerletList` (Warp cell lists, reuse
   decided on the device, a neighbour matrix of fixed capacity per row);
2. every call compacts the candidates inside ``cutoff`` into buffers of a fixed
   **edge capacity** with a prefix sum (receiver-major order: row ``i``'s edges
   are contiguous), and a mask marks the real edges. Padded edges repeat a
   real-looking index pair and are masked to exactly zero by the model;
3. the call writes an overflow word on the device: a row with more candidates
   than the matrix holds, or more edges than the edge capacity. Nothing is ever
   dropped silently: outside a capture the word is read at once (one host read,
   as the Verlet list's own test) and the list or the capacity grows and the
   call is repeated; inside a capture the word is read by whoever owns the step
   (:meth:`verdict`, the verdict of a split step: ``nvdd.dynamics._step.steady_segments``) before the
   step's forces are used, and an overflowing step is recomputed eagerly.

Capacities grow only, with headroom (:func:`edge_capacity`), so a steady run
keeps its shapes (a compiled model compiles once) and its buffers (a captured
step replays on the same addresses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nvdd.core import CaptureError, ValidationError, capturing
from nvdd.models import _edge_kernels as ek
from nvdd.models._device_neighbors import DeviceVerletList, NeighborMatrix
from nvdd.models._neighbors import EdgeList
from nvdd.models._warp import Kernel, declare_overloads

__all__ = ["DeviceEdges", "PaddedEdges", "edge_capacity"]

#: Index of the overflow word's fields: rows whose candidates did not fit the
#: matrix (or whose shift did not fit its code), and the real edge count.
_ROWS, _TOTAL = 0, 1


def edge_capacity(n_edges: int, n_rows: int, headroom: float | None = None) -> int:
    """An edge capacity for ``n_edges`` real edges of ``n_rows`` receivers: 5 %
    headroom for large systems, up to 25 % for small ones (counts fluctuate by
    about ``1 / sqrt(n)``), a multiple of 64, at least 64. A given ``headroom``
    (a factor >= 1) is used as it is, without rounding (tests use 1.0)."""
    if headroom is not None:
        return max(1, math.ceil(headroom * n_edges))
    growth = min(1.25, max(1.05, 1.0 + 4.0 / math.sqrt(max(n_rows, 1))))
    return max(64, 64 * math.ceil(growth * n_edges / 64))


@dataclass(frozen=True)
class PaddedEdges:
    """Directed edges ``(i, j, S)`` at a fixed capacity (the conventions of
    :class:`~nvdd.models._neighbors.EdgeList`), views of :class:`DeviceEdges`'
    buffers valid until its next call.

    Attributes
    ----------
    receivers, senders:
        Int64, shape ``(capacity,)``; receivers ascend over the real edges.
    shifts:
        Int64, shape ``(capacity, 3)``.
    mask:
        Bool, shape ``(capacity,)``: True on the real edges (a prefix).
    periodic:
        Whether shifts may be nonzero.
    """

    receivers: torch.Tensor
    senders: torch.Tensor
    shifts: torch.Tensor
    mask: torch.Tensor
    periodic: bool

    @property
    def n_edges(self) -> int:
        """The capacity (real and padded edges)."""
        return int(self.receivers.shape[0])

    def compact(self) -> EdgeList:
        """The real edges as an :class:`EdgeList` (a host read: for tests)."""
        keep = self.mask.nonzero().squeeze(1)
        return EdgeList(
            self.receivers.index_select(0, keep),
            self.senders.index_select(0, keep),
            self.shifts.index_select(0, keep),
            self.periodic,
        )


class DeviceEdges:
    """Edges within ``cutoff`` from a device Verlet list (see the module notes).

    Parameters
    ----------
    cutoff:
        Interaction cutoff (Angstrom): real edges have ``|r_ij| < cutoff`` (up to
        rounding at the cutoff, where a model's radial envelope is zero anyway).
    skin:
        Verlet skin of the candidate list (``>= 0``).

    Attributes
    ----------
    candidates:
        The full :class:`DeviceVerletList` at ``cutoff + skin``.
    regrows:
        Times the edge capacity grew after its first sizing.
    headroom:
        ``None`` (default): the headroom rule of :func:`edge_capacity`; a
        factor replaces it (1.0: exact capacities, which overflow often: tests).
    """

    def __init__(self, cutoff: float, skin: float = 0.0) -> None:
        self.candidates = DeviceVerletList(cutoff, skin, half=False)
        self._cutoff = float(cutoff)
        self._capacity = 0
        self._key: tuple[object, ...] | None = None
        self._buffers: tuple[torch.Tensor, ...] | None = None
        self._word: torch.Tensor | None = None
        self._provisional = False
        self._kernels = _Kernels()
        self.regrows = 0
        self.headroom: float | None = None

    def __getstate__(self) -> dict[str, float | None]:
        # Device buffers and recorded launches do not travel; a copy sizes afresh.
        return {"cutoff": self._cutoff, "skin": self.candidates.skin, "headroom": self.headroom}

    def __setstate__(self, state: dict[str, float | None]) -> None:
        cutoff, skin = state["cutoff"], state["skin"]
        assert cutoff is not None and skin is not None
        self.__init__(cutoff, skin)  # type: ignore[misc]
        self.headroom = state.get("headroom")

    @property
    def capacity(self) -> int:
        """The edge capacity (0 before the first call)."""
        return self._capacity

    @property
    def graph_token(self) -> tuple[object, ...]:
        """Changes whenever the buffers a captured call used may have moved."""
        return (self.candidates.graph_token, self._capacity, id(self._buffers))

    def reset(self) -> None:
        """Forget the list and the buffers (the next call sizes them again)."""
        self.candidates.reset()
        self._key = None
        self._buffers = None
        self._word = None
        self._capacity = 0

    def __call__(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        pbc: torch.Tensor,
        system_index: torch.Tensor,
        *,
        n_receivers: int | None = None,
        topology: object = None,
    ) -> PaddedEdges:
        """The edges at ``positions`` whose receivers are the first
        ``n_receivers`` rows (default: every row); ``topology`` as for
        :class:`DeviceVerletList` (a change rebuilds on the host).

        Outside a capture the overflow word is read (one host read) and the
        call repeats with a larger list or capacity until everything fits; a
        non-finite position or a singular periodic cell raises
        :class:`~nvdd.core.ValidationError`. Inside a capture nothing is read:
        :meth:`verdict` says afterwards whether the call fitted.
        """
        while True:
            matrix = self.candidates(
                positions, cell, pbc, system_index, n_receivers=n_receivers, topology=topology
            )
            edges = self._compact(matrix, positions.detach(), cell.detach(), system_index)
            if capturing():
                return edges
            rows, total = self._read()
            if self._provisional and rows == 0:  # first sizing: now the count is known
                self._provisional = False
                self._capacity = edge_capacity(total, matrix.n_receivers, self.headroom)
                continue
            if rows == 0 and total <= self._capacity:
                return edges
            self._grow(rows, total, matrix.n_receivers)

    def overflow_flag(self) -> torch.Tensor:
        """Int32 ``(1,)`` on the device: 1 when the last call did not fit (rows
        past the matrix, edges past the capacity, or a search error), else 0.
        No host read: a caller folds it into a reduction it makes anyway."""
        word = self._word
        if word is None:
            raise CaptureError("DeviceEdges.overflow_flag before the first call")
        return ((word[:1] != 0) | (word[1:] > self._capacity)).to(torch.int32)

    def verdict(self) -> bool:
        """Whether the last call fitted (one host read); when it did not, the next
        call grows what overflowed (then call again before using any edge)."""
        if self._word is None:
            return True
        rows, total = self._read()
        if rows == 0 and total <= self._capacity:
            return True
        self._grow(rows, total, self._n_rows())
        return False

    # ------------------------------------------------------------- internals
    def _read(self) -> tuple[int, int]:
        if capturing():
            raise CaptureError("DeviceEdges: the overflow word read inside a step capture")
        assert self._word is not None
        values = self._word.tolist()  # the one host read of an uncaptured call
        error = self.candidates.error_word
        if values[_ROWS] < 0 and error is not None:
            self.candidates.poll(wait=True)  # raises the search's own message, or records it
            if self.defer_errors:  # the outputs are NaN (poison): a shared check raises
                return 0, int(values[_TOTAL])
            raise ValidationError(f"device neighbour search failed (error bits {int(error)})")
        return int(values[_ROWS]), int(values[_TOTAL])

    @property
    def defer_errors(self) -> bool:
        """Record a search error (:attr:`pending_error`; the model's outputs are NaN
        through :meth:`poison`) instead of raising on this rank alone: under DD,
        where the runtime's shared finite check then raises on every rank."""
        return self.candidates.defer_errors

    @defer_errors.setter
    def defer_errors(self, value: bool) -> None:
        self.candidates.defer_errors = bool(value)

    @property
    def pending_error(self) -> str | None:
        """The message of a search error seen but not raised (``defer_errors``)."""
        return self.candidates.pending_error

    def poison(self, dtype: torch.dtype) -> torch.Tensor:
        """``(1,)`` of ``dtype`` on the device: NaN while the last call's search
        had an error, else 0 (added to a model's energies: an error is never a
        silent result, in a replay either)."""
        word = self._word
        if word is None:
            raise CaptureError("DeviceEdges.poison before the first call")
        nan = torch.full((1,), float("nan"), dtype=dtype, device=word.device)
        return torch.where(word[:1] < 0, nan, torch.zeros_like(nan))

    def _grow(self, rows: int, total: int, n_rows: int) -> None:
        """Grow what overflowed: the candidate matrix first (its next call), as
        the edge count of truncated rows is only a lower bound; else the edges."""
        if rows:
            self.candidates.poll(wait=True)  # reads the largest count: a regrow next call
        elif total > self._capacity:
            self._resize(total, n_rows)

    def _n_rows(self) -> int:
        assert self._buffers is not None
        return int(self._buffers[-1].shape[0])

    def _resize(self, total: int, n_rows: int) -> None:
        if self._capacity:
            self.regrows += 1
        self._capacity = edge_capacity(total, n_rows, self.headroom)
        self._buffers = None  # reallocated by the next call

    def _allocate(self, positions: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, ...]:
        key = (n_rows, positions.device, self._capacity)
        if self._buffers is None or self._key != key:
            dev, cap = positions.device, self._capacity
            i64 = torch.int64
            self._buffers = (
                torch.zeros(cap, dtype=i64, device=dev),  # receivers
                torch.zeros(cap, dtype=i64, device=dev),  # senders
                torch.zeros(cap, 3, dtype=i64, device=dev),  # shifts
                torch.arange(cap, dtype=i64, device=dev),  # edge numbers
                torch.zeros(cap, dtype=torch.bool, device=dev),  # the mask
                torch.zeros(n_rows, dtype=i64, device=dev),  # edges per row
                torch.zeros(n_rows, dtype=i64, device=dev),  # their prefix sum
            )
            self._word = torch.zeros(2, dtype=i64, device=dev)
            self._key = key
        return self._buffers

    def _compact(
        self,
        matrix: NeighborMatrix,
        positions: torch.Tensor,
        cell: torch.Tensor,
        system_index: torch.Tensor,
    ) -> PaddedEdges:
        """The candidates inside the cutoff, written into the edge buffers (two
        Warp passes around a prefix sum; no host read)."""
        n_rows = matrix.n_receivers  # (a full list has rows for the others too)
        if self._capacity == 0:  # first sizing: every candidate (tight after one read)
            self._capacity = max(64, int(matrix.neighbors.shape[0]) * n_rows)
            self._provisional = True
        recv, send, shift, numbers, mask, within, ends = self._allocate(positions, n_rows)
        word = self._word
        assert word is not None
        dev, dtype = positions.device, positions.dtype
        common = [
            positions, cell, system_index, matrix.neighbors, matrix.codes, matrix.counts,
            int(matrix.periodic), self._cutoff * self._cutoff,
        ]  # fmt: skip
        kernels = self._kernels
        word.zero_()
        kernels.count(n_rows, [*common, within, word], dev, dtype)
        torch.cumsum(within, 0, out=ends)
        kernels.write(n_rows, [*common, ends, recv, send, shift], dev, dtype)
        if n_rows:
            word[1:].copy_(ends[-1:])
        error = self.candidates.error_word
        if error is not None:  # a search error reads as overflowing rows: never used silently
            word[:1].copy_(torch.where(error != 0, -1, word[:1]))
        torch.lt(numbers, word[1:], out=mask)
        # padded edges: (0, 0) pairs without a shift, masked to zero by the model
        recv.masked_fill_(~mask, 0)
        send.masked_fill_(~mask, 0)
        shift.masked_fill_(~mask[:, None], 0)
        return PaddedEdges(recv, send, shift, mask, bool(matrix.periodic))


class _Kernels:
    """The compaction's kernels, with launches recorded per owner."""

    def __init__(self) -> None:
        # the first launch of either declares the overloads of both (not per call)
        self.count = Kernel(ek.count_edges_kernel, floats=(7,), prepare=self.declare)
        self.write = Kernel(ek.write_edges_kernel, floats=(7,), prepare=self.declare)

    def declare(self) -> None:
        declare_overloads(self.count, self.write)
