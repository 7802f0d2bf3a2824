"""`DeviceVerletList`: a neighbour matrix searched and reused on the device.

The search (``_cell_kernels``) runs in the positions' dtype, on CPU or CUDA, and
writes a compact list: ``neighbors`` int32 ``(capacity, n_rows)`` (slot-major:
``neighbors[c, i]`` is row ``i``'s ``c``-th neighbour), ``counts`` int32
``(n_rows,)`` and, when a system is periodic, ``codes`` int32
``(capacity, n_rows)``: the image shift ``S`` of each entry packed 10 bits per
axis, with ``r_ij = x[j] - x[i] + S @ cell[system[i]]``.

**Verlet reuse without host synchronisation.** Every call launches the same
chain of kernels: a check (did an atom move more than ``skin / 2`` since the
last build, or is one not finite; did the cell or, when the host saw a new
tensor, a system index change), then the build kernels, which return at once
unless the check (or the host) asked for a rebuild. The host never needs to
know whether a rebuild happened: buffers have fixed shapes between host-side
rebuilds. A step that rebuilds nothing performs no device-to-host copy.

**No silent truncation.** A row whose neighbours do not fit the capacity keeps
its true count (``counts[i] > capacity``; ``-1`` when an image shift does not
fit its code): the force kernel then walks the cells of the search for that
row (exact, slower), so an overflow can slow a step down but never change a
force. The flags of every call are copied to pinned host memory
asynchronously; the next call reads the copy if it has arrived (no waiting)
and grows the capacity (a host-side rebuild) when it was exceeded. Host-side
rebuilds (the first call, a new shape, ``n_receivers`` or ``topology``, a new
``pbc`` tensor, a regrow) synchronise once, size the capacity exactly and
raise on errors at once.

**Errors are sticky.** NaN or infinite positions, a singular periodic cell,
or positions spanning more cells than a key holds set an error bit; while it
is set every output of the force kernel is NaN, and the host raises a
:class:`~nvdd.core.ValidationError` when it reads the flags (on CPU at the end
of the same call, on CUDA at the next call) or, with ``defer_errors=True``
(domain decomposition: a local raise would leave other ranks waiting in a
collective), records the message in :attr:`DeviceVerletList.pending_error`
for the caller to share.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nvdd.core import CaptureError, TensorMemo, ValidationError, after_replay, capturing, get_rank
from nvdd.models import _cell_kernels as ck
from nvdd.models._checks import check_geometry, check_positive, check_receivers, config_error, fail
from nvdd.models._search_state import (
    FlagMirror,
    SearchState,
    allocate_state,
    host_words,
    resize_matrix,
)
from nvdd.models._warp import Kernel, declare_overloads

__all__ = [
    "DeviceVerletList",
    "HostMirror",
    "NeighborMatrix",
    "PinnedMirror",
    "default_mirror",
]

# ------------------------------------------- the flags' host copy, the list's output
# The host copies of the search's flags that the list polls every call (their
# interface, FlagMirror, and the buffers, SearchState, which a host-side rebuild
# makes, live in ``_search_state``) and the list it hands out (NeighborMatrix).


class HostMirror(FlagMirror):
    """Flags already in host memory (CPU): always current, nothing to copy."""

    def __init__(self, flags: torch.Tensor) -> None:
        self._flags = flags
        self.values = host_words(flags)

    @property
    def busy(self) -> bool:
        """Never: nothing is copied."""
        return False

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


# ------------------------------------------------------------------ the list


class _Kernels:
    """The search's kernels, with launches recorded per list (they die with it)."""

    def __init__(self) -> None:
        # the first launch of any of them declares the overloads of all (not per call)
        first = self.declare
        self.check = Kernel(ck.check_kernel, floats=(7,), doubles=(8, 9), prepare=first)
        self.frame = Kernel(ck.frame_kernel, doubles=(2, 3), prepare=first)
        self.assign = Kernel(ck.assign_kernel, doubles=(4,), prepare=first)
        self.scatter = Kernel(ck.scatter_kernel, prepare=first)
        self.build = Kernel(ck.build_kernel, floats=(9,), prepare=first)

    def declare(self) -> None:
        declare_overloads(self.check, self.frame, self.assign, self.scatter, self.build)


#: Cells a little higher than the search radius: rounding of the (float64) cell
#: coordinates can never push a neighbour past the next cell.
_CELL_MARGIN = 1e-3
#: The search radius exceeds ``cutoff + skin`` by this fraction: the list's
#: distances (from wrapped positions) and the force kernel's (unwrapped, in the
#: same dtype) may differ by rounding; the force kernel filters by its own.
_RADIUS_MARGIN = 1e-4
_FIRST_CAPACITY = 16
_ERRORS = {
    ck.ERR_NONFINITE: "positions hold NaN or infinite values",
    ck.ERR_CELL: "a periodic cell is singular or not finite",
    ck.ERR_RANGE: (
        f"positions span more than {ck.KEY_LIMIT - ck.MAX_SPAN} search cells on an open axis "
        f"(or {ck.IMAGE_LIMIT} periodic images)"
    ),
    ck.ERR_IMAGES: (
        f"a periodic cell is thinner than the search radius / {ck.MAX_SPAN} (more than "
        f"{ck.MAX_SPAN} images per axis)"
    ),
}


#: From this many rows the list is built by one thread per row in row order,
#: below it in cell order (:attr:`DeviceVerletList.row_order_build`). On one H200
#: (half list, 9.5 A, argon) row order took 1.33 / 6.08 / 22.8 ms per build at
#: 131k / 1M / 4M atoms against 1.23 / 7.08 / 27.1 in cell order (fp32; fp64
#: alike): the crossover lies between the first two sizes.
ROW_ORDER_MIN_ROWS = 1 << 18


class DeviceVerletList:
    """A neighbour matrix built and reused on the device (see the module notes).

    Parameters
    ----------
    cutoff:
        Interaction cutoff (Angstrom); the search radius is ``cutoff + skin``
        (plus 0.01 %: the caller filters by its cutoff with its own arithmetic).
    skin:
        Verlet skin, ``>= 0``: the list is rebuilt when an atom moved more than
        ``skin / 2`` since the last build.
    half:
        Keep one direction per pair (the default) or both.
    cells_per_cutoff:
        Cells per search radius along each axis (1 or more): more, smaller cells
        test fewer candidates and look up more cells.
    defer_errors:
        Record errors read from asynchronous flags in :attr:`pending_error`
        instead of raising (for callers that must raise on every rank together).
    max_capacity:
        Never grow the matrix past this many neighbours per row (bounds its
        memory); rows with more walk the cells at every call (exact, slower).

    Attributes
    ----------
    pending_error:
        The message of an error seen but not raised (``defer_errors``), else None.
    host_rebuilds:
        Host-side rebuilds so far (each synchronises once).
    row_order_build:
        Build with one thread per row in row order (coalesced writes of the
        matrix: True) or in cell order (coherent reads of the candidates:
        False); the list is the same either way. None (the default): row order
        from :data:`ROW_ORDER_MIN_ROWS` rows.
    wait_for_host_builds:
        True (the default): a host-side rebuild reads its flags at once (one
        synchronisation), raises its errors and, when a row overflowed, grows
        the matrix and builds again before returning. False: once the list has
        been sized by such a read, later host-side rebuilds read their flags
        like a steady call (asynchronously: errors raise, or are recorded with
        ``defer_errors``, at a later call; an overflowing row walks the cells,
        exact, and the next call regrows), so the host runs ahead of the build
        (a DD rebuild step, where the host has more work to queue).
    """

    row_order_build: bool | None = None

    def __init__(
        self,
        cutoff: float,
        skin: float = 0.0,
        *,
        half: bool = True,
        cells_per_cutoff: int = 1,
        defer_errors: bool = False,
        max_capacity: int | None = None,
    ) -> None:
        check_positive("cutoff", cutoff)
        check_positive("skin", skin, allow_zero=True)
        if isinstance(cells_per_cutoff, bool) or cells_per_cutoff not in range(1, 5):
            raise config_error(f"cells_per_cutoff must be 1..4, got {cells_per_cutoff!r}")
        self._cutoff = float(cutoff)
        self._skin = float(skin)
        self._half = bool(half)
        self._cells = int(cells_per_cutoff)
        self._radius = (self._cutoff + self._skin) * (1.0 + _RADIUS_MARGIN)
        self.defer_errors = bool(defer_errors)
        if max_capacity is not None and (isinstance(max_capacity, bool) or max_capacity < 1):
            raise config_error(f"max_capacity must be an int >= 1 or None, got {max_capacity!r}")
        self._max_capacity = max_capacity
        self._capacity = _FIRST_CAPACITY if max_capacity is None else min(16, max_capacity)
        self._state: SearchState | None = None
        self._call = 0
        self._regrow = 0
        self._kernels = _Kernels()
        self._seen_pbc = TensorMemo()
        self._seen_system = TensorMemo()
        self.pending_error: str | None = None
        self.host_rebuilds = 0
        self.wait_for_host_builds = True
        self._sized = False  # a host-side build's flags were read synchronously
        self._repeats = 0
        #: Launch only the check on CPU when nothing is rebuilt (reading the
        #: flag costs nothing there); tests turn it off to run the CUDA order.
        self.skip_idle_launches = True
        #: Makes the host copy of a new list's flags (tests substitute a delayed one).
        self.mirror_factory: Callable[[torch.Tensor], FlagMirror] = default_mirror

    # ------------------------------------------------------------ properties
    @property
    def cutoff(self) -> float:
        """The interaction cutoff."""
        return self._cutoff

    @property
    def skin(self) -> float:
        """The Verlet skin."""
        return self._skin

    @property
    def radius(self) -> float:
        """The search radius: ``cutoff + skin``, plus 0.01 % for rounding."""
        return self._radius

    @property
    def half(self) -> bool:
        """Whether the list keeps one direction per pair."""
        return self._half

    @property
    def capacity(self) -> int:
        """Neighbours per row the matrix holds (grows on demand, never shrinks)."""
        return self._capacity

    @property
    def n_builds(self) -> int:
        """Builds so far, host- and device-decided, not counting the repeats of a
        host-side build that grew the capacity (reads the device: synchronises)."""
        state = self._state
        builds = 0 if state is None else int(state.flags[ck.F_BUILDS].item())
        return builds - self._repeats

    @property
    def error_word(self) -> torch.Tensor | None:
        """The sticky error bits on the device, int32 shape ``(1,)`` (a view; None
        before the first call): nonzero while the outputs are NaN. A runtime can
        fold it into a reduction it performs anyway (e.g. its rebuild decision) to
        stop every rank together without an extra synchronisation."""
        state = self._state
        return None if state is None else state.flags[ck.F_ERROR : ck.F_ERROR + 1]

    def __repr__(self) -> str:
        return (
            f"DeviceVerletList(cutoff={self._cutoff}, skin={self._skin}, half={self._half}, "
            f"capacity={self._capacity})"
        )

    def __getstate__(self) -> dict[str, Any]:
        # Device buffers and weak references do not travel; a copy rebuilds.
        return {
            "cutoff": self._cutoff,
            "skin": self._skin,
            "half": self._half,
            "cells": self._cells,
            "defer": self.defer_errors,
            "capacity": self._capacity,
            "max_capacity": self._max_capacity,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["cutoff"],
            state["skin"],
            half=state["half"],
            cells_per_cutoff=state["cells"],
            defer_errors=state["defer"],
            max_capacity=state["max_capacity"],
        )
        self._capacity = int(state["capacity"])

    def reset(self) -> None:
        """Forget the list and its buffers; the next call rebuilds on the host."""
        self._state = None
        self._repeats = 0
        self._seen_pbc = TensorMemo()
        self._seen_system = TensorMemo()
        self.pending_error = None
        self._sized = False

    # ------------------------------------------------------------------ call
    def __call__(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        pbc: torch.Tensor,
        system_index: torch.Tensor,
        *,
        n_receivers: int | None = None,
        topology: object = None,
        validated: bool = False,
        checked: bool = False,
    ) -> NeighborMatrix:
        """The list at ``positions`` (built or reused).

        Parameters
        ----------
        positions:
            float32 or float64, shape ``(n_atoms, 3)``, on CPU or CUDA.
        cell:
            Same dtype, shape ``(n_systems, 3, 3)``; rows are lattice vectors
            (only periodic ones are read).
        pbc:
            Bool, shape ``(n_systems, 3)``.
        system_index:
            Int64, shape ``(n_atoms,)``, values in ``[0, n_systems)``.
        n_receivers:
            Rows ``< n_receivers`` are owned (default: every row); pairs without
            an owned end are left out, and a half list gives each pair with one
            owned end to that end (ghost rows then have no list).
        topology:
            A token compared with ``==``; a change forces a host-side rebuild
            (the caller's rows now hold other atoms).
        validated:
            The caller already checked the system indices' range (they index
            device arrays: an unchecked value out of range would read out of
            bounds). Otherwise they are checked when a new tensor arrives
            (one synchronisation).
        checked:
            The caller checked the four tensors' shapes, dtypes and devices
            (``check_geometry``) and ``n_receivers`` against them (under DD:
            ``_dd.prepare_rows``): they are not checked again.

        Returns
        -------
        NeighborMatrix
            Views of the list's buffers, valid until the next call.

        Raises
        ------
        ValidationError
            On malformed inputs (host-side checks), an error flag (see the
            module notes) unless ``defer_errors``, or more than
            ``MAX_SYSTEMS - 1`` systems.
        """
        if not checked:
            fail(check_geometry(positions, cell, pbc, system_index))
            fail(check_receivers(n_receivers, int(positions.shape[0])))
        n_atoms = int(positions.shape[0])
        if positions.dtype not in (torch.float32, torch.float64):
            fail(f"positions must be float32 or float64, got {positions.dtype}")
        if positions.device.type not in ("cpu", "cuda"):
            fail(f"positions must be on CPU or CUDA, got {positions.device}")
        n_systems = int(cell.shape[0])
        if n_systems >= ck.MAX_SYSTEMS:
            fail(f"{n_systems} systems: the device search holds at most {ck.MAX_SYSTEMS - 1}")
        n_recv = n_atoms if n_receivers is None else int(n_receivers)
        pos = positions.detach()
        cell_d = cell.detach()
        state = self._state
        capture = capturing()  # (asked once a call: the chain below is told)
        if state is not None and not capture and state.mirror.ready(wait=False):
            self._inspect(state, state.mirror.values)  # (a replay polls after it: _replayed)
        key = (n_atoms, n_systems, pos.dtype, pos.device, n_recv, topology)
        force = state is None or state.key != key or self._regrow > 0
        if force:
            self._grow(self._regrow)
            self._regrow = 0
            state = self._allocate(key, pos, n_systems, n_recv, state)
        assert state is not None
        if not self._seen_pbc.same(pbc):
            flags = pbc.tolist()  # one synchronisation, only for a new pbc tensor
            if flags != state.pbc_host:
                state.pbc = pbc.to(torch.int32).contiguous()
                state.pbc_host = flags
                periodic = any(any(row) for row in flags)
                if periodic != state.periodic:
                    state.periodic = periodic
                    self._resize_matrix(state)
                force = True
            self._seen_pbc.remember(pbc)
        track = not self._seen_system.same(system_index)
        if track and not validated:
            _check_system_range(system_index, n_systems)
        self._run(state, pos, cell_d, system_index, force=force, track=track, capture=capture)
        if track:
            self._seen_system.remember(system_index)
        return NeighborMatrix(
            neighbors=state.neighbors,
            counts=state.counts,
            codes=state.codes,
            periodic=state.periodic,
            half=self._half,
            n_receivers=state.n_recv,
            radius=self._radius,
            state=state,
        )

    @property
    def graph_token(self) -> tuple[int, int, int]:
        """Changes whenever the list's buffers may have moved (a host-side
        rebuild, a reset, a new capacity): a captured step that used the old
        ones must be dropped."""
        return (id(self._state), self.host_rebuilds, self._capacity)

    def poll(self, *, wait: bool = True) -> None:
        """Read the flags now (``wait``: synchronise) and raise or regrow as a call would."""
        if self._state is not None:
            self._poll(self._state, wait=wait)

    # ------------------------------------------------------------- internals
    def _run(
        self,
        state: SearchState,
        pos: torch.Tensor,
        cell: torch.Tensor,
        system_index: torch.Tensor,
        *,
        force: bool,
        track: bool,
        capture: bool,
    ) -> None:
        """Launch the check and the build chain; host-side rebuilds size the matrix
        (``capture``: a step capture records the call, see the notes)."""
        if capture:  # a step capture: the device decides everything
            if force:
                raise CaptureError(
                    "DeviceVerletList: this call rebuilds on the host (a new shape, pbc, "
                    "topology or capacity): not a steady step to capture"
                )
            self._call = (self._call + 1) & 0x3FFFFFFF
            # The call number is frozen in the graph: clear the request of a previous
            # replay so that a replay rebuilds only when its own check asks for it.
            state.flags[ck.F_REBUILD].zero_()
            self._launch_chain(state, pos, cell, system_index, force=False, track=track, idle=False)
            after_replay(lambda: self._replayed(state))
            return
        self.host_rebuilds += int(force)
        # a list sized by an earlier read may rebuild without waiting for its flags
        wait = force and not (self._sized and not self.wait_for_host_builds)
        idle = self.skip_idle_launches
        while True:
            self._call = (self._call + 1) & 0x3FFFFFFF
            self._launch_chain(state, pos, cell, system_index, force=force, track=track, idle=idle)
            if not wait:  # a steady call, or see wait_for_host_builds
                self._after_call(state)
                return
            values = state.flags.tolist()  # host-side rebuild: one synchronisation
            self._sized = True
            self._raise_errors(state, int(values[ck.F_ERROR]))
            if not self._grow(int(values[ck.F_MAX_COUNT])):
                return
            self._resize_matrix(state)
            self._repeats += 1

    def _launch_chain(
        self,
        state: SearchState,
        pos: torch.Tensor,
        cell: torch.Tensor,
        system_index: torch.Tensor,
        *,
        force: bool,
        track: bool,
        idle: bool,
    ) -> None:
        """The check (unless ``force``) and the build chain. ``idle``: stop after
        the check when it asked for no rebuild and the flags live on the host (CPU;
        never in a capture: a replay decides on the device)."""
        k = self._kernels
        dev, dtype = pos.device, pos.dtype
        n, n_sys, call = state.n_atoms, int(cell.shape[0]), self._call
        cell_flat = cell.reshape(-1)
        half_skin = 0.5 * self._skin
        threshold2 = half_skin * half_skin * (1.0 - 1e-6)
        radius = self._radius
        height = radius * (1.0 + _CELL_MARGIN) / self._cells
        flags = state.flags
        if not force:
            k.check(
                n,
                [pos, state.ref_positions, system_index, state.ref_system, int(track),
                 cell_flat, state.ref_cell, threshold2, self._skin, self._cutoff, call,
                 flags],
                dev, dtype,
            )  # fmt: skip
            local = state.local
            if idle and local is not None and local[ck.F_REBUILD] != call:
                return
        f = int(force)
        rows = self.row_order_build
        if rows is None:
            rows = n >= ROW_ORDER_MIN_ROWS
        table = int(state.slot_key.shape[0])
        k.frame(
            max(table, n_sys),
            [cell, state.pbc, radius, height, state.frame, state.grid, state.slot_key,
             state.slot_count, call, f, flags],
            dev, dtype,
        )  # fmt: skip
        k.assign(
            max(n, n_sys * 9),
            [pos, system_index, state.frame, state.grid, height, cell_flat, state.ref_positions,
             state.ref_system, 1, state.ref_cell, state.slot_key, state.slot_count, state.row_key,
             state.row_image, state.row_slot, state.row_rank, call, f, flags],
            dev, dtype,
        )  # fmt: skip
        torch.cumsum(state.slot_count, 0, dtype=torch.int32, out=state.slot_end)
        k.scatter(
            n,
            [pos, system_index, cell, state.row_image, state.row_slot, state.row_rank,
             state.slot_count, state.slot_end, state.sorted_row, state.sorted_pos,
             state.sorted_image, call, f, flags],
            dev, dtype,
        )  # fmt: skip
        k.build(
            n,
            [state.sorted_row, state.sorted_pos, state.sorted_image, state.row_key, cell,
             state.grid, state.slot_key, state.slot_count, state.slot_end, radius * radius,
             state.n_rows, state.n_recv, int(self._half), int(state.periodic), state.neighbors,
             state.codes, state.counts, call, f, flags, state.row_slot, state.row_rank,
             int(rows)],
            dev, dtype,
        )  # fmt: skip

    def _after_call(self, state: SearchState) -> None:
        """Start a copy of the flags to the host unless one is still on its way;
        read the copy if it has arrived (on CPU: at once)."""
        if not state.mirror.busy:
            state.mirror.start()
        if state.mirror.ready(wait=False):
            self._inspect(state, state.mirror.values)

    def _replayed(self, state: SearchState) -> bool:
        """After a replay of a captured call: the per-call host work (read the
        flags when they arrive); False once the graph no longer fits this list
        (it must grow, or an error dropped it)."""
        if self._state is not state:
            return False
        self._after_call(state)
        return self._state is state and self._regrow == 0 and self.pending_error is None

    def _poll(self, state: SearchState, *, wait: bool) -> None:
        if capturing():  # a CUDA event query ends a capture (cudaErrorStreamCaptureInvalidated)
            raise CaptureError("DeviceVerletList: flags polled inside a step capture")
        if state.mirror.ready(wait):
            self._inspect(state, state.mirror.values)

    def _inspect(self, state: SearchState, values: Any) -> None:
        errors = int(values[ck.F_ERROR])
        if errors:
            self._raise_errors(state, errors)
        needed = int(values[ck.F_MAX_COUNT])
        limit = self._max_capacity
        if needed > self._capacity and (limit is None or self._capacity < limit):
            self._regrow = needed

    def _grow(self, needed: int) -> bool:
        """Raise the capacity to hold ``needed`` (up to ``max_capacity``); whether it grew."""
        if needed <= self._capacity:
            return False
        grown = _grown(needed)
        if self._max_capacity is not None:
            grown = min(grown, self._max_capacity)
        if grown <= self._capacity:
            return False
        self._capacity = grown
        return True

    def _raise_errors(self, state: SearchState, errors: int) -> None:
        """Raise (and drop the list: the next call starts afresh), or with
        ``defer_errors`` record the message; the error bits stay set, so the
        outputs stay NaN until the list is rebuilt on the host."""
        if not errors:
            return
        what = "; ".join(text for bit, text in _ERRORS.items() if errors & bit)
        message = (
            f"rank {get_rank()}: device neighbour search of {state.n_atoms} atoms: {what} "
            f"(cutoff {self._cutoff}, skin {self._skin}); outputs are NaN until a rebuild"
        )
        if self.defer_errors:
            self.pending_error = message
            return
        self._state = None
        raise ValidationError(message)

    def _allocate(
        self,
        key: tuple[object, ...],
        pos: torch.Tensor,
        n_systems: int,
        n_recv: int,
        old: SearchState | None,
    ) -> SearchState:
        n_rows = n_recv if self._half else int(pos.shape[0])
        state = allocate_state(
            key, pos, n_systems, n_recv, n_rows, self._capacity, old, self.mirror_factory
        )
        if old is None or old.flags.device != pos.device:
            self._repeats = 0  # the build count restarts with the flags
        self._seen_pbc = TensorMemo()  # a new layout reads pbc again
        self._seen_system = TensorMemo()
        self._state = state
        return state

    def _resize_matrix(self, state: SearchState) -> None:
        resize_matrix(state, self._capacity)


def _grown(needed: int) -> int:
    """A capacity for ``needed`` neighbours with room to fluctuate (multiple of 8)."""
    return 8 * math.ceil((1.15 * needed + 4) / 8)


def _check_system_range(system_index: torch.Tensor, n_systems: int) -> None:
    """Values of ``system_index`` in ``[0, n_systems)`` (one synchronisation)."""
    if system_index.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.stack(list(torch.aminmax(system_index))).tolist())
    if lo < 0 or hi >= n_systems:
        fail(
            f"system_index has {lo if lo < 0 else hi} (shape {tuple(system_index.shape)}), "
            f"expected values in 0..{n_systems - 1}"
        )
