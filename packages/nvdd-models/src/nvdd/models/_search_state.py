"""The device buffers of a :class:`~nvdd.models.DeviceVerletList`, made at a host-side rebuild.

:class:`SearchState` holds one layout's buffers (rows, systems, dtype, device,
receivers); :func:`allocate_state` makes them and :func:`resize_matrix` gives
the neighbour matrix a new capacity, both only when the list rebuilds on the
host (a steady call uses the buffers and runs nothing here). :class:`FlagMirror`
is the interface of the host copy of the search's flags, which the list
(``_device_neighbors``, with the host and pinned implementations) polls every
call.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nvdd.models import _cell_kernels as ck

__all__ = ["FlagMirror", "SearchState", "allocate_state", "host_words", "resize_matrix"]


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


def allocate_state(
    key: tuple[object, ...],
    pos: torch.Tensor,
    n_systems: int,
    n_recv: int,
    n_rows: int,
    capacity: int,
    old: SearchState | None,
    mirror: Callable[[torch.Tensor], FlagMirror],
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
