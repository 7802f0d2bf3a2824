"""The models' shape-stable compiled core (``BaseModelMixin.compile_forward``).

A model's ``forward`` stays eager around its compiled tensor code:

- eager: input checks, the neighbour search, every DD verb (``refresh_neighbors``
  between layers, ``system_sum`` of the energy), the autograd call;
- compiled (:meth:`CompiledCore.fn`, the runtime's :class:`~nvdd.spec.CompilePolicy`):
  collective-free tensor functions of the padded atoms and edges.

With ``policy.pad_shapes`` the atoms and edges are padded by an
:class:`~nvdd.padding.COOPadder` (padding atoms far away, padded edges between
two padding atoms, masked to zero). Capacities only grow, with a headroom that
shrinks with the rank's row count (:func:`growth_for`: 25 % for a few hundred
rows, 5 % from 6,400 rows on), and
are **agreed by every rank** of the DD group at each new halo topology (the
first call after a plan rebuild, which every rank makes together; one
all-reduce); between rebuilds a rank whose edge count outgrows its capacity
grows it alone (no collective on a step that rebuilds nothing), and the next
topology levels every rank to the maximum. The compiled regions therefore see
the same shapes step after step and compile once per capacity.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.functional import silu

from nvdd.models._neighbors import EdgeList
from nvdd.models._radial import radial_features
from nvdd.models._reduce import system_outer_sum
from nvdd.padding import CapacityRegistry, COOGraph, COOPadder, resolve_cap
from nvdd.shardtensor import current_dd_context
from nvdd.spec import CompilePolicy

__all__ = [
    "CompiledCore",
    "growth_for",
    "CoreInputs",
    "edge_vectors",
    "lj_direct",
    "lj_direct_owned",
    "lj_energies",
    "lj_pair",
    "mpnn_embed",
    "mpnn_energies",
    "mpnn_first",
    "mpnn_last",
    "mpnn_layer",
    "mpnn_readout",
]


@dataclass(frozen=True)
class CoreInputs:
    """The tensors a compiled core takes (padded to capacities, or as given).

    Attributes
    ----------
    positions:
        Shape ``(atom_cap, 3)``; rows ``[0, n_atoms)`` are the real ones.
    rows, system_index:
        int64, shape ``(atom_cap,)``: species rows and systems (0 on padding).
    receivers, senders:
        int64, shape ``(edge_cap,)``.
    shifts:
        int64, shape ``(edge_cap, 3)``: image shifts (0 on padded edges).
    edge_mask:
        bool, shape ``(edge_cap,)``: True on real edges.
    owned_receivers:
        int64, shape ``(edge_cap,)``: ``receivers`` with padded edges sent to row 0
        (for scatters into the first ``owned_cap`` rows; their messages are zero).
    owned:
        int64, shape ``(owned_cap,)``: the species rows of the first ``owned_cap``
        rows, the rows a layer updates (every receiver is among them; under DD
        ``owned_cap >= n_owned`` is a capacity of its own, so the slice a
        compiled region takes is fixed while ``n_owned`` drifts).
    n_atoms:
        The real atom count (host int: for the eager code around the core only).
    """

    positions: torch.Tensor
    rows: torch.Tensor
    system_index: torch.Tensor
    receivers: torch.Tensor
    senders: torch.Tensor
    shifts: torch.Tensor
    edge_mask: torch.Tensor
    owned_receivers: torch.Tensor
    owned: torch.Tensor
    n_atoms: int

    def tensors(self, cell: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(positions, cell, rows, system_index, receivers, senders, shifts,
        edge_mask)``: the arguments of the compiled regions (tensors only, so
        the real counts never reach compiled code)."""
        return (
            self.positions,
            cell,
            self.rows,
            self.system_index,
            self.receivers,
            self.senders,
            self.shifts,
            self.edge_mask,
        )


#: The largest headroom a capacity grows with after repeated regrows (+40 %).
MAX_GROWTH = 1.4


def growth_for(n_rows: int) -> float:
    """Capacity growth of a compiled core for a rank owning ``n_rows`` rows.

    Padded rows and edges are computed like real ones, so headroom is paid on
    every step; a rank's counts fluctuate by about ``1 / sqrt(n)`` of themselves
    (more in a clustering gas), so the headroom is ``4 / sqrt(n)``, kept within
    5 % and 25 %: a 256-atom hot gas on 2 ranks gets 25 % (no recompile after
    warm-up over 1,000 steps), 100k atoms on one GPU 5 %.
    """
    return min(1.25, max(1.05, 1.0 + 4.0 / math.sqrt(max(n_rows, 1))))


def _regrew(before: dict[str, int], after: dict[str, int]) -> bool:
    """Whether a capacity that existed ``before`` is larger ``after`` (a recompile)."""
    return any(key in before and after[key] > before[key] for key in after)


def _escalated(growth: float) -> float:
    """The headroom after a regrow: doubled, at most :data:`MAX_GROWTH`."""
    return max(growth, min(MAX_GROWTH, 1.0 + 2.0 * (growth - 1.0)))


def _quiet(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` without the warning Dynamo raises while it wraps a non-leaf input
    (it reads ``.grad`` of the strained positions when it compiles)."""

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NON_LEAF_GRAD, category=UserWarning)
            return fn(*args)

    return call


#: The start of torch's warning about ``.grad`` of a non-leaf tensor.
_NON_LEAF_GRAD = "The .grad attribute of a Tensor that is not a leaf Tensor"


class CompiledCore:
    """Compiled functions and padding of one model, under one policy.

    Parameters
    ----------
    policy:
        The runtime's :class:`~nvdd.spec.CompilePolicy`.
    name:
        Prefix of the padder's capacity keys (``"<name>.atoms"``, ``"<name>.edges"``).
    module:
        The model: while the core exists its parameters do not require grad (MD
        differentiates by positions only; a compiled backward would otherwise
        compute every weight gradient too). :meth:`release` restores them.
    """

    def __init__(self, policy: CompilePolicy, name: str, module: torch.nn.Module) -> None:
        self._frozen = [p for p in module.parameters() if p.requires_grad]
        for p in self._frozen:
            p.requires_grad_(False)
        self.policy = policy
        self.name = name
        self.padder: COOPadder | None = None  # made at the first padded call
        self._functions: dict[str, Callable[..., Any]] = {}
        self._agreed_generation: int | None = None
        #: Capacities that outgrew their headroom after the first call (each a recompile).
        self.regrows = 0
        self._row_caps = CapacityRegistry()  # rows of callers with their own edges
        self._row_growth: float | None = None  # their headroom (escalated as the padder's)

    def release(self) -> None:
        """Give the parameters their ``requires_grad`` back."""
        for p in self._frozen:
            p.requires_grad_(True)
        self._frozen = []

    def fn(self, key: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` compiled under the policy (once per key)."""
        compiled = self._functions.get(key)
        if compiled is None:
            compiled = _quiet(self.policy.compile(function, padded=self.policy.pad_shapes))
            self._functions[key] = compiled
        return compiled

    def inputs(
        self,
        positions: torch.Tensor,
        rows: torch.Tensor,
        system_index: torch.Tensor,
        edges: EdgeList,
        generation: int,
        n_owned: int | None = None,
    ) -> CoreInputs:
        """Pad (when the policy says so) the inputs of one forward.

        ``n_owned``: the rows that receive edges, under DD (default: every row;
        then ``owned`` is every padded row and no third capacity is kept).

        **Collective** over the live DD context's group on the first call of a
        new topology (``generation``: the model's input-gate generation, which
        every rank advances at the same call): one all-reduce agrees on the atom
        and edge capacities, one more on the owned rows' when ``n_owned`` is
        given. Local otherwise.
        """
        n = int(positions.shape[0])
        if not self.policy.pad_shapes:
            ones = torch.ones(edges.n_edges, dtype=torch.bool, device=positions.device)
            return CoreInputs(
                positions,
                rows,
                system_index,
                edges.receivers,
                edges.senders,
                edges.shifts,
                ones,
                edges.receivers,
                rows if n_owned is None else rows[:n_owned],
                n,
            )
        ctx = current_dd_context()
        group: Any = None
        if ctx.is_distributed and generation != self._agreed_generation:
            group = ctx.group if ctx.group is not None else dist.group.WORLD
            self._agreed_generation = generation
        graph = COOGraph(
            edge_index=torch.stack([edges.receivers, edges.senders]),
            n_atoms=n,
            atom_fields={"positions": positions, "rows": rows, "system_index": system_index},
            edge_fields={"shifts": edges.shifts},
        )
        if self.padder is None:  # headroom from the receivers (owned rows): edges follow them
            receivers = n_owned if n_owned is not None else n
            if ctx.layout is not None:
                receivers = int(ctx.layout.n_owned)
            growth = growth_for(receivers)
            self.padder = COOPadder(name=self.name, growth=growth, check_indices=False)
        before = self.padder.registry.snapshot()
        p = self.padder.pad(graph, group=group)
        owned_cap = p.atom_cap
        if n_owned is not None:  # (before the escalation check: its regrows count too)
            owned_cap = resolve_cap(
                f"{self.padder.name}.owned",
                n_owned,
                growth=self.padder.growth,
                multiple=self.padder.atom_multiple,
                group=group,
                registry=self.padder.registry,
            )
        self._escalate(before)
        padded_rows = p.atom_fields["rows"]
        return CoreInputs(
            p.atom_fields["positions"],
            padded_rows,
            p.atom_fields["system_index"],
            p.edge_index[0],
            p.edge_index[1],
            p.edge_fields["shifts"],
            p.edge_mask,
            p.edge_index[0].masked_fill(~p.edge_mask, 0),
            padded_rows[: min(owned_cap, p.atom_cap)],
            n,
        )

    def row_caps(self, n_atoms: int, n_owned: int, generation: int) -> tuple[int, int]:
        """Capacities ``(rows, owned rows)`` for a caller that brings its own
        fixed-capacity edges (the MPNN's device edges under DD): the atom
        counts change at every halo rebuild, the compiled shapes should not.

        **Collective** over the live DD context's group at a new topology
        (``generation``, as :meth:`inputs`): the ranks agree on both (two small
        all-reduces); local otherwise (a count that outgrows its capacity
        between rebuilds grows it on this rank alone).
        """
        ctx = current_dd_context()
        group: Any = None
        if ctx.is_distributed and generation != self._agreed_generation:
            group = ctx.group if ctx.group is not None else dist.group.WORLD
            self._agreed_generation = generation
        if self._row_growth is None:
            self._row_growth = growth_for(n_owned)
        growth = self._row_growth
        caps = self._row_caps
        before = caps.snapshot()
        rows = resolve_cap(f"{self.name}.rows", n_atoms, growth=growth, group=group, registry=caps)
        owned = resolve_cap(
            f"{self.name}.owned", n_owned, growth=growth, group=group, registry=caps
        )
        if _regrew(before, caps.snapshot()):
            self.regrows += 1
            self._row_growth = _escalated(growth)
        return rows, min(owned, rows)

    def _escalate(self, before: dict[str, int]) -> None:
        """Double the headroom after every regrow of an existing capacity.

        A count that drifts for a while (a crystal equilibrating: the neighbours
        of the next shell come within the cutoff) would otherwise outgrow a
        5 % headroom again and again, and every growth is a recompilation (on a
        GPU, seconds of inductor autotuning). Headroom 5 % -> 10 % -> 20 % -> 40 %
        (at most :data:`MAX_GROWTH`) bounds those to a few.
        """
        assert self.padder is not None
        if _regrew(before, self.padder.registry.snapshot()):
            self.regrows += 1
            headroom = _escalated(self.padder.growth)
            if headroom > self.padder.growth:
                self.padder = dataclasses.replace(self.padder, growth=headroom)

    @property
    def capacities(self) -> dict[str, int]:
        """The current capacities by key (the padder's and :meth:`row_caps`')."""
        found = {} if self.padder is None else self.padder.registry.snapshot()
        return {**found, **self._row_caps.snapshot()}


def edge_vectors(
    positions: torch.Tensor,
    cell: torch.Tensor,
    system_index: torch.Tensor,
    receivers: torch.Tensor,
    senders: torch.Tensor,
    shifts: torch.Tensor,
) -> torch.Tensor:
    """``x[j] - x[i] + S @ cell[system of i]`` of every (padded) edge, ``(edge_cap, 3)``.

    Pure tensor code, traced inside the compiled cores (the same arithmetic as
    :meth:`EdgeList.vectors`).
    """
    r = positions.index_select(0, senders) - positions.index_select(0, receivers)
    s = shifts.to(cell.dtype)
    if cell.shape[0] == 1:
        return r + s @ cell[0]
    cells = cell.index_select(0, system_index.index_select(0, receivers))
    return r + torch.bmm(s.unsqueeze(1), cells).squeeze(1)


# --------------------------------------------------------- the MPNN's regions
def mpnn_embed(
    model: Any,
    positions: torch.Tensor,
    cell: torch.Tensor,
    rows: torch.Tensor,
    system_index: torch.Tensor,
    receivers: torch.Tensor,
    senders: torch.Tensor,
    shifts: torch.Tensor,
    edge_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Radial features ``(edge_cap, K)`` (exactly zero on padded edges, placed at
    the cutoff) and the embedded features ``(atom_cap, F)``."""
    c = model.config
    r_vec = edge_vectors(positions, cell, system_index, receivers, senders, shifts)
    # padded edges are placed at the cutoff before the square root: a padded
    # edge of zero length would give 0 * inf = NaN in the backward of sqrt
    r2 = torch.where(edge_mask, (r_vec * r_vec).sum(dim=1), c.cutoff * c.cutoff)
    r = torch.sqrt(r2)
    radial = radial_features(r, c.cutoff, c.n_basis, c.envelope_exponent)
    return radial, model.embedding.index_select(0, rows)


def mpnn_layer(
    layer: Any,
    h: torch.Tensor,
    radial: torch.Tensor,
    receivers: torch.Tensor,
    senders: torch.Tensor,
    edge_mask: torch.Tensor,
    owned: torch.Tensor,
) -> torch.Tensor:
    """One message-passing layer: rows ``[0, len(owned))`` (every receiver among
    them) updated, the others kept (ghost rows are refreshed afterwards, padding
    rows are never read by a real row). ``receivers`` must be the owned-row
    receivers of :attr:`CoreInputs.owned_receivers` (padded edges: row 0, with
    exact zeros)."""
    n_update = owned.shape[0]
    weights = layer.filter_out(silu(layer.filter_in(radial)))
    messages = weights * layer.sender(h).index_select(0, senders)
    messages = torch.where(edge_mask.unsqueeze(1), messages, torch.zeros_like(messages))
    own = h[:n_update]
    aggregated = torch.zeros_like(own).index_add_(0, receivers, messages)
    update = layer.update_out(silu(layer.update_in(torch.cat([own, aggregated], 1))))
    return torch.cat([own + update, h[n_update:]])


def mpnn_readout(model: Any, h: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """Energies of rows ``[0, len(owned))``: the readout plus the species offset."""
    e: torch.Tensor = model.readout_out(silu(model.readout_in(h[: owned.shape[0]]))).squeeze(1)
    offset: torch.Tensor = model.species_energy.index_select(0, owned)
    return e + offset


def mpnn_energies(
    model: Any,
    positions: torch.Tensor,
    cell: torch.Tensor,
    rows: torch.Tensor,
    system_index: torch.Tensor,
    receivers: torch.Tensor,
    senders: torch.Tensor,
    shifts: torch.Tensor,
    edge_mask: torch.Tensor,
    owned_receivers: torch.Tensor,
    owned: torch.Tensor,
) -> torch.Tensor:
    """:func:`mpnn_embed`, every layer and :func:`mpnn_readout` as one region:
    the energies of rows ``[0, len(owned))``, for a call that exchanges nothing
    between layers (one process, or a world of one running the whole batch).

    One region instead of ``2 + n_layers``: fewer guarded calls and autograd
    nodes per step (the compiled MPNN step is bound by host time on a GPU), and
    the compiler may fuse across layers. Same arithmetic as the separate regions.
    """
    radial, h = mpnn_first(
        model, positions, cell, rows, system_index, receivers, senders, shifts, edge_mask,
        owned_receivers, owned,
    )  # fmt: skip
    for layer in list(model.layers)[1:]:
        h = mpnn_layer(layer, h, radial, owned_receivers, senders, edge_mask, owned)
    return mpnn_readout(model, h, owned)


def mpnn_first(
    model: Any,
    positions: torch.Tensor,
    cell: torch.Tensor,
    rows: torch.Tensor,
    system_index: torch.Tensor,
    receivers: torch.Tensor,
    senders: torch.Tensor,
    shifts: torch.Tensor,
    edge_mask: torch.Tensor,
    owned_receivers: torch.Tensor,
    owned: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mpnn_embed` and the first layer as one region: ``(radial, h)``
    (under DD the ghost rows of ``h`` are refreshed next, eagerly)."""
    radial, h = mpnn_embed(
        model, positions, cell, rows, system_index, receivers, senders, shifts, edge_mask
    )
    h = mpnn_layer(model.layers[0], h, radial, owned_receivers, senders, edge_mask, owned)
    return radial, h


def mpnn_last(
    model: Any,
    h: torch.Tensor,
    radial: torch.Tensor,
    owned_receivers: torch.Tensor,
    senders: torch.Tensor,
    edge_mask: torch.Tensor,
    owned: torch.Tensor,
) -> torch.Tensor:
    """The last layer and :func:`mpnn_readout` as one region (its ghost rows are
    never refreshed: nothing reads them)."""
    layer = model.layers[len(model.layers) - 1]
    h = mpnn_layer(layer, h, radial, owned_receivers, senders, edge_mask, owned)
    return mpnn_readout(model, h, owned)


# ----------------------------------------------------------- LJ's regions
def lj_pair(
    model: Any,
    positions: torch.Tensor,
    cell: torch.Tensor,
    rows: torch.Tensor,
    system_index: torch.Tensor,
    receivers: torch.Tensor,
    senders: torch.Tensor,
    shifts: torch.Tensor,
    edge_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Edge vectors and the masked pair terms ``phi``, ``g`` (zero on padded edges)."""
    r_vec = edge_vectors(positions, cell, system_index, receivers, senders, shifts)
    phi, g = model.pair_terms(r_vec, rows.index_select(0, receivers), rows.index_select(0, senders))
    zero = torch.zeros_like(phi)
    return r_vec, torch.where(edge_mask, phi, zero), torch.where(edge_mask, g, zero)


def lj_energies(model: Any, *args: torch.Tensor) -> torch.Tensor:
    """Per-row energies ``1/2 sum_j phi(r_ij)``, ``(atom_cap,)`` (args as :func:`lj_pair`)."""
    _, phi, _ = lj_pair(model, *args)
    positions, receivers = args[0], args[4]
    return torch.zeros_like(positions[:, 0]).index_add(0, receivers, 0.5 * phi)


def lj_direct(
    model: Any, n_systems: int, *args: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Atom energies ``(atom_cap,)``, direct forces ``(atom_cap, 3)`` and the virial
    ``(n_systems, 3, 3)`` (args as :func:`lj_pair`): ``-dE/dx`` on every row."""
    return _lj_direct(model, n_systems, False, *args)


def lj_direct_owned(
    model: Any, n_systems: int, *args: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`lj_direct` with each edge's whole pair force on its receiver (an
    owned row) and none on its sender: complete owned rows, zero ghost rows."""
    return _lj_direct(model, n_systems, True, *args)


def _lj_direct(
    model: Any, n_systems: int, owned_only: bool, *args: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r_vec, phi, g = lj_pair(model, *args)
    positions, system_index, receivers, senders = args[0], args[3], args[4], args[5]
    atom_energies = torch.zeros_like(positions[:, 0]).index_add(0, receivers, 0.5 * phi)
    half = (0.5 * g).unsqueeze(1) * r_vec
    if owned_only:
        forces = torch.zeros_like(positions).index_add(0, receivers, -2.0 * half)
    else:
        forces = torch.zeros_like(positions).index_add(0, senders, half)
        forces = forces.index_add(0, receivers, -half)
    edge_system = system_index.index_select(0, receivers)
    return atom_energies, forces, system_outer_sum(half, r_vec, edge_system, n_systems)
