"""`SpatialPartitioner`: rank grid, sub-domain boxes, ownership and hysteresis.

On top of its helpers: ``_state`` (the frozen state) < ``_state_io`` (as JSON)
and ``_migrate_kernel`` (the migration, which reads a partitioner through its
``Partitioner`` protocol) < this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from nvdd.core import (
    Batch,
    ConfigurationError,
    ValidationError,
    broadcast_object,
    get_rank,
    get_world_size,
)
from nvdd.partition._build import (
    BalanceMode,
    Grid,
    as_cell,
    choose,
    extent,
    finite_float,
    grids,
    imbalance_of,
    make_table,
    positive_int,
    split_positions,
)
from nvdd.partition._cuts import explicit_table
from nvdd.partition._degenerate import coverage_reasons, empty_rank_reasons
from nvdd.partition._geometry import (
    build_domain_cell,
    face_tolerance,
    fractional,
    interplanar_spacings,
    lattice_shifts,
    owner_fractional,
    wrap_fractional,
)
from nvdd.partition._migrate_kernel import kernel_destinations, torch_destinations
from nvdd.partition._state import _State
from nvdd.partition._state_io import state_from_dict, state_to_dict

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nvdd.halo import ParticleHaloConfig

__all__ = ["BalanceMode", "SpatialPartitioner"]


class SpatialPartitioner:
    """Assigns atoms to spatial sub-domains on a rank grid ``P0 x P1 x P2``.

    Boxes are boxes of fractional coordinates of the *domain cell* (the cell with a
    synthetic vector on open axes that have none; see :meth:`domain_cell`): on a
    periodic axis they tile ``[0, 1)``, on an open axis the whole real line (the
    outermost boxes reach ``-inf`` / ``+inf``). Every system of a batch is split
    over all ranks: rank ``r`` owns box ``r`` of every system. Construction is
    local (no communication) and deterministic: equal inputs give equal boxes on
    every rank; :meth:`broadcast` copies one rank's partitioner to all.

    Parameters
    ----------
    cell:
        Shape ``(n_systems, 3, 3)`` or ``(3, 3)``; rows are lattice vectors.
    pbc:
        Bool, shape ``(n_systems, 3)`` or ``(3,)``.
    world_size:
        Number of ranks (boxes per system).
    ghost_width:
        Halo width in Angstrom (``cutoff + skin``), > 0.
    grid_dims:
        ``(P0, P1, P2)`` used verbatim for every system, or one triple per
        system; default: chosen per system to minimise the halo (see the
        package docs).
    positions, system_index:
        Shape ``(n_atoms, 3)`` and ``(n_atoms,)``: the atoms, to score grids,
        place cuts on open axes, size synthetic vectors and balance the load.
    balance:
        :class:`BalanceMode`; ``QUANTILE`` needs positions.
    cuts:
        Explicit internal cuts (fractional) per axis, the same for every system:
        three sequences; excludes ``grid_dims`` and ``QUANTILE``.
    skin:
        The Verlet skin (Angstrom); when given, hysteresis must stay below it.
    require_nondegenerate:
        Raise instead of warn on a degenerate partition (see :meth:`degeneracies`).

    Raises
    ------
    ConfigurationError
        Bad numbers, a grid whose product differs from ``world_size``, cuts that do
        not tile, ``QUANTILE`` without positions.
    ValidationError
        Malformed cell, pbc or positions, a singular periodic cell, or a system
        without atoms when positions are given.
    """

    __slots__ = ("_boxes", "_halo_configs", "_on_device", "_s")

    def __init__(
        self,
        cell: torch.Tensor | Sequence[Any],
        pbc: torch.Tensor | Sequence[Any],
        world_size: int,
        ghost_width: float,
        *,
        grid_dims: Sequence[int] | Sequence[Sequence[int]] | None = None,
        positions: torch.Tensor | None = None,
        system_index: torch.Tensor | None = None,
        balance: BalanceMode = BalanceMode.UNIFORM,
        cuts: Sequence[Sequence[float]] | None = None,
        skin: float | None = None,
        require_nondegenerate: bool = False,
    ) -> None:
        world = positive_int("world_size", world_size)
        g = finite_float("ghost_width", ghost_width, positive=True)
        skin_v = None if skin is None else finite_float("skin", skin, positive=False)
        if not isinstance(balance, BalanceMode):
            raise ConfigurationError(f"balance must be a BalanceMode, got {balance!r}")
        cell_t = as_cell(cell)
        n_sys = int(cell_t.shape[0])
        pbc_t = torch.as_tensor(pbc).detach().cpu()
        if pbc_t.dtype != torch.bool:
            raise ValidationError(f"pbc must be bool, got {pbc_t.dtype}")
        if pbc_t.ndim == 1 and pbc_t.shape == (3,):
            pbc_t = pbc_t.unsqueeze(0).expand(n_sys, 3).clone()
        if pbc_t.shape != (n_sys, 3):
            raise ValidationError(f"pbc has shape {tuple(pbc_t.shape)}, expected ({n_sys}, 3)")
        grid_list = grids(grid_dims, n_sys, world)
        if cuts is not None and grid_dims is not None:
            raise ConfigurationError("pass either cuts or grid_dims, not both")
        if cuts is not None and balance is BalanceMode.QUANTILE:
            raise ConfigurationError("explicit cuts exclude balance=BalanceMode.QUANTILE")
        if balance is BalanceMode.QUANTILE and positions is None:
            raise ConfigurationError("balance=BalanceMode.QUANTILE needs positions")
        per_sys = split_positions(positions, system_index, n_sys)

        domains, synth, extents, tables = [], [], [], []
        for s in range(n_sys):
            pos_s = None if per_sys is None else per_sys[s]
            dc, syn = build_domain_cell(cell_t[s], pbc_t[s], pos_s)
            periodic = [bool(x) for x in pbc_t[s]]
            frac_s = None
            if pos_s is not None:
                inv = torch.linalg.inv(dc).unsqueeze(0)
                raw = fractional(pos_s, torch.zeros(len(pos_s), dtype=torch.int64), inv)
                frac_s = wrap_fractional(raw, pbc_t[s])
            ext = extent(frac_s, periodic, syn)
            spacing = interplanar_spacings(dc.unsqueeze(0))[0]
            if cuts is not None:
                tab = explicit_table(cuts, periodic, s)
                if tab.n_boxes != world:
                    raise ConfigurationError(
                        f"cuts give a {tab.grid} grid of {tab.n_boxes} boxes but the world "
                        f"size is {world}"
                    )
            else:
                grid = grid_list[s] or choose(world, periodic, ext, spacing, g, frac_s, balance, s)
                for a in range(3):
                    if grid[a] > 1 and not bool(torch.isfinite(ext[:, a]).all()):
                        raise ConfigurationError(
                            f"system {s}: grid {grid} cuts open axis {a}, which has no cell "
                            "vector and no atoms to measure: pass positions"
                        )
                tab = make_table(grid, periodic, ext, frac_s, balance)
            tab.check(periodic, s)
            domains.append(dc)
            synth.append(syn)
            extents.append(ext)
            tables.append(tab)
        state = _State(
            cell=cell_t.cpu(),
            pbc=pbc_t,
            domain=torch.stack(domains),
            synthetic=torch.stack(synth),
            extent=torch.stack(extents),
            tables=tuple(tables),
            world_size=world,
            ghost_width=g,
            skin=skin_v,
            balance=balance,
            require_nondegenerate=bool(require_nondegenerate),
            build_counts=None,
        )
        self._set(state)
        if positions is not None:
            counts = self.owned_counts(positions, system_index)
            self._set(_replace_counts(state, counts.cpu()))

    def _set(self, state: _State) -> None:
        self._s = state
        self._boxes = torch.stack([t.boxes() for t in state.tables])
        # (domain, pbc) copied to a device and dtype once per state: a copy from
        # host memory each step would make a GPU wait for the host (domain_cell)
        # (and the cut table of one system: keys (device, "cuts"), (device, "migration"))
        self._on_device: dict[tuple[torch.device, object], tuple[torch.Tensor, ...]] = {}
        # per (group, wrap_whole_axes)
        self._halo_configs: dict[tuple[object, bool], ParticleHaloConfig] = {}

    def __getstate__(self) -> dict[str, _State]:
        """Only the state travels: the boxes are derived, the device copies belong
        to this process's devices (elsewhere they would land on another's GPU)."""
        return {"state": self._s}

    def __setstate__(self, data: dict[str, _State]) -> None:
        self._set(data["state"])

    def _domain_on(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(domain, pbc, boxes)`` of the state on ``device`` (domain in ``dtype``,
        boxes in float64), cached: a copy from host memory makes a GPU stream wait."""
        key = (device, dtype)
        found = self._on_device.get(key)
        if found is None:
            found = (
                self._s.domain.to(device=device, dtype=dtype),
                self._s.pbc.to(device),
                self._boxes.to(device=device, dtype=torch.float64),
            )
            self._on_device[key] = found
        return found

    def _inverse_domain(self, cell: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """``inv(domain_cell(cell))`` in float64 on ``device``: ``inv_ex`` (no error
        check, no host read on a GPU; the domain cell is non-singular)."""
        dc = self.domain_cell(cell).to(device, torch.float64)
        inverse: torch.Tensor = torch.linalg.inv_ex(dc).inverse
        return inverse

    @classmethod
    def _from_state(cls, state: _State) -> SpatialPartitioner:
        new = cls.__new__(cls)
        new._set(state)
        return new

    @classmethod
    def from_batch(
        cls, batch: Batch, world_size: int, ghost_width: float, **kwargs: Any
    ) -> SpatialPartitioner:
        """A partitioner for ``batch``'s cell, pbc and atoms (local, no communication).

        ``kwargs`` are the keyword arguments of the constructor (``grid_dims``,
        ``balance``, ``cuts``, ``skin``, ``require_nondegenerate``).
        """
        if not isinstance(batch, Batch):
            raise ValidationError(f"from_batch needs a Batch, got {type(batch).__name__}")
        return cls(
            batch.cell,
            batch.pbc,
            world_size,
            ghost_width,
            positions=batch.positions,
            system_index=batch.system_index,
            **kwargs,
        )

    @classmethod
    def broadcast(
        cls,
        partitioner: SpatialPartitioner | None,
        src: int = 0,
        group: ProcessGroup | None = None,
    ) -> SpatialPartitioner:
        """The partitioner of rank ``src``, on every rank.

        **Collective** over ``group`` (default group): every rank calls it; only
        ``src``'s argument is used (others may pass None). One
        ``broadcast_object_list`` of the partitioner's state (a few hundred bytes
        per rank of the grid).

        Raises
        ------
        ConfigurationError
            On every rank, if ``src`` passed None or its world size differs from
            the group's.
        """
        world, rank = get_world_size(group), get_rank(group)
        mine = partitioner._s if isinstance(partitioner, SpatialPartitioner) else None
        state = broadcast_object(mine if rank == src else None, src, group)
        if not isinstance(state, _State):
            raise ConfigurationError(f"rank {src}: broadcast needs a SpatialPartitioner on src")
        if state.world_size != world:
            raise ConfigurationError(
                f"rank {src}: the partitioner has {state.world_size} boxes per system but the "
                f"group has {world} ranks"
            )
        if rank == src and isinstance(partitioner, SpatialPartitioner):
            return partitioner
        return cls._from_state(state)

    # ------------------------------------------------------------------ basics
    @property
    def world_size(self) -> int:
        """Number of ranks (boxes per system)."""
        return self._s.world_size

    @property
    def n_systems(self) -> int:
        """Number of systems partitioned."""
        return int(self._s.cell.shape[0])

    @property
    def ghost_width(self) -> float:
        """Halo width in Angstrom."""
        return self._s.ghost_width

    @property
    def skin(self) -> float | None:
        """The Verlet skin (Angstrom) hysteresis must stay below, if given."""
        return self._s.skin

    @property
    def balance(self) -> BalanceMode:
        """How the cuts were placed."""
        return self._s.balance

    @property
    def require_nondegenerate(self) -> bool:
        """Whether a degenerate partition raises instead of warning."""
        return self._s.require_nondegenerate

    @property
    def pbc(self) -> torch.Tensor:
        """Bool, shape ``(n_systems, 3)``."""
        return self._s.pbc.clone()

    @property
    def grid_dims(self) -> tuple[Grid, ...]:
        """The rank grid ``(P0, P1, P2)`` of every system (one triple per system)."""
        return tuple(t.grid for t in self._s.tables)

    @property
    def boxes(self) -> torch.Tensor:
        """float64, shape ``(n_systems, world_size, 2, 3)``: per system and rank the
        fractional box ``[lo, hi)`` (row 0 lo, row 1 hi) of the domain cell."""
        return self._boxes.clone()

    def domain_cell(self, cell: torch.Tensor | None = None) -> torch.Tensor:
        """The cell the boxes are fractions of: non-singular on all three axes.

        Periodic rows are those of ``cell`` (so a changing cell, e.g. under NPT,
        is followed); open-axis rows are fixed at construction (the given vector
        when usable, else a synthetic one normal to the others, of the atoms'
        extent). Image shifts only ever use periodic rows.

        Parameters
        ----------
        cell:
            Shape ``(n_systems, 3, 3)`` or ``(3, 3)``; default: the construction cell.

        Returns
        -------
        torch.Tensor
            Shape ``(n_systems, 3, 3)``, dtype and device of ``cell`` (float64 on
            CPU without one).
        """
        if cell is None:
            return self._s.domain.clone()
        if not isinstance(cell, torch.Tensor):
            raise ValidationError(f"cell must be a torch.Tensor, got {type(cell).__name__}")
        c = cell.unsqueeze(0) if cell.ndim == 2 else cell
        if c.shape != (self.n_systems, 3, 3):
            raise ValidationError(
                f"cell has shape {tuple(cell.shape)}, expected ({self.n_systems}, 3, 3)"
            )
        dom, pbc, _ = self._domain_on(c.device, c.dtype)
        return torch.where(pbc.unsqueeze(-1), c, dom)

    def ghost_frac(self, cell: torch.Tensor | None = None) -> torch.Tensor:
        """The ghost width in fractional units per system and axis, float64
        shape ``(n_systems, 3)`` on the CPU, like every box of the partitioner
        (``ghost_width / interplanar spacing``; ``cell`` may live on any device)."""
        host = None if cell is None else cell.detach().to("cpu", torch.float64)
        return self.ghost_width / interplanar_spacings(self.domain_cell(host))

    def __repr__(self) -> str:
        return (
            f"SpatialPartitioner(world_size={self.world_size}, grid_dims={list(self.grid_dims)}, "
            f"ghost_width={self.ghost_width}, balance={self.balance.name}, "
            f"pbc={self._s.pbc.tolist()})"
        )

    # ------------------------------------------------------------- ownership
    def _inputs(
        self, positions: torch.Tensor, system_index: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            not isinstance(positions, torch.Tensor)
            or positions.ndim != 2
            or positions.shape[1] != 3
        ):
            shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else positions
            raise ValidationError(f"positions has shape {shape}, expected (n_atoms, 3)")
        n = int(positions.shape[0])
        if system_index is None:
            if self.n_systems != 1:
                raise ValidationError(f"system_index is required with {self.n_systems} systems")
            system_index = torch.zeros(n, dtype=torch.int64, device=positions.device)
        if system_index.shape != (n,):
            raise ValidationError(
                f"system_index has shape {tuple(system_index.shape)}, expected ({n},)"
            )
        return positions, system_index.to(positions.device, torch.int64)

    def fractional(
        self,
        positions: torch.Tensor,
        system_index: torch.Tensor | None = None,
        *,
        cell: torch.Tensor | None = None,
        wrap: bool = True,
    ) -> torch.Tensor:
        """Fractional coordinates in the domain cell, float64 shape ``(n_atoms, 3)``,
        wrapped into ``[0, 1)`` on periodic axes when ``wrap``."""
        positions, si = self._inputs(positions, system_index)
        if wrap:
            return self._frac(positions, si, cell)
        return fractional(positions, si, self._inverse_domain(cell, positions.device))

    def owner_of(
        self,
        positions: torch.Tensor,
        system_index: torch.Tensor | None = None,
        *,
        cell: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The rank owning each position.

        Parameters
        ----------
        positions:
            Shape ``(n_atoms, 3)``, finite; any floating dtype (the test runs in
            float64, so the owner does not depend on the storage dtype).
            Periodic axes are wrapped first.
        system_index:
            int64, shape ``(n_atoms,)``; optional with one system.
        cell:
            The current cell (periodic rows); default: the construction cell.

        Returns
        -------
        torch.Tensor
            int64, shape ``(n_atoms,)``, on the device of ``positions``. A point on
            a cut belongs to the box above it.
        """
        positions, si = self._inputs(positions, system_index)
        return self._locate(self._frac(positions, si, cell), si)

    def _frac(
        self,
        positions: torch.Tensor,
        si: torch.Tensor,
        cell: torch.Tensor | None,
        *,
        wrapped: bool = False,
    ) -> torch.Tensor:
        """Fractional coordinates of the positions as :meth:`wrap_positions` stores
        them (``wrapped``: they already are), in ``[0, 1)`` on periodic axes: the
        owner's box is the one that holds the stored position."""
        if not wrapped:
            positions = self.wrap_positions(positions, si, cell=cell)
        frac = fractional(positions, si, self._inverse_domain(cell, positions.device))
        pbc = self._domain_on(positions.device, torch.float64)[1]
        return owner_fractional(frac, pbc[0] if self.n_systems == 1 else pbc[si])

    def _locate(self, frac: torch.Tensor, si: torch.Tensor) -> torch.Tensor:
        if self.n_systems == 1:
            key, table = (frac.device, "cuts"), self._s.tables[0]
            inner = self._on_device.get(key) or table.inner_cuts(frac.device)
            self._on_device[key] = inner
            return table.locate(frac, inner)
        out = torch.empty(frac.shape[0], dtype=torch.int64, device=frac.device)
        order = torch.argsort(si, stable=True)
        counts = torch.bincount(si, minlength=self.n_systems).tolist()
        for s, rows in enumerate(torch.split(order, counts)):
            if rows.numel():
                out[rows] = self._s.tables[s].locate(frac[rows])
        return out

    def _keeps(
        self,
        frac: torch.Tensor,
        si: torch.Tensor,
        owner: torch.Tensor | int,
        h: float,
        cell: torch.Tensor | None,
    ) -> torch.Tensor:
        """Whether each atom lies inside its owner's box grown by ``h`` (``owner``:
        per atom, or one rank for every atom, whose box then broadcasts)."""
        dev = frac.device
        _, periodic, boxes = self._domain_on(dev, torch.float64)
        # h / interplanar spacing, with the spacing's own rounding (1 / |inv[:, a]|)
        grow = h / (1.0 / torch.linalg.vector_norm(self._inverse_domain(cell, dev), dim=1))
        if self.n_systems == 1 and isinstance(owner, int):
            box = boxes[0, owner]  # (2, 3): broadcasts, no per-atom copy
        else:
            box = boxes.view(-1, 2, 3).index_select(0, si * self.world_size + owner)
        if self.n_systems == 1:
            grow, periodic = grow[0], periodic[0]  # broadcast
        else:
            grow, periodic = grow[si], periodic[si]
        lo = box[..., 0, :] - grow
        hi = box[..., 1, :] + grow
        inside = (frac >= lo) & (frac < hi)
        if h > 0.0:
            # Across a periodic face a grown box reaches round to the other side (with
            # h = 0 it cannot: wrapped points and boxes both lie in [0, 1)).
            for shift in (-1.0, 1.0):
                inside |= periodic & (frac + shift >= lo) & (frac + shift < hi)
        kept: torch.Tensor = inside.all(dim=1)
        return kept

    def _destinations(
        self,
        positions: torch.Tensor,
        si: torch.Tensor,
        rank: int,
        h: float,
        cell: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(wrapped positions, new owner) of atoms owned by ``rank``: ``rank`` while
        they stay inside its box grown by ``h``, else the owner of their position;
        a non-finite row keeps its position and ``rank``. One system: one Warp
        kernel; more: torch operations (``_migrate_kernel``). No host read (on a
        GPU the rebuild's migration queues its kernels without waiting)."""
        if self.n_systems == 1:
            return kernel_destinations(self, positions, rank, h, cell)
        return torch_destinations(self, positions, si, rank, h, cell)

    def check_hysteresis(self, hysteresis: float) -> float:
        """``hysteresis`` as a float if it is finite, >= 0 and below the skin (when a
        skin was given); else ConfigurationError naming both values."""
        h = finite_float("hysteresis", hysteresis, positive=False)
        if self.skin is not None and h >= self.skin:
            raise ConfigurationError(
                f"hysteresis {h} must be below the skin {self.skin} (an atom may stay up to "
                "the hysteresis outside its box)"
            )
        return h

    def keeps_owner(
        self,
        positions: torch.Tensor,
        system_index: torch.Tensor | None,
        current_owner: torch.Tensor,
        hysteresis: float,
        *,
        cell: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Whether each atom stays with ``current_owner``.

        An atom stays while it is inside its current owner's box grown by
        ``hysteresis`` (Angstrom, converted per axis with the interplanar
        spacings, so triclinic cells are right) on every side; periodic axes wrap.
        With ``hysteresis=0`` this is exactly ``owner_of(...) == current_owner``.

        Returns
        -------
        torch.Tensor
            bool, shape ``(n_atoms,)``.
        """
        h = self.check_hysteresis(hysteresis)
        positions, si = self._inputs(positions, system_index)
        frac = self._frac(positions, si, cell)
        owner = current_owner.to(frac.device, torch.int64)
        if owner.shape != si.shape:
            raise ValidationError(
                f"current_owner has shape {tuple(current_owner.shape)}, expected {tuple(si.shape)}"
            )
        if owner.numel() and bool(((owner < 0) | (owner >= self.world_size)).any()):
            bad = int(owner[(owner < 0) | (owner >= self.world_size)][0])
            raise ValidationError(f"current_owner has {bad}, expected 0..{self.world_size - 1}")
        return self._keeps(frac, si, owner, h, cell)

    def wrap_positions(
        self,
        positions: torch.Tensor,
        system_index: torch.Tensor | None = None,
        *,
        cell: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Positions moved by lattice vectors into the cell on periodic axes.

        Same dtype and device; an atom already inside, or below a lower face by
        no more than rounding, is returned bit for bit. Two passes of
        ``geometry.lattice_shifts``: a move can round onto the upper face
        (``frac = 2 - 1e-16`` lands on 1), which the second pass takes to 0; so
        wrapping twice is wrapping once.
        """
        positions, si = self._inputs(positions, system_index)
        dc = self.domain_cell(cell).to(positions.device, torch.float64)
        inv = self._inverse_domain(cell, positions.device)
        pbc = self._domain_on(positions.device, torch.float64)[1]
        periodic = pbc[0] if self.n_systems == 1 else pbc[si]
        tol = face_tolerance(positions.dtype)
        for _ in range(2):
            shift = lattice_shifts(fractional(positions, si, inv), periodic, tol)
            if self.n_systems == 1:
                delta = shift @ dc[0]
            else:
                delta = torch.bmm(shift.unsqueeze(1), dc[si]).squeeze(1)
            positions = positions - delta.to(positions.dtype)
        return positions

    # ------------------------------------------------------------- reporting
    def owned_counts(
        self,
        positions: torch.Tensor,
        system_index: torch.Tensor | None = None,
        *,
        cell: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """How many of these atoms each rank owns, int64 shape ``(world_size,)``."""
        owner = self.owner_of(positions, system_index, cell=cell)
        return torch.bincount(owner, minlength=self.world_size)

    def imbalance(
        self,
        positions: torch.Tensor | None = None,
        system_index: torch.Tensor | None = None,
    ) -> float:
        """Load imbalance ``max / mean`` of the owned counts (1.0 is perfect).

        Of the given atoms, or without arguments of the atoms the partitioner was
        built with. Raises ConfigurationError when it was built without atoms and
        none are given.
        """
        if positions is not None:
            counts = self.owned_counts(positions, system_index)
        elif self._s.build_counts is not None:
            counts = self._s.build_counts
        else:
            raise ConfigurationError("imbalance() needs positions: none were given at construction")
        return imbalance_of(counts.tolist())

    def rebuilt(
        self,
        positions: torch.Tensor,
        system_index: torch.Tensor | None = None,
        *,
        cell: torch.Tensor | None = None,
        balance: BalanceMode = BalanceMode.QUANTILE,
        grid_dims: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> SpatialPartitioner:
        """A new partitioner with this one's pbc, world size, ghost width, skin and
        degeneracy policy, built on these atoms (local, no communication).

        Parameters
        ----------
        positions, system_index:
            Every atom of every system (e.g. gathered for a rebalance).
        cell:
            The current cell (default: the construction cell).
        balance:
            Default ``QUANTILE``: re-cut at the atoms' quantiles.
        grid_dims:
            Default: chosen again for these atoms.
        """
        return SpatialPartitioner(
            self._s.cell if cell is None else cell,
            self._s.pbc,
            self.world_size,
            self.ghost_width,
            grid_dims=grid_dims,
            positions=positions,
            system_index=system_index,
            balance=balance,
            skin=self.skin,
            require_nondegenerate=self.require_nondegenerate,
        )

    def degeneracies(
        self, owned_counts: Sequence[int] | None = None, *, cell: torch.Tensor | None = None
    ) -> list[str]:
        """Why this partition is degenerate (empty when it is not).

        A system is degenerate when every box grown by the ghost width covers it
        (every rank holds every atom); the partition is when a rank owns no atom
        (from ``owned_counts``, default the construction counts if any).
        """
        counts = owned_counts
        if counts is None and self._s.build_counts is not None:
            counts = self._s.build_counts.tolist()
        reasons = coverage_reasons(
            self._boxes, self._s.pbc, self.ghost_frac(cell), self._s.extent, self.ghost_width
        )
        if counts is not None:
            reasons += empty_rank_reasons(counts)
        return reasons

    def to_dict(self) -> dict[str, Any]:
        """This partitioner as JSON-able data (lists, numbers, strings); local.

        :meth:`from_dict` rebuilds it with the same :meth:`fingerprint` (checkpoints
        store it to restart with exactly these boxes).
        """
        return state_to_dict(self._s)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpatialPartitioner:
        """The partitioner :meth:`to_dict` described; local.

        Raises
        ------
        ValidationError
            When ``data`` is not such a description.
        """
        return cls._from_state(state_from_dict(data))

    def fingerprint(self) -> int:
        """A 62-bit digest of everything that decides ownership (boxes, pbc, domain
        cell, ghost width, skin): equal on two ranks exactly when their partitioners
        assign every position alike. Comparable across processes."""
        h = hashlib.blake2b(digest_size=8)
        for t in (self._boxes, self._s.pbc, self._s.domain):
            h.update(t.contiguous().numpy().tobytes())
        h.update(repr((self.world_size, self.ghost_width, self.skin)).encode())
        return int.from_bytes(h.digest(), "little") & ((1 << 62) - 1)

    @property
    def whole_axes(self) -> torch.Tensor:
        """Bool, shape ``(n_systems, 3)``: the periodic axes the rank grid leaves
        whole (every box spans ``[0, 1)`` along them). A halo may leave their
        periodicity to the model (``halo_config(wrap_whole_axes=True)``)."""
        b = self._boxes
        spans = ((b[:, :, 0, :] == 0.0) & (b[:, :, 1, :] == 1.0)).all(dim=1)
        return spans & self._s.pbc

    def halo_config(
        self, group: ProcessGroup | None = None, *, wrap_whole_axes: bool = False
    ) -> ParticleHaloConfig:
        """The :class:`nvdd.halo.ParticleHaloConfig` of these boxes (made and checked
        once per group: every halo rebuild asks). Build the halo plan with
        ``cell=self.domain_cell(batch.cell)``.

        ``wrap_whole_axes``: leave the periodicity of the :attr:`whole_axes` to
        the model (``ParticleHaloConfig.wrapped``): no image rows along them.
        """
        from nvdd.halo import ParticleHaloConfig

        key = (group, bool(wrap_whole_axes))
        if key not in self._halo_configs:
            world = get_world_size(group)
            if world != self.world_size:
                raise ConfigurationError(
                    f"the partitioner has {self.world_size} boxes per system but the group "
                    f"has {world} ranks"
                )
            self._halo_configs[key] = ParticleHaloConfig(
                boxes=self.boxes,
                pbc=self.pbc,
                ghost_width=self.ghost_width,
                group=group,
                wrapped=self.whole_axes if wrap_whole_axes else None,
            )
        return self._halo_configs[key]


def _replace_counts(state: _State, counts: torch.Tensor) -> _State:
    return replace(state, build_counts=counts)
