"""The model contract: :class:`ModelContract` (what the runtime calls) and
:class:`BaseModelMixin` (the same members with defaults, to mix into a model).

The runtime (``nvdd.dynamics``) calls a model only through the members of
:class:`ModelContract`, and calls them directly: it never probes a model with
``getattr``. A model that derives from :class:`BaseModelMixin` has every member;
any other object is completed once, where the runtime receives it, by
:func:`as_model` (its own members where it has them, the mixin's defaults
otherwise). docs/decisions/0035-model-contract.md says why both.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from nvdd.core import Batch, ConfigurationError, ModelOutputs
from nvdd.spec._types import StrategyKind

if TYPE_CHECKING:
    import torch

    from nvdd.spec._spec import MLIPSpec
    from nvdd.spec._types import CompilePolicy

__all__ = [
    "MODEL_CONTRACT",
    "BaseModelMixin",
    "ModelContract",
    "as_model",
    "begins_steps",
    "unwrap_model",
]


class ModelContract(Protocol):
    """Every member the runtime calls on a model (nothing else is called).

    Implemented, with defaults, by :class:`BaseModelMixin` (see there for what
    each member means). ``__call__`` is the forward (``torch.nn.Module`` provides
    it from ``forward``).
    """

    @property
    def cutoff(self) -> float:
        """Interaction cutoff in Angstrom."""
        ...

    def __call__(self, batch: Batch) -> ModelOutputs:
        """The forward: outputs for ``batch``."""
        ...

    def distribution_spec(self, strategy: StrategyKind = ...) -> MLIPSpec:
        """How this model is parallelised under ``strategy``."""
        ...

    def compile_forward(self, policy: CompilePolicy | None) -> bool:
        """Opt in to compiling its own core (``None``: opt out)."""
        ...

    @property
    def compile_unsupported(self) -> str | None:
        """Why the model cannot run under ``torch.compile`` (None: it can)."""
        ...

    def graph_key(self, batch: Batch) -> Hashable | None:
        """A token for a CUDA-graph capture of the forward (None: never)."""
        ...

    @property
    def splits_step(self) -> bool:
        """Whether a step is split at the model's own decision."""
        ...

    def begin_step(self, batch: Batch) -> None:
        """Queue the step's own decision on the device, unread."""
        ...

    def overflow_flag(self) -> torch.Tensor | None:
        """The device flag of :meth:`begin_step` (None: nothing to fold)."""
        ...

    def take_verdict(self, batch: Batch) -> bool:
        """Read the decision of :meth:`begin_step`: whether the rest may run captured."""
        ...

    def distributed_setup(self, ctx: Any) -> None:
        """Called when a distributed scope opens with this model."""
        ...

    def distributed_teardown(self) -> None:
        """Called when the distributed scope closes."""
        ...

    @property
    def pipeline_components(self) -> Sequence[Any] | None:
        """The models a composed model sums (None: a single model)."""
        ...


#: The names of :class:`ModelContract`'s members: all the runtime may call on a model.
MODEL_CONTRACT = frozenset(
    {
        "cutoff",
        "__call__",
        "distribution_spec",
        "compile_forward",
        "compile_unsupported",
        "graph_key",
        "splits_step",
        "begin_step",
        "overflow_flag",
        "take_verdict",
        "distributed_setup",
        "distributed_teardown",
        "pipeline_components",
    }
)

_PRESETS = (
    "SPEC_LJ_HALO, SPEC_MPNN_HALO, SPEC_UMA_HALO, SPEC_EWALD_HALO, SPEC_PME_HALO, "
    "SPEC_DFTD3_HALO, SPEC_MPNN_GP"
)


class BaseModelMixin:
    """What a model provides to run under nvdd (mix into a ``torch.nn.Module``).

    A model implements :meth:`forward` on a :class:`~nvdd.core.Batch` (under domain
    decomposition the batch holds this rank's ``[owned | ghost]`` rows with open
    boundaries), exposes its interaction :attr:`cutoff`, and declares how it is
    parallelised with :meth:`distribution_spec`.
    """

    if TYPE_CHECKING:  # (torch.nn.Module provides it: forward behind its hooks)

        def __call__(self, batch: Batch) -> ModelOutputs: ...

    @property
    def cutoff(self) -> float:
        """Interaction cutoff in Angstrom."""
        raise NotImplementedError(f"{type(self).__name__} must define the property 'cutoff'")

    def forward(self, batch: Batch) -> ModelOutputs:
        """Outputs for ``batch`` (``nvdd.core.ModelOutputs`` keys)."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward(batch)")

    def distribution_spec(self, strategy: StrategyKind = StrategyKind.HALO) -> MLIPSpec:
        """How this model is parallelised under ``strategy``.

        The default raises: a model must declare its spec. Start from a preset in
        ``nvdd.spec`` and compose overrides with ``|``.
        """
        raise ConfigurationError(
            f"{type(self).__name__} declares no distribution spec for {strategy}; override "
            f"distribution_spec(strategy) and return a preset ({_PRESETS}) or a composition "
            "of one, e.g. SPEC_MPNN_HALO | MLIPSpec(outputs=...)"
        )

    def compile_forward(self, policy: CompilePolicy | None) -> bool:
        """Opt in to the runtime's shape-stable compiled forward (``None``: opt out).

        The runtime calls it once when a compiled scope opens (``DomainConfig(
        compile=True)`` or an enabled :class:`CompilePolicy`) and with ``None``
        when the scope closes. A model that returns True compiles its own tensor
        core with :meth:`CompilePolicy.compile` and keeps its ``forward`` eager
        around it: the neighbour search, the input checks and every DD verb
        (``refresh_neighbors``, ``system_sum``, ...) stay outside the compiled
        regions, and with ``policy.pad_shapes`` it pads atoms and edges to
        capacities agreed by every rank at each new halo topology
        (``nvdd.padding``), so the compiled regions see fixed shapes and
        compile once. The default returns False: the runtime then compiles the
        whole ``forward`` with ``torch.compile`` (dynamic shapes, no padding;
        graph breaks at whatever Dynamo cannot trace).
        """
        return False

    @property
    def compile_unsupported(self) -> str | None:
        """Why this model cannot run under ``torch.compile`` (None, the default: it can).

        A model that says why (a class attribute is enough) is refused when a
        distributed model is built with ``DomainConfig(compile=True)`` or an
        enabled :class:`CompilePolicy`: ``ConfigurationError`` naming the model
        and this reason, on every rank, before any collective or compile,
        instead of a failure inside Dynamo at the first step.
        """
        return None

    def graph_key(self, batch: Batch) -> Hashable | None:
        """Whether :meth:`forward` on ``batch`` may be captured in a CUDA graph.

        ``None`` (the default): never; the integrators then run every step
        eagerly. A model that opts in returns a token that changes whenever a
        capture of its forward would no longer replay correctly (its buffers
        moved, a host-side decision changed); it then does no host
        synchronisation in a steady call, keeps its buffers at fixed addresses,
        and moves per-call host work to :func:`nvdd.core.after_replay`
        (see :mod:`nvdd.core._capture`).
        """
        return None

    @property
    def splits_step(self) -> bool:
        """Whether a step through this model is split at its own decision: the
        runtime calls :meth:`begin_step` in the step's head (a CUDA graph of its
        own), reads :meth:`take_verdict` on the host, and only then runs (or
        replays) the rest. Asked inside the step's DD context; every rank must
        answer alike (the runtime's collectives depend on it). Default False.
        """
        return False

    def begin_step(self, batch: Batch) -> None:
        """Queue this step's own decision on the device, unread and capturable
        (e.g. a neighbour search into fixed buffers). Local (no communication).
        Called only when :attr:`splits_step` is True; default: nothing."""

    def overflow_flag(self) -> torch.Tensor | None:
        """The device flag of :meth:`begin_step` (nonzero: its buffers did not
        fit), which the halo runtime folds into its own step decision; None
        (the default): nothing to fold."""
        return None

    def take_verdict(self, batch: Batch) -> bool:
        """Read the decision of :meth:`begin_step` (one host read): True when the
        rest of the step may run as captured, False when this step must run
        eagerly (the model grew its buffers). Default True."""
        return True

    def distributed_setup(self, ctx: Any) -> None:
        """Called when a distributed scope opens with this model (default: nothing)."""

    def distributed_teardown(self) -> None:
        """Called when the distributed scope closes (default: nothing)."""

    @property
    def pipeline_components(self) -> Sequence[Any] | None:
        """The models this one sums, for a composed model that the runtime runs
        component by component (each by its own spec, e.g.
        ``nvdd.models.PipelineModel``); None (the default): a single model."""
        return None


def begins_steps(model: ModelContract) -> bool:
    """Whether ``model`` has a :meth:`~BaseModelMixin.begin_step` of its own (not
    the mixin's no-op): only then may it split its steps. Read once per scope,
    so a step of any other model never asks :attr:`~BaseModelMixin.splits_step`."""
    if isinstance(model, _Completed):
        return model.own_begin_step is not None
    return getattr(type(model), "begin_step", None) is not BaseModelMixin.begin_step


def as_model(obj: object) -> ModelContract:
    """``obj`` as a :class:`ModelContract`: itself when it derives from
    :class:`BaseModelMixin` (or is already completed), else a thin wrapper
    that calls ``obj``'s own members where it has them and the mixin's
    defaults otherwise (a plain callable, a module that declares a few hooks).

    The one place where the runtime looks at what an object offers; called
    once where a model enters the runtime, never per step.
    """
    if isinstance(obj, BaseModelMixin):
        return obj
    return _Completed(obj)


def unwrap_model(model: ModelContract) -> object:
    """The object :func:`as_model` was given (``model`` itself for a
    :class:`BaseModelMixin`): for messages that name the model's class and
    for checks of its tensors."""
    return model.wrapped if isinstance(model, _Completed) else model


class _Completed(BaseModelMixin):
    """A model that does not derive from :class:`BaseModelMixin`, completed with
    its defaults (see :func:`as_model`)."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped
        self._call: Callable[[Batch], ModelOutputs] = wrapped
        self.own_begin_step: Callable[[Batch], None] | None = getattr(wrapped, "begin_step", None)

    def _own(self, name: str) -> Any:
        return getattr(self.wrapped, name, None)

    def __call__(self, batch: Batch) -> ModelOutputs:
        return self._call(batch)

    def forward(self, batch: Batch) -> ModelOutputs:
        return self._call(batch)

    @property
    def cutoff(self) -> float:
        cutoff = self._own("cutoff")
        if cutoff is None:
            raise ConfigurationError(
                f"{type(self.wrapped).__name__} declares no 'cutoff' (its interaction range "
                "in Angstrom); derive the model from nvdd.spec.BaseModelMixin and define it"
            )
        return float(cutoff)

    def distribution_spec(self, strategy: StrategyKind = StrategyKind.HALO) -> MLIPSpec:
        own = self._own("distribution_spec")
        if own is None:
            return super().distribution_spec(strategy)
        spec: MLIPSpec = own(strategy)
        return spec

    def compile_forward(self, policy: CompilePolicy | None) -> bool:
        own = self._own("compile_forward")
        return False if own is None else bool(own(policy))

    @property
    def compile_unsupported(self) -> str | None:
        own = self._own("compile_unsupported")
        return None if own is None else str(own)

    def graph_key(self, batch: Batch) -> Hashable | None:
        own = self._own("graph_key")
        key: Hashable | None = None if own is None else own(batch)
        return key

    @property
    def splits_step(self) -> bool:
        return bool(self._own("splits_step"))

    def begin_step(self, batch: Batch) -> None:
        if self.own_begin_step is not None:
            self.own_begin_step(batch)

    def overflow_flag(self) -> torch.Tensor | None:
        own = self._own("overflow_flag")
        flag: torch.Tensor | None = None if own is None else own()
        return flag

    def take_verdict(self, batch: Batch) -> bool:
        own = self._own("take_verdict")
        return True if own is None else bool(own(batch))

    def distributed_setup(self, ctx: Any) -> None:
        own = self._own("distributed_setup")
        if own is not None:
            own(ctx)

    def distributed_teardown(self) -> None:
        own = self._own("distributed_teardown")
        if own is not None:
            own()

    @property
    def pipeline_components(self) -> Sequence[Any] | None:
        parts: Sequence[Any] | None = self._own("pipeline_components")
        return parts
