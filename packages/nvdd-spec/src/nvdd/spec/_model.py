"""The model contract: `BaseModelMixin`."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from nvdd.core import Batch, ConfigurationError, ModelOutputs
from nvdd.spec._types import StrategyKind

if TYPE_CHECKING:
    from nvdd.spec._spec import MLIPSpec
    from nvdd.spec._types import CompilePolicy

__all__ = ["BaseModelMixin"]

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

    def distributed_setup(self, ctx: Any) -> None:
        """Called when a distributed scope opens with this model (default: nothing)."""

    def distributed_teardown(self) -> None:
        """Called when the distributed scope closes (default: nothing)."""
