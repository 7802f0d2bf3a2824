"""Padding of dense neighbour matrices: ``neighbors`` of shape ``(n_atoms, K)``.

The layout is the one of ``nvalchemiops`` neighbour matrices (and of AIMNet2):
row ``i`` lists the neighbours of atom ``i`` in its first ``num_neighbors[i]``
slots; the other slots hold a fill value (``n_atoms`` by default) and are
ignored. After padding, the fill value is ``atom_cap - 1``: a padding atom row
that exists in every per-atom tensor, so ``x[neighbors]`` is always in range,
and kernels that skip slots ``>= fill_value`` keep working.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nvdd.core import ValidationError, get_rank
from nvdd.padding._cap import DEFAULT_GROWTH, DEFAULT_MULTIPLE, CapacityRegistry
from nvdd.padding._common import (
    PaddedAtoms,
    check_fields,
    check_index,
    init_padder,
    pad_fields,
    pad_rows,
    require_padded,
    resolve_padder_caps,
    take_rows,
    wrong_type,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "DenseGraph",
    "DensePadder",
    "NeighborMatrix",
    "PaddedDense",
    "check_dense",
    "pad_dense",
    "unpad_dense",
]


class NeighborMatrix:
    """What the dense graphs of one and of several systems share (a mixin).

    The frozen dataclasses that mix it in declare these fields; the padding
    functions below read only them.
    """

    neighbors: torch.Tensor
    num_neighbors: torch.Tensor
    atom_fields: Mapping[str, torch.Tensor]
    neighbor_fields: Mapping[str, torch.Tensor]
    fill_value: int | None

    @property
    def n_atoms(self) -> int:
        """Rows of ``neighbors``."""
        return int(self.neighbors.shape[0])

    @property
    def max_neighbors(self) -> int:
        """Columns of ``neighbors``."""
        return int(self.neighbors.shape[1])


@dataclass(frozen=True, eq=False)
class DenseGraph(NeighborMatrix):
    """A dense neighbour-matrix graph, unpadded.

    Attributes
    ----------
    neighbors:
        Integer tensor, shape ``(n_atoms, max_neighbors)``. Slots
        ``k < num_neighbors[i]`` of row ``i`` hold neighbour indices in
        ``[0, n_atoms)``; the others are padding.
    num_neighbors:
        Integer tensor, shape ``(n_atoms,)``, values in ``[0, max_neighbors]``.
    atom_fields:
        Per-atom tensors, each of shape ``(n_atoms, ...)``.
    neighbor_fields:
        Per-slot tensors (e.g. periodic shifts), each of shape
        ``(n_atoms, max_neighbors, ...)``.
    fill_value:
        What this graph's padding slots hold; None means ``n_atoms`` (the
        ``nvalchemiops`` default). Only used to rebuild the graph in ``unpad``.
    """

    neighbors: torch.Tensor
    num_neighbors: torch.Tensor
    atom_fields: Mapping[str, torch.Tensor] = field(default_factory=dict)
    neighbor_fields: Mapping[str, torch.Tensor] = field(default_factory=dict)
    fill_value: int | None = None


@dataclass(frozen=True, eq=False)
class PaddedDense(PaddedAtoms):
    """A dense neighbour-matrix graph padded to fixed capacities.

    Attributes
    ----------
    neighbors:
        Shape ``(atom_cap, neighbor_cap)``, the input's dtype. Real slots are
        unchanged; every other slot (beyond a row's count, in a padded column, in
        a padding row) holds :attr:`fill_value` ``= atom_cap - 1``, a padding atom.
    num_neighbors:
        Shape ``(atom_cap,)``: the real counts, 0 on padding rows.
    neighbor_mask:
        Bool, shape ``(atom_cap, neighbor_cap)``: True on real slots.
    atom_mask:
        Bool, shape ``(atom_cap,)``: True on real atoms.
    atom_fields:
        Each of shape ``(atom_cap, ...)``; padding atoms hold the fill value and the
        positions field far-away points.
    neighbor_fields:
        Each of shape ``(atom_cap, neighbor_cap, ...)``; non-real slots hold the
        fill value.
    n_atoms, max_neighbors:
        The unpadded shape of ``neighbors``.
    source_fill:
        The unpadded graph's fill value (restored by ``unpad``).
    grew:
        True when this ``pad`` changed a capacity.
    """

    neighbors: torch.Tensor
    num_neighbors: torch.Tensor
    neighbor_mask: torch.Tensor
    atom_mask: torch.Tensor
    atom_fields: Mapping[str, torch.Tensor]
    neighbor_fields: Mapping[str, torch.Tensor]
    n_atoms: int
    max_neighbors: int
    source_fill: int
    grew: bool

    @property
    def neighbor_cap(self) -> int:
        """The padded number of neighbour slots per row."""
        return int(self.neighbor_mask.shape[1])

    @property
    def fill_value(self) -> int:
        """What every non-real slot of :attr:`neighbors` holds: ``atom_cap - 1``."""
        return self.atom_cap - 1

    def real_neighbors(self, x: torch.Tensor) -> torch.Tensor:
        """The unpadded block of a per-slot tensor: shape
        ``(atom_cap, neighbor_cap, ...)`` to ``(n_atoms, max_neighbors, ...)``."""
        rows = take_rows(x, self.n_atoms, self.atom_cap, "atom")
        if rows.ndim < 2 or rows.shape[1] != self.neighbor_cap:
            raise ValidationError(
                f"rank {get_rank()}: a padded per-slot tensor must have shape "
                f"({self.atom_cap}, {self.neighbor_cap}, ...), got {tuple(x.shape)}"
            )
        return rows[:, : self.max_neighbors]


def check_dense(
    graph: NeighborMatrix, positions_field: str | None, check_indices: bool
) -> str | None:
    """Describe what is wrong with the parts of a dense graph (None if nothing)."""
    # Read as objects: a graph is built without checks, so any field may hold anything.
    neighbors: object = graph.neighbors
    num_neighbors: object = graph.num_neighbors
    fill_value: object = graph.fill_value
    msg = check_index("neighbors", neighbors, (None, None))
    if msg is not None or not isinstance(neighbors, torch.Tensor):
        return msg
    n, k = neighbors.shape
    device = neighbors.device
    msg = check_index("num_neighbors", num_neighbors, (n,), device)
    if msg is not None or not isinstance(num_neighbors, torch.Tensor):
        return msg
    if fill_value is not None and (isinstance(fill_value, bool) or not isinstance(fill_value, int)):
        return f"fill_value must be an int or None, got {fill_value!r}"
    msg = check_fields("atom_fields", graph.atom_fields, (n,), device, positions_field)
    if msg is None:
        msg = check_fields("neighbor_fields", graph.neighbor_fields, (n, k), device)
    if msg is not None or not check_indices or n == 0:
        return msg
    real = torch.arange(k, device=device) < num_neighbors[:, None]
    # Sentinels keep the reductions defined (and neutral) when no slot is real.
    big, small = torch.iinfo(neighbors.dtype).max, torch.iinfo(neighbors.dtype).min
    flat_lo = torch.where(real, neighbors, big).flatten()
    flat_hi = torch.where(real, neighbors, small).flatten()
    cmin, cmax, lo, hi = torch.stack(
        [
            num_neighbors.min().to(torch.int64),
            num_neighbors.max().to(torch.int64),
            torch.cat([flat_lo, flat_lo.new_tensor([big])]).min().to(torch.int64),
            torch.cat([flat_hi, flat_hi.new_tensor([small])]).max().to(torch.int64),
        ]
    ).tolist()
    if cmin < 0 or cmax > k:
        return f"num_neighbors must lie in [0, {k}], found min {cmin} and max {cmax}"
    if lo < 0 or hi >= n:
        return f"real neighbour indices must lie in [0, {n}), found min {lo} and max {hi}"
    return None


def pad_dense(
    graph: NeighborMatrix,
    atom_cap: int,
    neighbor_cap: int,
    *,
    atom_fill: Mapping[str, float],
    neighbor_fill: Mapping[str, float],
    positions_field: str | None,
    spacing: float,
    grew: bool,
) -> PaddedDense:
    """Pad a checked dense graph to the given capacities (no communication)."""
    nbr = graph.neighbors
    n, k = nbr.shape
    fill = atom_cap - 1
    counts = pad_rows(graph.num_neighbors, atom_cap, 0)
    mask = torch.arange(neighbor_cap, device=nbr.device) < counts[:, None]
    wide = nbr.new_full((atom_cap, neighbor_cap), fill)
    wide[:n, :k] = nbr
    fields: dict[str, torch.Tensor] = {}
    for key, value in graph.neighbor_fields.items():
        value_fill = neighbor_fill.get(key, 0)
        block = value.new_full((atom_cap, neighbor_cap, *value.shape[2:]), value_fill)
        block[:n, :k] = value
        slot_mask = mask.reshape(atom_cap, neighbor_cap, *([1] * (value.ndim - 2)))
        fields[key] = torch.where(slot_mask, block, value_fill)
    return PaddedDense(
        neighbors=torch.where(mask, wide, fill),
        num_neighbors=counts,
        neighbor_mask=mask,
        atom_mask=torch.arange(atom_cap, device=nbr.device) < n,
        atom_fields=pad_fields(graph.atom_fields, atom_cap, atom_fill, positions_field, spacing),
        neighbor_fields=fields,
        n_atoms=n,
        max_neighbors=k,
        source_fill=n if graph.fill_value is None else graph.fill_value,
        grew=grew,
    )


def unpad_dense(padded: PaddedDense) -> DenseGraph:
    """The real dense graph of ``padded`` (no communication)."""
    n, k = padded.n_atoms, padded.max_neighbors
    real = padded.neighbor_mask[:n, :k]
    return DenseGraph(
        neighbors=torch.where(real, padded.neighbors[:n, :k], padded.source_fill),
        num_neighbors=padded.num_neighbors[:n],
        atom_fields={key: v[:n] for key, v in padded.atom_fields.items()},
        neighbor_fields={key: v[:n, :k] for key, v in padded.neighbor_fields.items()},
        fill_value=padded.source_fill,
    )


@dataclass(frozen=True, eq=False)
class DensePadder:
    """Built-in :class:`~nvdd.padding.GraphPadder` for dense ``(N, K)`` neighbour matrices.

    Pads the atom count to ``atom_cap >= n_atoms + 1`` (the last row is always a
    padding atom, the fill value of every non-real slot) and the slot count to
    ``neighbor_cap >= max_neighbors``, through :func:`~nvdd.padding.resolve_cap`
    (keys ``"<name>.atoms"`` and ``"<name>.neighbors"``). A real row's non-real
    slots point at that padding atom, ``spacing`` or more away: beyond the cutoff,
    and masked by ``neighbor_mask`` / ``num_neighbors``.

    Parameters
    ----------
    name:
        Prefix of the capacity keys; padders sharing a registry need distinct names.
    growth, atom_multiple, neighbor_multiple:
        Passed to :func:`~nvdd.padding.resolve_cap` for the two counts.
    positions_field, spacing, atom_fill, check_indices, registry:
        As for :class:`~nvdd.padding.COOPadder`.
    neighbor_fill:
        ``{field: value}`` for the non-real slots of a per-slot field (default 0).

    Raises
    ------
    ConfigurationError
        On a bad constructor value, naming it.
    """

    name: str = "dense"
    growth: float = DEFAULT_GROWTH
    atom_multiple: int = DEFAULT_MULTIPLE
    neighbor_multiple: int = DEFAULT_MULTIPLE
    positions_field: str | None = "positions"
    spacing: float = 100.0
    atom_fill: Mapping[str, float] = field(default_factory=dict)
    neighbor_fill: Mapping[str, float] = field(default_factory=dict)
    check_indices: bool = True
    registry: CapacityRegistry = field(default_factory=CapacityRegistry)

    def __post_init__(self) -> None:
        init_padder(
            self,
            "DensePadder",
            ("atom_multiple", "neighbor_multiple"),
            ("atom_fill", "neighbor_fill"),
        )

    @property
    def keys(self) -> tuple[str, str]:
        """The capacity keys: ``("<name>.atoms", "<name>.neighbors")``."""
        return f"{self.name}.atoms", f"{self.name}.neighbors"

    def pad(self, graph: DenseGraph, *, group: ProcessGroup | None = None) -> PaddedDense:
        """Pad ``graph`` to this padder's capacities, growing them if needed.

        **Collective** over ``group`` when one is given: one all-reduce of a small
        int tensor; every rank of ``group`` must call ``pad`` on this padder (same
        ``name``) in the same order, and then gets the same capacities.

        Returns
        -------
        PaddedDense
            ``neighbors`` shape ``(atom_cap, neighbor_cap)`` with fill
            ``atom_cap - 1``, counts, masks, padded fields.

        Raises
        ------
        ValidationError
            On every rank of ``group`` when any rank's graph is malformed; the
            message names the rank, the field and the value.
        """
        error = wrong_type("DensePadder.pad", graph, DenseGraph)
        if error is None:
            error = check_dense(graph, self.positions_field, self.check_indices)
        (atom_cap, neighbor_cap), grew = resolve_padder_caps(
            self,
            self.keys,
            (self.atom_multiple, self.neighbor_multiple),
            lambda: (graph.n_atoms + 1, graph.max_neighbors),
            group,
            error,
        )
        return pad_dense(
            graph,
            atom_cap,
            neighbor_cap,
            atom_fill=self.atom_fill,
            neighbor_fill=self.neighbor_fill,
            positions_field=self.positions_field,
            spacing=self.spacing,
            grew=grew,
        )

    def unpad(self, padded: PaddedDense) -> DenseGraph:
        """The real graph of ``padded``; padding slots get the unpadded graph's fill.

        Local, no communication. Raises :class:`~nvdd.core.ValidationError` if
        ``padded`` is not a :class:`PaddedDense`.
        """
        require_padded("DensePadder.unpad", padded, PaddedDense)
        return unpad_dense(padded)
