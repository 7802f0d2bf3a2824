"""`VerletList`: a neighbour list with a skin, rebuilt only when needed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nvdd.core import Batch, TensorMemo, skin_exceeded
from nvdd.models._checks import check_geometry, check_positive, check_receivers, fail
from nvdd.models._neighbors import EdgeList, NeighborList

__all__ = ["VerletList"]


@dataclass(frozen=True)
class _Reference:
    """What the candidate list was built from (the rebuild criterion's memory)."""

    positions: torch.Tensor
    cell: torch.Tensor
    pbc: torch.Tensor
    system_index: torch.Tensor
    atom_ids: torch.Tensor | None
    n_receivers: int | None
    topology: object
    #: The caller's tensors at the build, by name (``cell``, ``pbc``,
    #: ``system_index``, ``atom_ids``): while a call passes the same tensor
    #: unmodified, its comparison (a host read on a GPU) is skipped.
    sources: dict[str, TensorMemo] = field(default_factory=dict)

    def unchanged(self, name: str, tensor: torch.Tensor | None) -> bool:
        """Whether ``tensor`` is the build's tensor ``name``, not modified since."""
        memo = self.sources.get(name)
        return memo is not None and memo.same(tensor)


def _memos(**tensors: torch.Tensor | None) -> dict[str, TensorMemo]:
    """A :class:`~nvdd.core.TensorMemo` of every tensor given."""
    memos = {}
    for name, t in tensors.items():
        if t is not None:
            memos[name] = TensorMemo()
            memos[name].remember(t)
    return memos


def _same(ref: _Reference, name: str, built: torch.Tensor, now: torch.Tensor) -> bool:
    """``now`` equals the build's ``built`` (by identity and version when it is the
    build's tensor, else by value)."""
    return ref.unchanged(name, now) or (built.shape == now.shape and torch.equal(built, now))


class VerletList:
    """A cached neighbour list: candidates at ``cutoff + skin``, filtered each call.

    The candidate list is rebuilt when any of these holds, else reused:

    - some atom moved more than half the skin left since the last build (then a
      pair inside ``cutoff`` now may have been outside ``cutoff + skin`` then).
      Displacements are measured in the frame that follows the cell and a
      strain of the cell eats into the skin (:func:`nvdd.core.skin_exceeded`),
      so a barostat that scales positions with the cell does not force a
      rebuild every step, and a cell change never goes unnoticed; with an
      unchanged cell this is "moved more than ``skin / 2``";
    - the number of rows, the atom ids, ``system_index``, ``pbc``,
      ``n_receivers``, the dtype or the device changed, or a singular cell
      (open boundaries) changed;
    - the caller's ``topology`` token changed (the models pass one that changes
      whenever a domain-decomposition halo plan is rebuilt).

    A NaN or infinite position forces a rebuild, which raises
    :class:`~nvdd.core.ValidationError` (a rebuild synchronises anyway).

    Every call then keeps the candidates with ``|r_ij| < cutoff`` at the current
    positions, so the result equals a fresh :class:`NeighborList` search at
    ``cutoff`` (as a set of ``(i, j, S)``). With ``skin == 0`` the list is rebuilt
    whenever any atom moved at all.

    Parameters
    ----------
    cutoff:
        Interaction cutoff (Angstrom).
    skin:
        Verlet skin (Angstrom), ``>= 0``.

    Attributes
    ----------
    n_builds:
        How many times the candidate list was built.
    rebuilt:
        Whether the last call rebuilt it.
    """

    def __init__(self, cutoff: float, skin: float = 0.0) -> None:
        check_positive("cutoff", cutoff)
        check_positive("skin", skin, allow_zero=True)
        self._cutoff = float(cutoff)
        self._skin = float(skin)
        self._search = NeighborList(self._cutoff + self._skin)
        self._reference: _Reference | None = None
        self._candidates: EdgeList | None = None
        self.n_builds = 0
        self.rebuilt = False

    @property
    def cutoff(self) -> float:
        """The interaction cutoff (edges returned have ``|r_ij| < cutoff``)."""
        return self._cutoff

    @property
    def skin(self) -> float:
        """The Verlet skin."""
        return self._skin

    @property
    def candidates(self) -> EdgeList | None:
        """The cached candidate list at ``cutoff + skin`` (None before the first call)."""
        return self._candidates

    def __repr__(self) -> str:
        return f"VerletList(cutoff={self._cutoff}, skin={self._skin}, n_builds={self.n_builds})"

    def reset(self) -> None:
        """Forget the cached list; the next call rebuilds."""
        self._reference = None
        self._candidates = None

    def __call__(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        pbc: torch.Tensor,
        system_index: torch.Tensor,
        *,
        atom_ids: torch.Tensor | None = None,
        n_receivers: int | None = None,
        topology: object = None,
        filtered: bool = True,
    ) -> EdgeList:
        """The edges within ``cutoff`` at ``positions`` (see :class:`NeighborList`).

        Parameters
        ----------
        positions, cell, pbc, system_index:
            As for :meth:`NeighborList.__call__`.
        atom_ids:
            Int64, shape ``(n_atoms,)``: global atom ids. When given, a change of
            ids (a reordering or a migration) forces a rebuild.
        n_receivers:
            Keep only edges whose receiver ``i < n_receivers``.
        topology:
            Any value compared with ``==``: a change forces a rebuild (e.g. the
            generation of a halo plan: its rows are other atoms).
        filtered:
            False: return the candidate list itself (every pair within ``cutoff +
            skin`` at the last build, the same object until the next build), for a
            caller that keeps its own layout of it and filters it at ``cutoff``.
        """
        fail(check_geometry(positions, cell, pbc, system_index))
        fail(check_receivers(n_receivers, int(positions.shape[0])))
        with torch.no_grad():
            pos = positions.detach()
            self.rebuilt = self._reference is None or self._reference.topology != topology
            self.rebuilt = self.rebuilt or self._needs_rebuild(
                pos, cell, pbc, system_index, atom_ids, n_receivers
            )
            if self.rebuilt:
                if pos.numel() and not bool(torch.isfinite(pos).all()):
                    fail(
                        f"positions hold NaN or infinite values (rows "
                        f"{(~torch.isfinite(pos).all(dim=1)).nonzero().squeeze(1)[:8].tolist()}"
                        f", shape {tuple(pos.shape)})"
                    )
                self._candidates = self._search(
                    pos, cell.detach(), pbc, system_index, n_receivers=n_receivers
                )
                self._reference = _Reference(
                    positions=pos.clone(),
                    cell=cell.detach().clone(),
                    pbc=pbc.clone(),
                    system_index=system_index.clone(),
                    atom_ids=None if atom_ids is None else atom_ids.clone(),
                    n_receivers=n_receivers,
                    topology=topology,
                    sources=_memos(
                        cell=cell, pbc=pbc, system_index=system_index, atom_ids=atom_ids
                    ),
                )
                self.n_builds += 1
            candidates = self._candidates
            if candidates is None:  # pragma: no cover - set on the first call
                raise RuntimeError("VerletList: no candidate list after a build")
            if self._skin == 0.0 or not filtered:
                return candidates
            r = candidates.vectors(pos, cell.detach(), system_index)
            keep = (r * r).sum(dim=1) < self._cutoff * self._cutoff
            return candidates.select(keep)

    def for_batch(
        self,
        batch: Batch,
        *,
        n_receivers: int | None = None,
        topology: object = None,
        filtered: bool = True,
    ) -> EdgeList:
        """:meth:`__call__` on ``batch``'s positions, cell, pbc, system index and
        atom ids."""
        return self(
            batch.positions,
            batch.cell,
            batch.pbc,
            batch.system_index,
            atom_ids=batch.atom_ids,
            n_receivers=n_receivers,
            topology=topology,
            filtered=filtered,
        )

    def _needs_rebuild(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        pbc: torch.Tensor,
        system_index: torch.Tensor,
        atom_ids: torch.Tensor | None,
        n_receivers: int | None,
    ) -> bool:
        ref = self._reference
        if ref is None or self._candidates is None:
            return True
        if (
            ref.positions.shape != positions.shape
            or ref.positions.dtype != positions.dtype
            or ref.positions.device != positions.device
            or ref.n_receivers != n_receivers
            or ref.cell.shape != cell.shape
            or (ref.atom_ids is None) != (atom_ids is None)
        ):
            return True
        if not (
            _same(ref, "pbc", ref.pbc, pbc)
            and _same(ref, "system_index", ref.system_index, system_index)
        ):
            return True
        if (
            atom_ids is not None
            and ref.atom_ids is not None
            and not _same(ref, "atom_ids", ref.atom_ids, atom_ids)
        ):
            return True
        if positions.shape[0] == 0:
            return False
        exceeded = skin_exceeded(
            positions,
            ref.positions,
            system_index,
            ref.cell,
            cell.detach(),
            cutoff=self._cutoff,
            skin=self._skin,
            same_cell=ref.unchanged("cell", cell),
        )
        # a NaN displacement never exceeds a threshold: rebuild (and the build raises)
        return bool(exceeded | ~torch.isfinite(positions).all())
