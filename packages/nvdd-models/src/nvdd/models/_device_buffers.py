"""Device buffers of `DeviceVerletList` and the list it hands out (`NeighborMatrix`)."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nvdd.core import TensorMemo
from nvdd.models import _cell_kernels as ck
from nvdd.models._checks import fail

__all__ = [
    "FlagMirror",
    "HostMirror",
    "NeighborMatrix",
    "PinnedMirror",
    "SearchState",
    "TensorMemo",
    "allocate_state",
    "default_mirror",
    "resize_matrix",
]


class FlagMirror:
    """A host copy of the search's flag words, read without waiting for the device.

    :meth:`start` begins a copy of the current flags (after a call's kernels);
    :meth:`ready` says whether a copy has arrived (``wait``: wait for it), and
    then :attr:`values` holds it (int32 words, indexable).
    """

    values: Any

    @property
    def busy(self) -> bool:
        """Whether a copy was started and not yet seen arrive (a new :meth:`start`
        would replace it: a host far ahead of the device would never see one land)."""
        return False

    def start(self) -> None:
        """Begin copying the flags to the host."""
        raise NotImplementedError

    def ready(self, wait: bool) -> bool:
        """Whether a copy has arrived since the last ``True`` (``wait``: block for it)."""
        raise NotImplementedError


class HostMirror(FlagMirror):
    """Flags already in host memory (CPU): always current, nothing to copy."""

    def __init__(self, flags: torch.Tensor) -> None:
        self._flags = flags
        self.values = host_words(flags)

    def start(self) -> None:
        """Nothing to copy."""

    def ready(self, wait: bool) -> bool:
        """Always."""
        return True


class PinnedMirror(FlagMirror):  # pragma: no cover - CUDA only (its logic: tests' mirrors)
    """CUDA: a non-blocking copy into pinned memory, completion seen by an event."""

    def __init__(self, flags: torch.Tensor) -> None:
        self._flags = flags
        self._pinned = torch.zeros(flags.shape, dtype=flags.dtype, pin_memory=True)
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._pending = False
        self.values = host_words(self._pinned)

    @property
    def busy(self) -> bool:
        """Whether the last copy has not been seen to arrive yet."""
        return self._pending

    def start(self) -> None:
        """Enqueue the copy on the current stream and record its completion."""
        self._pinned.copy_(self._flags, non_blocking=True)
        self._event.record(torch.cuda.current_stream(self._flags.device))
        self._pending = True

    def ready(self, wait: bool) -> bool:
        """Whether the last copy completed (``Event.query``; ``wait``: synchronise)."""
        if not self._pending:
            return False
        if wait:
            self._event.synchronize()
        elif not self._event.query():  # type: ignore[no-untyped-call]
            return False
        self._pending = False
        return True


def default_mirror(flags: torch.Tensor) -> FlagMirror:
    """:class:`PinnedMirror` for CUDA flags, :class:`HostMirror` otherwise."""
    return PinnedMirror(flags) if flags.device.type == "cuda" else HostMirror(flags)


@dataclass
class SearchState:
    """Device buffers of one layout (rows, systems, dtype, device, receivers)."""

    key: tuple[object, ...]
    n_atoms: int
    n_rows: int
    n_recv: int
    flags: torch.Tensor
    mirror: FlagMirror
    local: Any  # the flags' words when they live in host memory (CPU), else None
    ref_positions: torch.Tensor
    ref_system: torch.Tensor
    ref_cell: torch.Tensor
    pbc: torch.Tensor
    pbc_host: list[list[bool]] | None
    periodic: bool
    frame: torch.Tensor
    grid: torch.Tensor
    slot_key: torch.Tensor
    slot_count: torch.Tensor
    slot_end: torch.Tensor
    row_key: torch.Tensor
    row_image: torch.Tensor
    row_slot: torch.Tensor
    row_rank: torch.Tensor
    sorted_row: torch.Tensor
    sorted_pos: torch.Tensor
    sorted_image: torch.Tensor
    neighbors: torch.Tensor
    codes: torch.Tensor
    counts: torch.Tensor


@dataclass(frozen=True)
class NeighborMatrix:
    """The device list of one call (views of the list's buffers: valid until its next call).

    Attributes
    ----------
    neighbors:
        Int32, shape ``(capacity, n_rows)``: ``neighbors[c, i]`` for
        ``c < counts[i]``.
    counts:
        Int32, shape ``(n_rows,)``: neighbours of each row (may exceed the
        capacity; -1 when a shift did not fit: the row must walk the cells).
    codes:
        Int32, shape ``(capacity, n_rows)``, packed image shifts; a ``(1, 1)``
        placeholder when no system is periodic (all shifts zero).
    periodic:
        Whether ``codes`` holds shifts.
    half:
        One direction per pair (see ``_cell_kernels.keep_pair``), else both.
    n_receivers:
        Rows ``< n_receivers`` are owned; pairs without an owned end are absent.
    radius:
        The search radius (cutoff + skin): entries are within it at the last
        build; the caller filters by its cutoff at the current positions.
    """

    neighbors: torch.Tensor
    counts: torch.Tensor
    codes: torch.Tensor
    periodic: bool
    half: bool
    n_receivers: int
    radius: float
    state: SearchState

    @property
    def n_rows(self) -> int:
        """Rows with a list (``n_receivers`` for a half list, else every row)."""
        return int(self.counts.shape[0])

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(i, j, S)`` of every entry, int64 ``(n,)``, ``(n,)``, ``(n, 3)`` (host sync).

        For tests and inspection. Raises :class:`ValidationError` when a row
        overflowed the matrix (its entries live only in the cell walk).
        """
        counts = self.counts.long()
        capacity = int(self.neighbors.shape[0])
        if bool(((counts < 0) | (counts > capacity)).any()):
            fail(f"{int(((counts < 0) | (counts > capacity)).sum())} rows overflowed the matrix")
        slot = torch.arange(capacity, device=counts.device)[:, None]
        mask = slot < counts[None, :]
        rows = torch.arange(self.n_rows, device=counts.device)[None, :].expand_as(mask)
        i, j = rows[mask], self.neighbors.long()[mask]
        if not self.periodic:
            return i, j, torch.zeros(i.shape[0], 3, dtype=torch.int64, device=i.device)
        code = self.codes.long()[mask]
        shifts = torch.stack([((code >> (10 * a)) & 1023) - ck.CODE_BIAS for a in range(3)], 1)
        return i, j, shifts


def allocate_state(
    key: tuple[object, ...],
    pos: torch.Tensor,
    n_systems: int,
    n_recv: int,
    n_rows: int,
    capacity: int,
    old: SearchState | None,
    mirror: Callable[[torch.Tensor], FlagMirror] = default_mirror,
) -> SearchState:
    """Fresh buffers for ``pos``'s rows (the build count and periodicity carry over
    from ``old``); the neighbour matrix holds ``capacity`` entries per row and
    ``mirror(flags)`` copies the flags to the host."""
    dev, dtype = pos.device, pos.dtype
    n = int(pos.shape[0])
    table = 1 << max(6, math.ceil(math.log2(max(1, 3 * n // 2 + 1))))
    i32, i64 = torch.int32, torch.int64
    flags = torch.zeros(ck.N_FLAGS, dtype=i32, device=dev)
    if old is not None and old.flags.device == dev:
        flags[ck.F_BUILDS] = old.flags[ck.F_BUILDS]  # the count survives a reallocation
    periodic = old.periodic if old is not None else True
    state = SearchState(
        key=key,
        n_atoms=n,
        n_rows=n_rows,
        n_recv=n_recv,
        flags=flags,
        mirror=mirror(flags),
        local=host_words(flags) if dev.type == "cpu" else None,
        ref_positions=torch.zeros(n, 3, dtype=dtype, device=dev),
        ref_system=torch.zeros(n, dtype=i64, device=dev),
        ref_cell=torch.zeros(n_systems * 9, dtype=dtype, device=dev),
        pbc=torch.zeros(n_systems, 3, dtype=i32, device=dev),
        pbc_host=None,
        periodic=periodic,
        frame=torch.zeros(n_systems, 9, dtype=torch.float64, device=dev),
        grid=torch.zeros(n_systems, 9, dtype=i32, device=dev),
        slot_key=torch.full((table,), -1, dtype=i64, device=dev),
        slot_count=torch.zeros(table, dtype=i32, device=dev),
        slot_end=torch.zeros(table, dtype=i32, device=dev),
        row_key=torch.zeros(n, dtype=i64, device=dev),
        row_image=torch.zeros(n, 3, dtype=i32, device=dev),
        row_slot=torch.zeros(n, dtype=i32, device=dev),
        row_rank=torch.zeros(n, dtype=i32, device=dev),
        sorted_row=torch.zeros(n, dtype=i32, device=dev),
        sorted_pos=torch.zeros(n, 3, dtype=dtype, device=dev),
        sorted_image=torch.zeros(n, 3, dtype=i32, device=dev),
        neighbors=torch.zeros(0, dtype=i32, device=dev),
        codes=torch.zeros(0, dtype=i32, device=dev),
        counts=torch.zeros(n_rows, dtype=i32, device=dev),
    )
    resize_matrix(state, capacity)
    return state


def resize_matrix(state: SearchState, capacity: int) -> None:
    """New (zeroed) neighbour matrix and shift codes of ``capacity`` entries per row."""
    dev = state.flags.device
    state.neighbors = torch.zeros(capacity, state.n_rows, dtype=torch.int32, device=dev)
    shape = (capacity, state.n_rows) if state.periodic else (1, 1)
    state.codes = torch.zeros(shape, dtype=torch.int32, device=dev)


def host_words(t: torch.Tensor) -> Any:
    """The int32 words of a host tensor, read without torch (no synchronisation to count)."""
    return (ctypes.c_int32 * t.numel()).from_address(t.data_ptr())
