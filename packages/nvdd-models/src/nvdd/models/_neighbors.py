"""Neighbour lists: full COO edge lists with integer image shifts, built by vesin.

Conventions (every model of this package relies on them):

- an edge ``(i, j, S)`` is *directed*: ``i`` is the **receiver** (the row whose
  per-atom quantities the edge updates), ``j`` the **sender**;
- ``r_ij = x[j] - x[i] + S @ cell[system_index[i]]`` (cell rows are lattice
  vectors, as in ASE) and ``|r_ij| < cutoff``;
- the list is *full*: ``(j, i, -S)`` is present whenever ``(i, j, S)`` is;
- an atom meets its own periodic images (``i == j``, ``S != 0``) when the cell
  is smaller than the cutoff;
- ``S`` is zero on every non-periodic axis.

Domain-decomposition seam: under DD a rank searches its ``[owned | ghost]`` rows
with open boundaries and passes ``n_receivers = n_owned``; edges whose receiver
is a ghost row are dropped, so every global directed edge is kept by exactly one
rank (the owner of its receiver).

The search itself is vesin's (cell lists in C++ on CPU, CUDA kernels on GPU):
chosen over nvalchemi-toolkit-ops by measurement (see the package's design notes).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn

import torch
import vesin

from nvdd.core import CapacityOverflowError, ValidationError, get_rank
from nvdd.models._checks import check_geometry, check_positive, check_receivers, fail, shape_of

__all__ = ["EdgeList", "NeighborList"]

_VESIN_DEVICES = ("cpu", "cuda")
#: vesin reads this variable when it sizes its CUDA output buffer.
_VESIN_CUDA_CAPACITY = "VESIN_CUDA_MAX_PAIRS_PER_POINT"
#: vesin's own default pairs per point on CUDA, and the text of its overflow error.
_VESIN_CUDA_DEFAULT = 128
_VESIN_OVERFLOW = "exceeds the maximum capacity"
_CUDA_RETRIES = 8


@dataclass(frozen=True)
class EdgeList:
    """A directed COO neighbour list.

    Attributes
    ----------
    receivers:
        Int64, shape ``(n_edges,)``: ``i``, the row each edge updates.
    senders:
        Int64, shape ``(n_edges,)``: ``j``, the row each edge reads.
    shifts:
        Int64, shape ``(n_edges, 3)``: integer image shifts ``S`` with
        ``r_ij = x[j] - x[i] + S @ cell[system]``.
    periodic:
        False when every shift is known to be zero (open boundaries); lets
        :meth:`vectors` skip the shift term without a device synchronisation.
    """

    receivers: torch.Tensor
    senders: torch.Tensor
    shifts: torch.Tensor
    periodic: bool = True

    @property
    def n_edges(self) -> int:
        """Number of directed edges."""
        return int(self.receivers.shape[0])

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> EdgeList:
        """An edge list with no edges."""
        idx = torch.zeros(0, dtype=torch.int64, device=device)
        return EdgeList(
            idx, idx.clone(), torch.zeros(0, 3, dtype=torch.int64, device=device), False
        )

    def select(self, index: torch.Tensor) -> EdgeList:
        """The edges picked by ``index`` (bool mask or int64 positions), same order."""
        if index.dtype == torch.bool:
            index = index.nonzero().squeeze(1)
        return EdgeList(
            self.receivers.index_select(0, index),
            self.senders.index_select(0, index),
            self.shifts.index_select(0, index),
            self.periodic,
        )

    def shift_vectors(self, cell: torch.Tensor, system_index: torch.Tensor) -> torch.Tensor | None:
        """``S @ cell[system of i]``, shape ``(n_edges, 3)``; None when not periodic.

        Differentiable in ``cell`` (the strain derivative needs that).
        """
        if not self.periodic:
            return None
        s = self.shifts.to(cell.dtype)
        if cell.shape[0] == 1:
            return s @ cell[0]
        cells = cell.index_select(0, system_index.index_select(0, self.receivers))
        return torch.bmm(s.unsqueeze(1), cells).squeeze(1)

    def vectors(
        self, positions: torch.Tensor, cell: torch.Tensor, system_index: torch.Tensor
    ) -> torch.Tensor:
        """Edge vectors ``r_ij = x[j] - x[i] + S @ cell``, shape ``(n_edges, 3)``.

        Differentiable in ``positions`` and ``cell``. Uses ``index_select`` only,
        so a per-atom tensor subclass dispatches through ``__torch_function__``.
        """
        r = positions.index_select(0, self.senders) - positions.index_select(0, self.receivers)
        shift = self.shift_vectors(cell, system_index)
        return r if shift is None else r + shift


@dataclass(frozen=True)
class _Layout:
    """Host-side facts about a batch, read with one device synchronisation."""

    counts: list[int]
    in_order: bool
    pbc: list[list[bool]]


def _read_layout(
    system_index: torch.Tensor, pbc: torch.Tensor, n_systems: int
) -> tuple[str | None, _Layout | None]:
    """Range-check ``system_index``, count atoms per system, read ``pbc`` and whether
    the rows are grouped by system: all in one device-to-host copy.

    Returns ``(message, layout)``: ``message`` names the first bad value (else None).
    """
    n = int(system_index.shape[0])
    if n == 0:
        return None, _Layout([0] * n_systems, True, pbc.tolist())
    lo, hi = torch.aminmax(system_index)
    ordered = (system_index[1:] >= system_index[:-1]).all()
    counts = torch.bincount(system_index.clamp(0, n_systems - 1), minlength=n_systems)
    host = torch.cat(
        [torch.stack([lo, hi, ordered.long()]), counts, pbc.long().reshape(-1)]
    ).tolist()
    lo_v, hi_v, ordered_v = host[0], host[1], host[2]
    if lo_v < 0 or hi_v >= n_systems:
        bad = lo_v if lo_v < 0 else hi_v
        return f"system_index has {bad}, expected 0..{n_systems - 1}", None
    flags = host[3 + n_systems :]
    return None, _Layout(
        counts=host[3 : 3 + n_systems],
        in_order=bool(ordered_v),
        pbc=[[bool(f) for f in flags[3 * k : 3 * k + 3]] for k in range(n_systems)],
    )


class NeighborList:
    """Full neighbour lists of several systems in one batch.

    Every system has its own cell and per-axis periodicity (periodic, open, or
    mixed; cells smaller than twice the cutoff give several images of a
    neighbour, and an atom may neighbour its own images). Positions need not be
    wrapped into the cell. Atoms of different systems never neighbour each other.

    Parameters
    ----------
    cutoff:
        Search radius (Angstrom); edges have ``|r_ij| < cutoff``.

    Notes
    -----
    The search runs in float64 whatever the dtype of ``positions``. Systems are
    searched one after the other (vesin is a single-system library); a CUDA
    tensor is searched on its GPU, a tensor on another device on the CPU. On the
    CPU vesin uses ``torch.get_num_threads()`` threads.

    On CUDA, vesin sizes its output buffer from the environment variable
    ``VESIN_CUDA_MAX_PAIRS_PER_POINT``; this class sets it around each of its own
    calls (and restores it), sized from the system's density and doubled on
    overflow, so one instance must not search from several Python threads at once.
    """

    def __init__(self, cutoff: float) -> None:
        check_positive("cutoff", cutoff)
        self._cutoff = float(cutoff)
        self._search = vesin.NeighborList(cutoff=self._cutoff, full_list=True)
        # CUDA: one vesin object per buffer size (its buffer is sized at first use).
        self._cuda_search: dict[int, vesin.NeighborList] = {}
        self._cuda_pairs_per_point = _VESIN_CUDA_DEFAULT

    @property
    def cutoff(self) -> float:
        """The search radius."""
        return self._cutoff

    def __repr__(self) -> str:
        return f"NeighborList(cutoff={self._cutoff})"

    def __getstate__(self) -> dict[str, float | int]:
        # vesin's objects hold C handles: a copy (pickle, deepcopy) makes new ones.
        return {"cutoff": self._cutoff, "cuda_pairs_per_point": self._cuda_pairs_per_point}

    def __setstate__(self, state: dict[str, float | int]) -> None:
        self.__init__(float(state["cutoff"]))  # type: ignore[misc]
        self._cuda_pairs_per_point = int(state["cuda_pairs_per_point"])

    def __call__(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        pbc: torch.Tensor,
        system_index: torch.Tensor,
        *,
        n_receivers: int | None = None,
    ) -> EdgeList:
        """Search every system; return the full directed edge list.

        Parameters
        ----------
        positions:
            Shape ``(n_atoms, 3)``.
        cell:
            Shape ``(n_systems, 3, 3)``, rows are lattice vectors; only the
            vectors of periodic axes are read.
        pbc:
            Bool, shape ``(n_systems, 3)``.
        system_index:
            Int64, shape ``(n_atoms,)``, values in ``[0, n_systems)``; need not
            be sorted.
        n_receivers:
            Keep only edges whose receiver ``i < n_receivers`` (the owned rows of
            a ``[owned | ghost]`` layout). Default: keep every edge.

        Returns
        -------
        EdgeList
            Edges grouped by system (in system order); the order within a
            system is vesin's.

        Raises
        ------
        ValidationError
            On malformed inputs; the message names the rank, the field, its
            shape and the expected one.
        """
        fail(check_geometry(positions, cell, pbc, system_index))
        n_atoms = int(positions.shape[0])
        fail(check_receivers(n_receivers, n_atoms))
        message, layout = _read_layout(system_index, pbc, int(cell.shape[0]))
        fail(message)
        if layout is None:  # pragma: no cover - a message was raised above
            raise RuntimeError("no layout")
        with torch.no_grad():
            edges = self._search_all(positions.detach(), cell.detach(), system_index, layout)
        if n_receivers is not None and n_receivers < n_atoms:
            edges = edges.select(edges.receivers < n_receivers)
        return edges

    # ----------------------------------------------------------------- search
    def _search_all(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        system_index: torch.Tensor,
        layout: _Layout,
    ) -> EdgeList:
        device = positions.device
        work = device if device.type in _VESIN_DEVICES else torch.device("cpu")
        pos = positions.to(device=work, dtype=torch.float64)
        pbc_w = torch.tensor(layout.pbc, dtype=torch.bool, device=work)
        # Only periodic lattice vectors matter; zero the others so that any
        # placeholder a caller left on an open axis cannot confuse the search.
        cells = (cell.to(device=work, dtype=torch.float64) * pbc_w.unsqueeze(2)).contiguous()
        per_point: list[int] = []
        if work.type == "cuda":  # buffer sizes of vesin's CUDA search, one sync
            volumes = torch.linalg.det(cells).abs().tolist()
            per_point = [
                _pairs_per_point(count, volume, pbc, self._cutoff)
                for count, volume, pbc in zip(layout.counts, volumes, layout.pbc, strict=True)
            ]
        order = None
        if not layout.in_order:
            order = torch.argsort(system_index.to(work), stable=True)
        recv: list[torch.Tensor] = []
        send: list[torch.Tensor] = []
        shifts: list[torch.Tensor] = []
        start = 0
        for s, count in enumerate(layout.counts):
            if count == 0:
                continue
            if order is None:
                rows = None
                pos_s = pos[start : start + count]
            else:
                rows = order[start : start + count]
                pos_s = pos.index_select(0, rows)
            if per_point:
                pairs, shift = self._search_cuda(pos_s, cells[s], pbc_w[s], per_point[s])
            else:
                self._search.n_threads = max(1, torch.get_num_threads())
                pairs, shift = _vesin(self._search, pos_s, cells[s], pbc_w[s])
            # vesin returns size_t pairs; indices are far below 2**63, so the bits
            # of uint64 and int64 agree and a view avoids a copy.
            i, j = pairs.reshape(-1, 2).view(torch.int64).unbind(1)
            if rows is None:
                if start:
                    i, j = i + start, j + start
            else:
                i, j = rows.index_select(0, i), rows.index_select(0, j)
            recv.append(i.contiguous())
            send.append(j.contiguous())
            shifts.append(shift.reshape(-1, 3).long())
            start += count
        if not recv:
            return EdgeList.empty(device)
        one = len(recv) == 1  # the common case: no concatenation copy
        return EdgeList(
            (recv[0] if one else torch.cat(recv)).to(device),
            (send[0] if one else torch.cat(send)).to(device),
            (shifts[0] if one else torch.cat(shifts)).to(device),
            any(any(p) for p in layout.pbc),
        )

    def _search_cuda(
        self, positions: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor, estimate: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vesin on CUDA writes into a buffer of ``max_pairs_per_point`` pairs per atom
        and reports an overflow (it never truncates). Start from the estimate (or the
        size that worked last); on overflow double it and search again with a fresh
        buffer. Raises :class:`CapacityOverflowError` after ``_CUDA_RETRIES`` tries."""
        per_point = max(self._cuda_pairs_per_point, estimate)
        for _ in range(_CUDA_RETRIES):
            search = self._cuda_search.get(per_point)
            if search is None:
                search = vesin.NeighborList(cutoff=self._cutoff, full_list=True)
                self._cuda_search = {per_point: search}
            try:
                with _env(_VESIN_CUDA_CAPACITY, str(per_point)):
                    pairs, shifts = search.compute(positions, cell, pbc, quantities="PS")
            except RuntimeError as exc:
                if _VESIN_OVERFLOW not in str(exc):
                    _raise(positions, cell, pbc, exc)
                per_point *= 2
                continue
            self._cuda_pairs_per_point = per_point
            return pairs, shifts
        raise CapacityOverflowError(
            f"rank {get_rank()}: neighbour search of {positions.shape[0]} atoms needs more than "
            f"{per_point // 2} pairs per atom on CUDA (cutoff {self._cutoff}, cell {cell.tolist()})"
        )


def _vesin(
    search: vesin.NeighborList, positions: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``search.compute`` with vesin's errors (bad boxes, devices) as ValidationError."""
    try:
        pairs, shifts = search.compute(positions, cell, pbc, quantities="PS")
    except RuntimeError as exc:
        _raise(positions, cell, pbc, exc)
    return pairs, shifts


def _raise(
    positions: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor, exc: Exception
) -> NoReturn:
    raise ValidationError(
        f"rank {get_rank()}: neighbour search of {positions.shape[0]} atoms failed (cell "
        f"{cell.tolist()}, pbc {pbc.tolist()}, positions {shape_of(positions)}): {exc}"
    ) from exc


def _pairs_per_point(n_atoms: int, volume: float, pbc: list[bool], cutoff: float) -> int:
    """A generous estimate of the neighbours per atom, for vesin's CUDA buffer.

    Periodic systems: 1.5 times the mean count at the cell's density, plus 16.
    Others start from vesin's own default and grow on overflow.
    """
    if not all(pbc) or volume <= 0:
        return _VESIN_CUDA_DEFAULT
    mean = n_atoms / volume * 4.0 / 3.0 * math.pi * cutoff**3
    return max(_VESIN_CUDA_DEFAULT, int(1.5 * mean) + 16)


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """Set an environment variable for the duration of a call, then restore it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
