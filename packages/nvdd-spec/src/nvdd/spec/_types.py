"""The vocabulary of a distribution spec: enums and small frozen records."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch

from nvdd.core import ConfigurationError

__all__ = [
    "CompilePolicy",
    "ForceStrategy",
    "GlobalCoupling",
    "OutputKind",
    "OutputSpec",
    "Reduce",
    "ScatterMode",
    "StrategyKind",
    "StrategyOptions",
]


class StrategyKind(enum.Enum):
    """Which parallelisation strategy a distributed scope runs under.

    ``HALO``: spatial domain decomposition; each rank owns the atoms of its box and
    holds ghost copies within the ghost width. ``GRAPH_PARTITION``: atoms split by
    balanced contiguous index ranges, for models that build their own neighbour
    list inside ``forward``.
    """

    HALO = "halo"
    GRAPH_PARTITION = "graph_partition"


class OutputKind(enum.Enum):
    """The shape class of one model output.

    ``PER_NODE``: one row per atom (rows ``[owned | ghost]`` under DD).
    ``PER_GRAPH``: one row per system. ``GLOBAL``: anything else, passed through.
    ``UNKNOWN``: not declared; passed through unchanged and reported as unverified
    by validation (declare it to make it exact).
    """

    PER_NODE = "per_node"
    PER_GRAPH = "per_graph"
    GLOBAL = "global"
    UNKNOWN = "unknown"


class Reduce(enum.Enum):
    """How the per-rank values of one output combine into the global value.

    ``NONE``: the kind's default (see :meth:`OutputSpec.effective_reduce`).
    ``ALL_REDUCE``: each rank holds a partial; sum them (per-node: ghost rows are
    folded into their owners across ranks, then owned rows are kept; per-graph and
    global: an all-reduce). ``OWNED_ONLY``: the value is already correct where it
    lives (per-node: on owned rows, which are kept; per-graph and global: on every
    rank, e.g. an energy from ``system_sum(scope=Scope.OWNED)``).
    """

    NONE = "none"
    ALL_REDUCE = "all_reduce"
    OWNED_ONLY = "owned_only"


_DEFAULT_REDUCE = {
    OutputKind.PER_NODE: Reduce.OWNED_ONLY,
    OutputKind.PER_GRAPH: Reduce.ALL_REDUCE,
    OutputKind.GLOBAL: Reduce.OWNED_ONLY,
    OutputKind.UNKNOWN: Reduce.OWNED_ONLY,
}


@dataclass(frozen=True)
class OutputSpec:
    """How one named model output is shaped and combined under DD.

    Parameters
    ----------
    kind:
        The shape class (:class:`OutputKind`).
    reduce:
        The combine rule (:class:`Reduce`); ``Reduce.NONE`` means the kind's
        default: per-node and global outputs ``OWNED_ONLY``, per-graph
        ``ALL_REDUCE``.
    """

    kind: OutputKind
    reduce: Reduce = Reduce.NONE

    def __post_init__(self) -> None:
        if not isinstance(self.kind, OutputKind):
            raise ConfigurationError(f"OutputSpec.kind must be an OutputKind, got {self.kind!r}")
        if not isinstance(self.reduce, Reduce):
            raise ConfigurationError(f"OutputSpec.reduce must be a Reduce, got {self.reduce!r}")
        if self.kind is OutputKind.UNKNOWN and self.reduce is Reduce.ALL_REDUCE:
            raise ConfigurationError(
                "OutputSpec(kind=UNKNOWN, reduce=ALL_REDUCE): an output of unknown shape cannot "
                "be summed across ranks; declare its kind"
            )

    def effective_reduce(self) -> Reduce:
        """The rule consolidation applies (``NONE`` resolved to the kind's default)."""
        return _DEFAULT_REDUCE[self.kind] if self.reduce is Reduce.NONE else self.reduce


class ForceStrategy(enum.Enum):
    """How a model's forces are produced under a distributed forward.

    ``AUTOGRAD``: the model returns the energy; the runtime differentiates it with
    respect to the padded positions (``autograd_target()``) and folds ghost
    gradients into their owners. ``DIRECT``: the model returns ``forces`` on every
    padded row (``-dE_local/dx``, from a kernel or its own autograd); the runtime
    folds ghost rows into their owners.
    """

    AUTOGRAD = "autograd"
    DIRECT = "direct"


class ScatterMode(enum.Enum):
    """What a scatter into ghost rows needs.

    ``FOLD``: messages may land in ghost rows; their partial sums are folded into
    the owners (a reverse exchange), then ghosts are refreshed (MPNN family).
    ``LOCAL``: aggregation is over owned-complete neighbourhoods only (edges into
    owned rows); only a refresh is needed (UMA / eSCN family). ``NONE``: the model
    scatters nothing across atoms (pair potentials).
    """

    FOLD = "fold"
    LOCAL = "local"
    NONE = "none"


class GlobalCoupling(enum.Enum):
    """Long-range terms that couple every atom to every other.

    ``NONE``: short-ranged only. ``RECIPROCAL_SUM``: Ewald reciprocal space;
    structure factors of owned charges are all-reduced. ``MESH_SUM``: PME; the
    charge mesh spread from owned charges is all-reduced.
    """

    NONE = "none"
    RECIPROCAL_SUM = "reciprocal_sum"
    MESH_SUM = "mesh_sum"


@dataclass(frozen=True)
class CompilePolicy:
    """How a model wants ``torch.compile`` driven under domain decomposition.

    Parameters
    ----------
    enabled:
        Compile the forward at all (``DomainConfig(compile=True)`` also turns it on).
    mode:
        ``torch.compile``'s mode (``"reduce-overhead"``: CUDA graphs, which need
        the fixed shapes of ``pad_shapes``).
    backend:
        ``torch.compile``'s backend (``"inductor"``; ``"aot_eager"`` traces
        without generating code: cheap, for tests).
    fullgraph:
        Refuse graph breaks in every compiled region. A model that compiles its
        own tensor core (:meth:`BaseModelMixin.compile_forward`) compiles
        collective-free regions, so this holds for it; a model compiled whole
        breaks at its neighbour search and collectives, and fails with it.
    dynamic:
        ``torch.compile``'s ``dynamic``; None: False when shapes are padded
        (one static graph per capacity), True otherwise (symbolic shapes).
    pad_shapes:
        Pad atom and edge counts to grow-only, rank-agreed capacities
        (nvdd-padding) so the compiled graph is reused as counts drift. Needs
        a model that compiles its own core (the padding sits between its
        neighbour search and its tensor code); a model compiled whole runs
        unpadded with dynamic shapes.
    """

    enabled: bool = False
    mode: str | None = None
    backend: str = "inductor"
    fullgraph: bool = False
    dynamic: bool | None = None
    pad_shapes: bool = True

    def __post_init__(self) -> None:
        modes = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
        if self.mode not in modes:
            raise ConfigurationError(
                f"CompilePolicy.mode must be one of {modes}, got {self.mode!r}"
            )
        if not self.backend:
            raise ConfigurationError("CompilePolicy.backend must be a non-empty string")

    def resolved_dynamic(self, padded: bool) -> bool:
        """``dynamic`` if set, else ``not padded`` (static graphs for padded shapes)."""
        return (not padded) if self.dynamic is None else bool(self.dynamic)

    def compile(self, fn: Callable[..., Any], *, padded: bool) -> Callable[..., Any]:
        """``torch.compile(fn)`` with this policy's backend, mode, fullgraph and
        :meth:`resolved_dynamic` (``padded``: ``fn`` only ever sees padded shapes)."""
        compiled: Callable[..., Any] = torch.compile(
            fn,
            backend=self.backend,
            mode=self.mode,
            fullgraph=self.fullgraph,
            dynamic=self.resolved_dynamic(padded),
        )
        return compiled


@dataclass(frozen=True)
class StrategyOptions:
    """Communication-pattern options a model declares; each one is read by runtime code.

    Parameters
    ----------
    scatter:
        How a per-atom intermediate computed on owned rows reaches the ghost
        rows (:class:`ScatterMode`), read by the models that have one: the
        reference MPNN's aggregated messages, DFT-D3's coordination numbers
        (``nvdd.models``' ``per_atom_exchange``).
    extra_ghost_width:
        Angstrom added to ``cutoff + skin`` by the runtime when it sizes the halo
        (``DistributedModel.ghost_width``); e.g. DFT-D3 without a coordination
        number exchange.
    global_coupling:
        Long-range all-to-all terms (:class:`GlobalCoupling`), read by the
        Ewald / PME models to pick the collective that combines their
        reciprocal term across ranks.
    receptive_field_layers:
        ``L > 0`` declares the *receptive-field* safe path (record 0067): the
        model runs unmodified, as on one process, with ``L`` message-passing
        layers of the scope's cutoff ``rc``. The runtime then sizes the halo to
        ``2 L rc + skin`` (plus ``extra_ghost_width``), keeps the model's forces
        on owned rows only (exact there; ghost rows dropped, nothing folded)
        and takes the per-system energy as the sum of owned rows'
        ``atom_energies`` (unavailable when the model returns none). ``0``: not
        declared. Build such a spec with :func:`nvdd.spec.receptive_field_spec`.
    receptive_field_fold:
        The narrower receptive-field variant (with ``receptive_field_layers``):
        a halo of ``L rc + skin``; forces are ``-d/dx`` of the owned rows'
        ``atom_energies`` (which the model must return differentiable w.r.t. the
        positions it is given) on every padded row, ghost rows folded into
        their owners.
    wraps_periodic_axes:
        The model takes a real periodic axis on its ``[owned | ghost]`` rows
        under a halo: its neighbour list applies the real cell and pbc along
        the axes the layout names (``HaloPlan.periodic_axes``) and open
        boundaries along the others. With
        ``DomainConfig(wrap_whole_axes=True)`` the runtime then sends no
        periodic image rows along an axis the rank grid leaves whole, for the
        models nvdd ships (record 0079); without this declaration, or for a
        model of the user's, the model keeps image rows there.
        Not with ``receptive_field_layers`` (a model nvdd does not ship, whose
        behaviour on a partly periodic cell nothing vouches for).

    Notes
    -----
    Edges are always kept for owned receivers only (every global edge lives on
    exactly one rank) and per-layer exchanges follow from ``scatter``; the
    former ``owned_receivers_only`` and ``refresh_per_layer`` fields were read by
    nothing and were removed.
    """

    scatter: ScatterMode = ScatterMode.NONE
    extra_ghost_width: float = 0.0
    global_coupling: GlobalCoupling = GlobalCoupling.NONE
    receptive_field_layers: int = 0
    receptive_field_fold: bool = False
    wraps_periodic_axes: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.scatter, ScatterMode):
            raise ConfigurationError(
                f"StrategyOptions.scatter must be a ScatterMode, got {self.scatter!r}"
            )
        if not isinstance(self.global_coupling, GlobalCoupling):
            raise ConfigurationError(
                f"StrategyOptions.global_coupling must be a GlobalCoupling, got {self.global_coupling!r}"
            )
        if not (self.extra_ghost_width >= 0.0):
            raise ConfigurationError(
                f"StrategyOptions.extra_ghost_width must be >= 0, got {self.extra_ghost_width!r}"
            )
        layers = self.receptive_field_layers
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
            raise ConfigurationError(
                "StrategyOptions.receptive_field_layers must be an int >= 0 (message-passing "
                f"layers; 0: not declared), got {layers!r}"
            )
        if not isinstance(self.receptive_field_fold, bool):
            raise ConfigurationError(
                "StrategyOptions.receptive_field_fold must be a bool, got "
                f"{self.receptive_field_fold!r}"
            )
        if self.receptive_field_fold and layers == 0:
            raise ConfigurationError(
                "StrategyOptions.receptive_field_fold needs receptive_field_layers > 0"
            )
        if not isinstance(self.wraps_periodic_axes, bool):
            raise ConfigurationError(
                "StrategyOptions.wraps_periodic_axes must be a bool, got "
                f"{self.wraps_periodic_axes!r}"
            )
        if self.wraps_periodic_axes and layers > 0:
            raise ConfigurationError(
                "StrategyOptions.wraps_periodic_axes does not apply to the receptive-field spec "
                "(receptive_field_layers > 0): its model keeps explicit image rows"
            )


def record_to_dict(obj: Any) -> dict[str, Any]:
    """A frozen record as a JSON-able dict (enums by value)."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = v.value if isinstance(v, enum.Enum) else v
    return out


E = TypeVar("E", bound=enum.Enum)


def reject_unknown_fields(
    data: Mapping[str, Any], known: Iterable[str], where: str, suffix: str = ""
) -> None:
    """Raise :class:`ConfigurationError` naming ``where`` and every key of ``data``
    not in ``known`` (sorted), followed by ``suffix``."""
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigurationError(f"{where}: unknown field(s) {unknown}{suffix}")


def enum_field(etype: type[E], data: Mapping[str, Any], key: str, default: E, where: str) -> E:
    """``etype(data[key])``, or ``default`` when ``data`` has no ``key``.

    Raises :class:`ConfigurationError` (``"<where>: bad <key> <value>"``) for a value
    that is not one of ``etype``'s.
    """
    try:
        return etype(data.get(key, default.value))
    except ValueError as exc:
        raise ConfigurationError(f"{where}: bad {key} {data.get(key)!r}") from exc


def record_from_dict(cls: type[Any], data: dict[str, Any], where: str) -> Any:
    """Rebuild a frozen record from :func:`record_to_dict`'s output."""
    reject_unknown_fields(data, (f.name for f in fields(cls)), where, f" for {cls.__name__}")
    kwargs: dict[str, Any] = {}
    enum_types = {
        "kind": OutputKind,
        "reduce": Reduce,
        "scatter": ScatterMode,
        "global_coupling": GlobalCoupling,
    }
    for name, value in data.items():
        etype = enum_types.get(name)
        if etype is not None:
            try:
                value = etype(value)
            except ValueError as exc:
                raise ConfigurationError(
                    f"{where}: {name}={value!r} is not a {etype.__name__}"
                ) from exc
        kwargs[name] = value
    return cls(**kwargs)
