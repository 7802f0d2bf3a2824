"""Padding of COO graphs: ``edge_index`` of shape ``(2, n_edges)`` plus per-edge data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nvdd.padding._cap import DEFAULT_GROWTH, DEFAULT_MULTIPLE, CapacityRegistry
from nvdd.padding._common import (
    PaddedAtoms,
    check_fields,
    check_index,
    count_problem,
    init_padder,
    pad_fields,
    range_problem,
    require_padded,
    resolve_padder_caps,
    take_rows,
    wrong_type,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["COOGraph", "COOPadder", "PaddedCOO"]

#: Padding atom rows a COO padding always reserves (padded edges join the last two).
_RESERVED_ATOMS = 2


@dataclass(frozen=True, eq=False)
class COOGraph:
    """A graph in coordinate format, unpadded.

    Attributes
    ----------
    edge_index:
        Integer tensor, shape ``(2, n_edges)``: the two atom indices of every edge
        (``[source, destination]`` by convention), each in ``[0, n_atoms)``.
    n_atoms:
        The number of atoms.
    atom_fields:
        Per-atom tensors (positions, atomic numbers, features), each of shape
        ``(n_atoms, ...)``.
    edge_fields:
        Per-edge tensors (periodic shifts, distances, weights), each of shape
        ``(n_edges, ...)``.
    """

    edge_index: torch.Tensor
    n_atoms: int
    atom_fields: Mapping[str, torch.Tensor] = field(default_factory=dict)
    edge_fields: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n_edges(self) -> int:
        """The number of edges (columns of ``edge_index``)."""
        return int(self.edge_index.shape[-1])


@dataclass(frozen=True, eq=False)
class PaddedCOO(PaddedAtoms):
    """A COO graph padded to fixed capacities (see the padding rule in
    :class:`~nvdd.padding.GraphPadder`).

    Attributes
    ----------
    edge_index:
        Shape ``(2, edge_cap)``, the input's dtype. Columns ``[0, n_edges)`` are the
        real edges; every padded column is ``[atom_cap - 2, atom_cap - 1]``, an
        edge between two padding atoms.
    atom_mask:
        Bool, shape ``(atom_cap,)``: True on the ``n_atoms`` real atoms.
    edge_mask:
        Bool, shape ``(edge_cap,)``: True on the ``n_edges`` real edges.
    atom_fields:
        Each of shape ``(atom_cap, ...)``; padding atoms hold the fill value, and
        the positions field holds far-away points.
    edge_fields:
        Each of shape ``(edge_cap, ...)``; padded edges hold the fill value.
    n_atoms, n_edges:
        The real counts. Keep them out of compiled code (use the masks).
    grew:
        True when this ``pad`` changed a capacity.
    """

    edge_index: torch.Tensor
    atom_mask: torch.Tensor
    edge_mask: torch.Tensor
    atom_fields: Mapping[str, torch.Tensor]
    edge_fields: Mapping[str, torch.Tensor]
    n_atoms: int
    n_edges: int
    grew: bool

    @property
    def edge_cap(self) -> int:
        """The padded edge count."""
        return int(self.edge_mask.shape[0])

    @property
    def padding_atom(self) -> int:
        """The row every padded edge points at (``atom_cap - 1``)."""
        return self.atom_cap - 1

    def real_edges(self, x: torch.Tensor) -> torch.Tensor:
        """The real rows of a per-edge tensor: ``(edge_cap, ...)`` to ``(n_edges, ...)``."""
        return take_rows(x, self.n_edges, self.edge_cap, "edge")


@dataclass(frozen=True, eq=False)
class COOPadder:
    """Built-in :class:`~nvdd.padding.GraphPadder` for COO ``edge_index`` graphs.

    Pads the atom count to ``atom_cap >= n_atoms + 2`` (two padding atoms always
    exist) and the edge count to ``edge_cap >= n_edges``, both through
    :func:`~nvdd.padding.resolve_cap` (keys ``"<name>.atoms"`` and
    ``"<name>.edges"``). Padded edges run from row ``atom_cap - 2`` to row
    ``atom_cap - 1``: both ends are padding atoms, placed ``spacing`` apart, so
    the padded edge vector is finite and non-zero (no ``0/0`` in ``1/r`` or in a
    unit vector) and longer than any cutoff below ``spacing``.

    Parameters
    ----------
    name:
        Prefix of the capacity keys; padders sharing a registry need distinct names.
    growth, atom_multiple, edge_multiple:
        Passed to :func:`~nvdd.padding.resolve_cap` for the two counts.
    positions_field:
        The atom field holding positions, shape ``(n_atoms, 3)``; its padding rows
        are placed far away (see :class:`~nvdd.padding.GraphPadder`). None: no
        field is treated as positions.
    spacing:
        Minimum distance from a padding atom to any other atom.
    atom_fill, edge_fill:
        ``{field: value}`` for the padding rows of a field (default 0). Set e.g.
        ``{"atom_ids": -1}``, or a distance field's fill above the cutoff.
    check_indices:
        Check that ``edge_index`` lies in ``[0, n_atoms)`` (one host sync). Shapes,
        dtypes and devices are always checked.
    registry:
        Where the capacities live; default: a fresh registry owned by this padder.

    Raises
    ------
    ConfigurationError
        On a bad constructor value, naming it.
    """

    name: str = "coo"
    growth: float = DEFAULT_GROWTH
    atom_multiple: int = DEFAULT_MULTIPLE
    edge_multiple: int = 32
    positions_field: str | None = "positions"
    spacing: float = 100.0
    atom_fill: Mapping[str, float] = field(default_factory=dict)
    edge_fill: Mapping[str, float] = field(default_factory=dict)
    check_indices: bool = True
    registry: CapacityRegistry = field(default_factory=CapacityRegistry)

    def __post_init__(self) -> None:
        init_padder(
            self, "COOPadder", ("atom_multiple", "edge_multiple"), ("atom_fill", "edge_fill")
        )

    @property
    def keys(self) -> tuple[str, str]:
        """The capacity keys: ``("<name>.atoms", "<name>.edges")``."""
        return f"{self.name}.atoms", f"{self.name}.edges"

    def _check(self, graph: object) -> str | None:
        if not isinstance(graph, COOGraph):
            return wrong_type("COOPadder.pad", graph, COOGraph)
        n = graph.n_atoms
        msg = count_problem("n_atoms", n) or check_index("edge_index", graph.edge_index, (2, None))
        if msg is not None:
            return msg
        device, n_edges = graph.edge_index.device, graph.n_edges
        msg = check_fields("atom_fields", graph.atom_fields, (n,), device, self.positions_field)
        if msg is None:
            msg = check_fields("edge_fields", graph.edge_fields, (n_edges,), device)
        if msg is None and self.check_indices and n_edges > 0:
            msg = range_problem("edge_index values", graph.edge_index, n)
        return msg

    def pad(self, graph: COOGraph, *, group: ProcessGroup | None = None) -> PaddedCOO:
        """Pad ``graph`` to this padder's capacities, growing them if needed.

        **Collective** over ``group`` when one is given: one all-reduce of a small
        int tensor (capacities, error flag, key hash); every rank of ``group`` must
        call ``pad`` on this padder (same ``name``) in the same order, and then
        gets the same ``atom_cap`` and ``edge_cap``.

        Parameters
        ----------
        graph:
            The unpadded graph.
        group:
            Process group whose ranks agree on the capacities; None: rank-local.

        Returns
        -------
        PaddedCOO
            ``edge_index`` shape ``(2, edge_cap)``, masks, padded fields. Autograd
            flows from the padded fields back to ``graph``'s tensors.

        Raises
        ------
        ValidationError
            On every rank of ``group`` when any rank's graph is malformed (wrong
            shape, dtype or device, index out of range); the message names the
            rank, the field and the value.
        """
        error = self._check(graph)
        (atom_cap, edge_cap), grew = resolve_padder_caps(
            self,
            self.keys,
            (self.atom_multiple, self.edge_multiple),
            lambda: (graph.n_atoms + _RESERVED_ATOMS, graph.n_edges),
            group,
            error,
        )
        ei = graph.edge_index
        n, n_edges = graph.n_atoms, graph.n_edges
        # padded edges: [atom_cap - 2, atom_cap - 1] (no host-to-device copy)
        pad_edge = torch.arange(atom_cap - 2, atom_cap, dtype=ei.dtype, device=ei.device)
        edge_index = torch.cat([ei, pad_edge[:, None].expand(2, edge_cap - n_edges)], dim=1)
        rows = torch.arange(max(atom_cap, edge_cap), device=ei.device)
        return PaddedCOO(
            edge_index=edge_index,
            atom_mask=rows[:atom_cap] < n,
            edge_mask=rows[:edge_cap] < n_edges,
            atom_fields=pad_fields(
                graph.atom_fields, atom_cap, self.atom_fill, self.positions_field, self.spacing
            ),
            edge_fields=pad_fields(graph.edge_fields, edge_cap, self.edge_fill),
            n_atoms=n,
            n_edges=n_edges,
            grew=grew,
        )

    def unpad(self, padded: PaddedCOO) -> COOGraph:
        """The real graph of ``padded`` (views of its tensors); local, no communication.

        Raises :class:`~nvdd.core.ValidationError` if ``padded`` is not a
        :class:`PaddedCOO`.
        """
        require_padded("COOPadder.unpad", padded, PaddedCOO)
        n, n_edges = padded.n_atoms, padded.n_edges
        return COOGraph(
            edge_index=padded.edge_index[:, :n_edges],
            n_atoms=n,
            atom_fields={k: v[:n] for k, v in padded.atom_fields.items()},
            edge_fields={k: v[:n_edges] for k, v in padded.edge_fields.items()},
        )
