"""Padding of dense neighbour matrices of several systems (a batch, as AIMNet2 uses).

Atoms of all systems are stacked along one axis with a system index, as in
:class:`nvdd.core.Batch`. Padding appends padding atoms that belong to a padding
system (index ``system_cap - 1``), so a per-system reduction by system index
(``index_add`` into ``system_cap`` rows) never mixes padding into a real system.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nvdd.core import Batch
from nvdd.padding._cap import DEFAULT_GROWTH, DEFAULT_MULTIPLE, CapacityRegistry
from nvdd.padding._common import (
    check_fields,
    check_index,
    count_problem,
    init_padder,
    pad_fields,
    pad_rows,
    range_problem,
    require_padded,
    resolve_padder_caps,
    take_rows,
    wrong_type,
)
from nvdd.padding._dense import NeighborMatrix, PaddedDense, check_dense, pad_dense, unpad_dense

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DenseBatchGraph", "DenseBatchPadder", "PaddedDenseBatch"]

#: Field names of PaddedDense, copied into a PaddedDenseBatch.
_DENSE_FIELDS = tuple(f.name for f in dataclasses.fields(PaddedDense))


@dataclass(frozen=True, eq=False)
class DenseBatchGraph(NeighborMatrix):
    """Dense neighbour matrix of a batch of systems, unpadded.

    Attributes
    ----------
    neighbors, num_neighbors, atom_fields, neighbor_fields, fill_value:
        As in :class:`~nvdd.padding.DenseGraph`, over the atoms of every system;
        a real neighbour must belong to the same system as its row.
    system_index:
        Integer tensor, shape ``(n_atoms,)``, values in ``[0, n_systems)``.
    n_systems:
        The number of systems.
    system_fields:
        Per-system tensors (cell, pbc, charge), each of shape ``(n_systems, ...)``.
    """

    neighbors: torch.Tensor
    num_neighbors: torch.Tensor
    system_index: torch.Tensor
    n_systems: int
    atom_fields: Mapping[str, torch.Tensor] = field(default_factory=dict)
    neighbor_fields: Mapping[str, torch.Tensor] = field(default_factory=dict)
    system_fields: Mapping[str, torch.Tensor] = field(default_factory=dict)
    fill_value: int | None = None

    @classmethod
    def from_batch(
        cls,
        batch: Batch,
        neighbors: torch.Tensor,
        num_neighbors: torch.Tensor,
        *,
        neighbor_fields: Mapping[str, torch.Tensor] | None = None,
        fill_value: int | None = None,
    ) -> DenseBatchGraph:
        """The graph of ``batch`` with its neighbour matrix.

        Atom fields: ``positions``, ``atomic_numbers``, ``masses``, ``atom_ids`` and
        every ``batch.atom_extras``; system fields: ``cell``, ``pbc`` and every
        ``batch.system_extras``. Shapes are checked by ``pad``.
        """
        atom_fields = {
            "positions": batch.positions,
            "atomic_numbers": batch.atomic_numbers,
            "masses": batch.masses,
            "atom_ids": batch.atom_ids,
            **batch.atom_extras,
        }
        system_fields = {"cell": batch.cell, "pbc": batch.pbc, **batch.system_extras}
        return cls(
            neighbors=neighbors,
            num_neighbors=num_neighbors,
            system_index=batch.system_index,
            n_systems=batch.n_systems,
            atom_fields=atom_fields,
            neighbor_fields=dict(neighbor_fields or {}),
            system_fields=system_fields,
            fill_value=fill_value,
        )


@dataclass(frozen=True, eq=False)
class PaddedDenseBatch(PaddedDense):
    """A :class:`~nvdd.padding.PaddedDense` of a batch, with padded systems.

    Attributes
    ----------
    system_index:
        Shape ``(atom_cap,)``: real atoms keep theirs, padding atoms are in the
        padding system ``system_cap - 1``.
    system_mask:
        Bool, shape ``(system_cap,)``: True on the ``n_systems`` real systems.
    system_fields:
        Each of shape ``(system_cap, ...)``; padding systems hold the fill value
        (a zero cell and no periodicity by default).
    n_systems:
        The real number of systems.
    """

    system_index: torch.Tensor
    system_mask: torch.Tensor
    system_fields: Mapping[str, torch.Tensor]
    n_systems: int

    @property
    def system_cap(self) -> int:
        """The padded system count."""
        return int(self.system_mask.shape[0])

    @property
    def padding_system(self) -> int:
        """The system of every padding atom: ``system_cap - 1``."""
        return self.system_cap - 1

    def real_systems(self, x: torch.Tensor) -> torch.Tensor:
        """The real rows of a per-system tensor: ``(system_cap, ...)`` to
        ``(n_systems, ...)``."""
        return take_rows(x, self.n_systems, self.system_cap, "system")


def _check_batch(graph: object, positions_field: str | None, check_indices: bool) -> str | None:
    if not isinstance(graph, DenseBatchGraph):
        return wrong_type("DenseBatchPadder.pad", graph, DenseBatchGraph)
    msg = check_dense(graph, positions_field, check_indices)
    if msg is not None:
        return msg
    n, device = graph.n_atoms, graph.neighbors.device
    s = graph.n_systems
    msg = count_problem("n_systems", s) or check_index(
        "system_index", graph.system_index, (n,), device
    )
    if msg is None:
        msg = check_fields("system_fields", graph.system_fields, (s,), device)
    if msg is not None or not check_indices or n == 0:
        return msg
    sys_i = graph.system_index
    msg = range_problem("system_index", sys_i, s)
    if msg is not None:
        return msg
    real = torch.arange(graph.max_neighbors, device=device) < graph.num_neighbors[:, None]
    rows = torch.arange(n, device=device)[:, None]
    partner = sys_i[torch.where(real, graph.neighbors, rows)]
    crossing = (partner != sys_i[:, None]).nonzero()
    if crossing.shape[0] > 0:
        i, k = crossing[0].tolist()
        j = int(graph.neighbors[i, k])
        return (
            f"{crossing.shape[0]} neighbour slot(s) join different systems, e.g. atom {i} "
            f"(system {int(sys_i[i])}) and atom {j} (system {int(sys_i[j])})"
        )
    return None


@dataclass(frozen=True, eq=False)
class DenseBatchPadder:
    """Built-in :class:`~nvdd.padding.GraphPadder` for dense ``(N, K)`` neighbour
    matrices of a batch of systems (AIMNet2).

    Pads atoms (``atom_cap >= n_atoms + 1``), neighbour slots
    (``neighbor_cap >= max_neighbors``) and systems (``system_cap >= n_systems +
    1``) through :func:`~nvdd.padding.resolve_cap` (keys ``"<name>.atoms"``,
    ``"<name>.neighbors"``, ``"<name>.systems"``), consistently with the system
    index: padding atoms form the padding system ``system_cap - 1``, far from
    every real atom, with no neighbours; real rows' non-real slots hold
    ``atom_cap - 1``, a padding atom.

    Parameters
    ----------
    name:
        Prefix of the capacity keys; padders sharing a registry need distinct names.
    growth, atom_multiple, neighbor_multiple, system_multiple:
        Passed to :func:`~nvdd.padding.resolve_cap` for the three counts.
    positions_field, spacing, atom_fill, neighbor_fill, check_indices, registry:
        As for :class:`~nvdd.padding.DensePadder`; ``check_indices`` also checks
        the system index and that neighbours share their row's system.
    system_fill:
        ``{field: value}`` for the padding systems' rows (default 0: a zero cell,
        ``pbc`` False).

    Raises
    ------
    ConfigurationError
        On a bad constructor value, naming it.
    """

    name: str = "dense_batch"
    growth: float = DEFAULT_GROWTH
    atom_multiple: int = DEFAULT_MULTIPLE
    neighbor_multiple: int = DEFAULT_MULTIPLE
    system_multiple: int = 1
    positions_field: str | None = "positions"
    spacing: float = 100.0
    atom_fill: Mapping[str, float] = field(default_factory=dict)
    neighbor_fill: Mapping[str, float] = field(default_factory=dict)
    system_fill: Mapping[str, float] = field(default_factory=dict)
    check_indices: bool = True
    registry: CapacityRegistry = field(default_factory=CapacityRegistry)

    def __post_init__(self) -> None:
        init_padder(
            self,
            "DenseBatchPadder",
            ("atom_multiple", "neighbor_multiple", "system_multiple"),
            ("atom_fill", "neighbor_fill", "system_fill"),
        )

    @property
    def keys(self) -> tuple[str, str, str]:
        """The capacity keys: ``"<name>.atoms"``, ``".neighbors"``, ``".systems"``."""
        return f"{self.name}.atoms", f"{self.name}.neighbors", f"{self.name}.systems"

    def pad(self, graph: DenseBatchGraph, *, group: ProcessGroup | None = None) -> PaddedDenseBatch:
        """Pad ``graph`` to this padder's capacities, growing them if needed.

        **Collective** over ``group`` when one is given: one all-reduce of a small
        int tensor; every rank of ``group`` must call ``pad`` on this padder (same
        ``name``) in the same order, and then gets the same capacities.

        Returns
        -------
        PaddedDenseBatch
            ``neighbors`` shape ``(atom_cap, neighbor_cap)`` with fill
            ``atom_cap - 1``, ``system_index`` shape ``(atom_cap,)``, masks and
            padded atom, slot and system fields.

        Raises
        ------
        ValidationError
            On every rank of ``group`` when any rank's graph is malformed; the
            message names the rank, the field and the value.
        """
        error = _check_batch(graph, self.positions_field, self.check_indices)
        (atom_cap, neighbor_cap, system_cap), grew = resolve_padder_caps(
            self,
            self.keys,
            (self.atom_multiple, self.neighbor_multiple, self.system_multiple),
            lambda: (graph.n_atoms + 1, graph.max_neighbors, graph.n_systems + 1),
            group,
            error,
        )
        dense = pad_dense(
            graph,
            atom_cap,
            neighbor_cap,
            atom_fill=self.atom_fill,
            neighbor_fill=self.neighbor_fill,
            positions_field=self.positions_field,
            spacing=self.spacing,
            grew=grew,
        )
        return PaddedDenseBatch(
            **{f: getattr(dense, f) for f in _DENSE_FIELDS},
            system_index=pad_rows(graph.system_index, atom_cap, system_cap - 1),
            system_mask=torch.arange(system_cap, device=graph.neighbors.device) < graph.n_systems,
            system_fields=pad_fields(graph.system_fields, system_cap, self.system_fill),
            n_systems=graph.n_systems,
        )

    def unpad(self, padded: PaddedDenseBatch) -> DenseBatchGraph:
        """The real graph of ``padded``; padding slots get the unpadded graph's fill.

        Local, no communication. Raises :class:`~nvdd.core.ValidationError` if
        ``padded`` is not a :class:`PaddedDenseBatch`.
        """
        require_padded("DenseBatchPadder.unpad", padded, PaddedDenseBatch)
        dense = unpad_dense(padded)
        s = padded.n_systems
        return DenseBatchGraph(
            neighbors=dense.neighbors,
            num_neighbors=dense.num_neighbors,
            system_index=padded.system_index[: padded.n_atoms],
            n_systems=s,
            atom_fields=dense.atom_fields,
            neighbor_fields=dense.neighbor_fields,
            system_fields={key: v[:s] for key, v in padded.system_fields.items()},
            fill_value=dense.fill_value,
        )
