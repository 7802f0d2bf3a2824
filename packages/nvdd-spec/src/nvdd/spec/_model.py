"""The model contract: `BaseModelMixin`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nvdd.core import Batch, ConfigurationError, ModelOutputs
from nvdd.spec._types import StrategyKind

if TYPE_CHECKING:
    from nvdd.spec._spec import MLIPSpec

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

    def distributed_setup(self, ctx: Any) -> None:
        """Called when a distributed scope opens with this model (default: nothing)."""

    def distributed_teardown(self) -> None:
        """Called when the distributed scope closes (default: nothing)."""
