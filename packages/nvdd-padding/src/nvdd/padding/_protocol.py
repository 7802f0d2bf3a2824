"""The padder protocol and the rule that keeps padding inert.

The padding rule (every padder follows it)
------------------------------------------
1. **Prefix layout.** Real rows come first, unchanged and in order: real atom
   ``i`` is padded row ``i``, real edge / neighbour slot ``e`` keeps its place.
   The real part of any padded per-atom result is its first ``n_atoms`` rows
   (``padded.real_atoms(x)``), so a padded row can never be mistaken for a real
   one.
2. **Padding touches only padding.** Every padding entry of an index tensor
   points at a padding atom row (always reserved: ``atom_cap > n_atoms``): padded
   COO edges join the last two rows, padded neighbour slots hold the last row.
   A gather along a padded edge reads only padding rows and a scatter along it
   writes only padding rows, so message passing cannot carry padding into a real
   row. Dense padders also put padding atoms in a padding system.
3. **Padding atoms are far away and featureless.** Their positions are placed at
   least ``spacing`` (default 100 Angstrom) from every real atom and from each
   other, so any pair involving one lies beyond a model's cutoff; every other
   padded value is 0 (or the padder's per-field fill), so charges, embeddings'
   inputs and weights of padding are zero.
4. **Masks for everything else.** ``atom_mask`` / ``edge_mask`` /
   ``neighbor_mask`` / ``system_mask`` are True on real entries. A model must use
   them (``torch.where``, not a multiply, where a padding value could be inf or
   nan) for any reduction over all rows, such as a total energy, and must not
   give padding rows a non-zero self term outside a mask. Pass the masks into a
   compiled function, never the real counts: a Python int argument is
   specialised and would recompile whenever it changes.

With 1-4, gathering the real rows of a padded result gives bit-for-bit the
values of the unpadded computation for per-row gathers and scatters (the same
additions in the same order); reductions whose length changes may differ in the
last bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nvdd.padding._cap import CapacityRegistry

__all__ = ["GraphPadder", "PaddedGraph"]


@runtime_checkable
class PaddedGraph(Protocol):
    """What every padded graph offers, whatever its layout.

    Attributes
    ----------
    n_atoms:
        Real atoms (the first ``n_atoms`` rows).
    atom_mask:
        Bool, shape ``(atom_cap,)``: True on real atoms.
    atom_fields:
        Per-atom tensors, each of shape ``(atom_cap, ...)``.
    grew:
        True when this ``pad`` changed a capacity (new shapes: a compiled model
        recompiles once).
    """

    @property
    def n_atoms(self) -> int:
        """Real atoms (the first ``n_atoms`` rows)."""
        ...

    @property
    def atom_mask(self) -> torch.Tensor:
        """Bool, shape ``(atom_cap,)``: True on real atoms."""
        ...

    @property
    def atom_fields(self) -> Mapping[str, torch.Tensor]:
        """Per-atom tensors, each of shape ``(atom_cap, ...)``."""
        ...

    @property
    def grew(self) -> bool:
        """True when this ``pad`` changed a capacity (a compiled model recompiles once)."""
        ...

    @property
    def atom_cap(self) -> int:
        """The padded atom count (rows of every per-atom tensor)."""
        ...

    def real_atoms(self, x: torch.Tensor) -> torch.Tensor:
        """The real rows of a padded per-atom tensor: shape ``(atom_cap, ...)`` to
        ``(n_atoms, ...)`` (a view)."""
        ...


GraphT = TypeVar("GraphT")
PaddedT = TypeVar("PaddedT", bound=PaddedGraph)


@runtime_checkable
class GraphPadder(Protocol[GraphT, PaddedT]):
    """How a model's graph representation is padded to a fixed capacity.

    A padder turns a graph of drifting size (``GraphT``: atoms, edges or
    neighbour slots, systems) into tensors of stable padded sizes (``PaddedT``)
    that follow the padding rule of this module, so a compiled forward is reused
    while the real counts stay within capacity. Capacities come from
    :func:`~nvdd.padding.resolve_cap` and live in :attr:`registry`.

    Implementations: :class:`~nvdd.padding.COOPadder`,
    :class:`~nvdd.padding.DensePadder`, :class:`~nvdd.padding.DenseBatchPadder`.
    """

    @property
    def registry(self) -> CapacityRegistry:
        """Where this padder's capacities (and their growth history) live."""
        ...

    def pad(self, graph: GraphT, *, group: ProcessGroup | None = None) -> PaddedT:
        """Pad ``graph`` to the current capacities (growing them if needed).

        **Collective** over ``group`` when one is given: one all-reduce; every
        rank of ``group`` must call ``pad`` of the same padder, in the same order.
        Bad input on any rank raises :class:`~nvdd.core.ValidationError` on all.
        """
        ...

    def unpad(self, padded: PaddedT) -> GraphT:
        """Recover the real graph: ``unpad(pad(g))`` equals ``g`` (padding slots
        of an index tensor hold ``g``'s fill value)."""
        ...
