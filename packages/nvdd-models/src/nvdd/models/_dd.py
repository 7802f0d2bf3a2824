"""The models' wiring to domain decomposition (DD): rows, input checks, specs, and
the mixin both models share (:class:`HaloModelMixin`).

Under a live DD context (``current_dd_context().layout is not None``) a model's
``forward`` runs on one rank's ``[owned | ghost]`` rows, as the runtime
(``nvdd.dynamics.DistributedModel``) builds them: ghosts are explicit periodic
images, so the batch has open boundaries (``pbc`` all False) and the real cell.
Then:

- edges are kept only for owned receivers (``n_receivers = layout.n_owned``), so
  every global directed edge lives on exactly one rank;
- only owned rows' energies count (``system_sum``, owned rows);
- input problems are shared with every rank before anything is raised
  (:func:`nvdd.core.raise_if_any_rank`), so a bad batch on one rank cannot
  leave the others waiting in a collective.

That last check is a collective, so it runs once per halo topology (a new
layout object or a new ``topology_version``: the rows only change then), not on
every step: a steady-state step pays no extra all-reduce for it. Between
topologies only host-side shape checks run, raised locally (they can only fail
if the caller changed the rows without a new topology, which the runtime never
does). Outside a DD context (the inert context) nothing here communicates and
the models behave exactly as single-process models.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from nvdd.core import Batch, ModelOutputs, ValidationError, raise_if_any_rank
from nvdd.models._checks import check_geometry, check_system_index, config_error, fail
from nvdd.models._device_edges import PaddedEdges
from nvdd.models._forces import outputs_by_autograd
from nvdd.models._neighbors import EdgeList
from nvdd.models._species import check_species
from nvdd.models._verlet import VerletList
from nvdd.shardtensor import (
    DDContext,
    Scope,
    current_dd_context,
    refresh_neighbors,
    scatter_to_owners,
)
from nvdd.spec import BaseModelMixin, MLIPSpec, Reduce, ScatterMode, StrategyKind

__all__ = [
    "HaloModelMixin",
    "InputGate",
    "energy_scope",
    "halo_spec",
    "per_atom_exchange",
    "prepare_rows",
]

#: Returns the first problem found (a message without the rank), or None.
Check = Callable[[], str | None]


def energy_scope(spec: MLIPSpec) -> Scope:
    """The ``system_sum`` scope that makes a model's energy match its spec.

    ``Reduce.ALL_REDUCE`` (a per-rank partial, summed by the runtime on demand):
    ``Scope.LOCAL``, no collective in the forward. Otherwise (``OWNED_ONLY``: the
    value is already global on every rank): ``Scope.OWNED``, one all-reduce with
    an identity backward.
    """
    if spec.output("energy").effective_reduce() is Reduce.ALL_REDUCE:
        return Scope.LOCAL
    return Scope.OWNED


def per_atom_exchange(spec: MLIPSpec) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The exchange a spec's ``options.scatter`` selects for a per-atom intermediate.

    ``ScatterMode.LOCAL``: :func:`~nvdd.shardtensor.refresh_neighbors` (owned rows
    are complete, ghost rows are copied from their owners: one forward exchange,
    its adjoint in the backward). ``ScatterMode.FOLD``:
    :func:`~nvdd.shardtensor.scatter_to_owners` (ghost partials folded into owners,
    then refreshed: two exchanges). ``ScatterMode.NONE``: ``None`` (nothing is
    exchanged; ghost rows must be computed where they are, from a halo wide
    enough for it). Both verbs are **Collective** under a live DD context.
    """
    mode = spec.options.scatter
    if mode is ScatterMode.LOCAL:
        return refresh_neighbors
    if mode is ScatterMode.FOLD:
        return scatter_to_owners
    return None


def halo_spec(
    model: object,
    strategy: StrategyKind | str,
    spec: MLIPSpec,
    graph: MLIPSpec | None = None,
) -> MLIPSpec:
    """``spec`` for ``StrategyKind.HALO``, ``graph`` for ``GRAPH_PARTITION``.

    ``strategy`` may be a :class:`StrategyKind` or its value (``"halo"``). A
    :class:`ConfigurationError` for graph partition when ``graph`` is None (the
    model did not opt in) or for a value that is not a strategy.
    """
    name = type(model).__name__
    try:
        kind = strategy if isinstance(strategy, StrategyKind) else StrategyKind(strategy)
    except ValueError:
        raise config_error(
            f"{name}.distribution_spec: strategy must be a StrategyKind, got {strategy!r}"
        ) from None
    if kind is StrategyKind.HALO:
        return spec
    if graph is None:
        raise config_error(
            f"{name} supports StrategyKind.HALO only, got {kind}: it has not opted in to the "
            "graph partition (a node partition by index; see docs/design.md); run it with "
            "DomainConfig(strategy=StrategyKind.HALO)"
        )
    return graph


class InputGate:
    """Remembers the halo topology whose inputs were already checked on every rank.

    A model owns one. :meth:`is_new` tells whether a live context's layout (by
    identity) or ``topology_version`` differs from the last one checked; every
    rank sees a new topology at the same call (the runtime rebuilds the plan on
    all ranks together), so the decision to run the collective check is the
    same on every rank. :attr:`generation` counts the topologies seen; the
    models hand it to their Verlet list so that a new plan forces a rebuild.
    """

    def __init__(self) -> None:
        self._layout: Callable[[], Any] | None = None
        self._version: int | None = None
        self.generation = 0
        # the tensors (pbc, system index) and the metadata of the inputs last
        # checked at this topology: the same again needs no local check
        self._inputs: tuple[Any, ...] | None = None

    def __getstate__(self) -> dict[str, int]:
        # A weak reference does not pickle (torch.save of a whole model, deepcopy):
        # a copy starts without a checked topology.
        return {"generation": self.generation}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__()  # type: ignore[misc]
        self.generation = state["generation"]

    def reset(self) -> None:
        """Forget the last topology (the next DD call checks collectively again)."""
        self._layout = None
        self._version = None
        self._inputs = None

    def checked(self, batch: Batch, n_receivers: int | None) -> bool:
        """Whether ``batch`` is, for the local checks of :func:`prepare_rows`, the
        input last checked at this topology: the same ``pbc`` and
        ``system_index`` tensors, positions and cell of the same shape, dtype
        and device, the same ``n_receivers`` (a steady step of the runtime: only
        the positions' values and the cell's change)."""
        held = self._inputs
        return (
            held is not None
            and held[0] is batch.pbc
            and held[1] is batch.system_index
            and held[2:] == _metadata(batch, n_receivers)
        )

    def remember(self, batch: Batch, n_receivers: int | None) -> None:
        """Record ``batch`` as checked at this topology (see :meth:`checked`)."""
        self._inputs = (batch.pbc, batch.system_index, *_metadata(batch, n_receivers))

    def is_new(self, ctx: DDContext) -> bool:
        """Whether ``ctx`` describes a topology not checked yet (no communication)."""
        last = self._layout() if self._layout is not None else None
        return last is not ctx.layout or self._version != ctx.topology_version

    def accept(self, ctx: DDContext) -> None:
        """Record ``ctx``'s topology as checked."""
        layout = ctx.layout
        try:
            self._layout = weakref.ref(layout)
        except TypeError:  # a layout without weak references: keep it alive instead
            self._layout = lambda: layout
        self._version = ctx.topology_version
        self.generation += 1


def _metadata(batch: Batch, n_receivers: int | None) -> tuple[object, ...]:
    pos, cell = batch.positions, batch.cell
    return (type(pos), pos.shape, pos.dtype, pos.device, type(cell), cell.shape, cell.dtype,
            cell.device, n_receivers)  # fmt: skip


def _rows_problem(batch: Batch, n_receivers: int | None, n_owned: int, n_padded: int) -> str | None:
    if batch.n_atoms != n_padded:
        return (
            f"the batch has {batch.n_atoms} rows (positions shape "
            f"{tuple(batch.positions.shape)}) but the DD layout has n_padded={n_padded} "
            "[owned | ghost] rows"
        )
    if n_receivers is not None and n_receivers != n_owned:
        return (
            f"n_receivers={n_receivers} differs from the DD layout's n_owned={n_owned}; "
            "leave n_receivers=None under a DD context"
        )
    return None


def _open_boundary_problem(layout: object, pbc: torch.Tensor) -> str | None:
    if not getattr(layout, "explicit_images", True):
        return None  # graph partition: ghost rows are the atoms, the real pbc applies
    # a halo: explicit images, except along the axes it leaves to the model
    axes = getattr(layout, "periodic_axes", None)
    if axes is None:
        if bool(pbc.any()):
            return (
                f"batch.pbc is {pbc.tolist()} (shape {tuple(pbc.shape)}): under a DD context "
                "the padded rows hold explicit periodic images, so the batch must have open "
                "boundaries (pbc all False)"
            )
        return None
    want = axes.to(pbc.device).reshape(pbc.shape)
    if not bool(torch.equal(pbc, want)):
        return (
            f"batch.pbc is {pbc.tolist()}: under this DD context the padded rows are "
            f"periodic exactly along the axes the halo leaves to the model ({want.tolist()}) "
            "and hold explicit images along the others"
        )
    return None


def prepare_rows(
    gate: InputGate,
    batch: Batch,
    n_receivers: int | None,
    shape_check: Check,
    data_check: Check,
) -> tuple[int | None, int | None]:
    """Check a forward's inputs and say which rows receive edges.

    Parameters
    ----------
    gate:
        The model's :class:`InputGate`.
    batch:
        The model's input.
    n_receivers:
        The caller's receiver bound (``None``: every row, or under DD the owned rows).
    shape_check:
        The model's host-side checks (dtypes): cheap, run on every call.
    data_check:
        The model's checks that read tensor values (species): once per topology
        under DD, on every call otherwise.

    Returns
    -------
    (n_receivers, topology)
        The receiver bound to use (``layout.n_owned`` under DD) and a token that
        changes with the halo topology (``None`` outside DD).

    Raises
    ------
    ValidationError
        Outside DD: at once, naming this rank. Under DD, on a new topology: on
        every rank of the context's group together (**Collective**: one
        all-reduce of a flag over ``ctx.group``, every rank calls it at the same
        forward); otherwise locally.

    Notes
    -----
    Outside DD the two checks run in that order and raise at once, and the
    geometry is checked by the neighbour list, as in a single-process model.
    Under DD this function also checks the geometry, the rows against the
    layout and (once per topology) the system indices and open boundaries, so
    that malformed input is reported on every rank instead of by the neighbour
    list of one rank (which then need not check the geometry again). A steady
    step of the runtime hands the inputs checked last (the same ``pbc`` and
    ``system_index``, new positions of the same shape): only ``shape_check``
    runs again.
    """
    ctx = current_dd_context()
    layout = ctx.layout
    if layout is None:
        fail(shape_check())
        fail(data_check())
        return n_receivers, None
    if gate.is_new(ctx):
        message = _local_problem(batch, n_receivers, layout, shape_check) or (
            data_check()
            or check_system_index(batch.system_index, batch.n_systems)
            or _open_boundary_problem(layout, batch.pbc)
        )
        raise_if_any_rank(message, ctx.group, exc_type=ValidationError)
        gate.accept(ctx)
        gate.remember(batch, n_receivers)
    elif not gate.checked(batch, n_receivers):
        fail(_local_problem(batch, n_receivers, layout, shape_check))
        gate.remember(batch, n_receivers)
    else:  # the inputs checked at this topology: only the model's own check again
        problem = shape_check()
        if problem is not None:
            fail(problem)
    return layout.n_owned, gate.generation


def _local_problem(
    batch: Batch, n_receivers: int | None, layout: Any, shape_check: Check
) -> str | None:
    """The checks of :func:`prepare_rows` that read no tensor values."""
    return (
        shape_check()
        or check_geometry(batch.positions, batch.cell, batch.pbc, batch.system_index)
        or _rows_problem(batch, n_receivers, layout.n_owned, layout.n_padded)
    )


class HaloModelMixin(BaseModelMixin):
    """The DD wiring of the package's models (mix into a ``torch.nn.Module``).

    A model sets :attr:`_halo_preset` and, in ``__init__``, ``self.neighbors`` (a
    :class:`VerletList`), ``self._dd_gate`` (an :class:`InputGate`) and the
    ``species_rows`` buffer, and defines ``atom_energies``; it gets
    :meth:`distribution_spec`, the scope hooks, :meth:`_edges` (the first step of
    its ``forward``) and :meth:`_outputs_by_autograd`. A model that lets its
    behaviour follow a different spec stores it as ``self._spec`` (the models
    take a ``spec=`` argument for that); :meth:`distribution_spec` returns it.
    """

    #: What :meth:`distribution_spec` returns for ``StrategyKind.HALO``.
    _halo_preset: ClassVar[MLIPSpec]
    #: A spec that replaces the preset (``None``: the preset).
    _spec: MLIPSpec | None = None
    #: What it returns for ``StrategyKind.GRAPH_PARTITION`` (None: not supported).
    _graph_preset: ClassVar[MLIPSpec | None] = None
    neighbors: VerletList
    species_rows: torch.Tensor
    _dd_gate: InputGate

    def distribution_spec(self, strategy: StrategyKind | str = StrategyKind.HALO) -> MLIPSpec:
        """The model's spec for ``strategy`` (a :class:`StrategyKind` or its value):
        for ``HALO`` its preset or the ``spec=`` it was built with.

        ``StrategyKind.HALO``: :attr:`_halo_preset`; ``GRAPH_PARTITION``:
        :attr:`_graph_preset`. What the presets promise is in the model's class
        docstring.

        Raises
        ------
        ConfigurationError
            For a strategy the model does not support, or a value that is not a
            strategy.
        """
        spec = self._spec if self._spec is not None else self._halo_preset
        return halo_spec(self, strategy, spec, self._graph_preset)

    def distributed_setup(self, ctx: object) -> None:
        """Forget cached neighbours and checks when a distributed scope opens."""
        self.neighbors.reset()
        self._dd_gate.reset()

    def distributed_teardown(self) -> None:
        """Forget cached neighbours and checks when the distributed scope closes."""
        self.neighbors.reset()
        self._dd_gate.reset()

    def _edges(
        self, batch: Batch, n_receivers: int | None, shape_check: Check
    ) -> tuple[int | None, torch.Tensor, EdgeList]:
        """Checked inputs, the atoms' species rows and the edges of ``batch``.

        ``shape_check`` is the model's own host-side check (see :func:`prepare_rows`,
        whose data check here is the species check). **Collective** under a live DD
        context on a new halo topology (one all-reduce of a flag over the
        context's group); local otherwise.

        Returns
        -------
        (n_receivers, rows, edges)
            The receiver bound to use (``layout.n_owned`` under DD), the species
            rows, int64 shape ``(n_atoms,)``, and the model's Verlet edges.
        """
        n_receivers, topology = prepare_rows(
            self._dd_gate,
            batch,
            n_receivers,
            shape_check,
            lambda: check_species(self.species_rows, batch.atomic_numbers),
        )
        rows = self.species_rows.index_select(0, batch.atomic_numbers)
        edges = self.neighbors.for_batch(batch, n_receivers=n_receivers, topology=topology)
        return n_receivers, rows, edges

    def atom_energies(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        rows: torch.Tensor,
        system_index: torch.Tensor,
        edges: EdgeList,
    ) -> torch.Tensor:
        """Per-atom energies, shape ``(n_atoms,)``, differentiable in ``positions``
        and ``cell``; ``rows`` are the species rows, int64 ``(n_atoms,)``."""
        raise NotImplementedError(f"{type(self).__name__} must define atom_energies")

    def _outputs_by_autograd(
        self,
        batch: Batch,
        rows: torch.Tensor,
        edges: EdgeList | PaddedEdges,
        n_counted: int | None,
        *,
        compute_stress: bool,
        energy_scope: Scope,
        create_graph: bool = False,
    ) -> ModelOutputs:
        """:func:`~nvdd.models._forces.outputs_by_autograd` of :meth:`atom_energies`
        over ``edges`` (**Collective** as that function says). ``PaddedEdges``
        only for a model whose ``atom_energies`` takes them (the MPNN)."""
        return outputs_by_autograd(
            lambda pos, cell: self.atom_energies(
                pos,
                cell,
                rows,
                batch.system_index,
                edges,  # type: ignore[arg-type]
            ),
            batch.positions,
            batch.cell,
            batch.system_index,
            n_counted=n_counted,
            compute_stress=compute_stress,
            create_graph=create_graph,
            energy_scope=energy_scope,
        )
