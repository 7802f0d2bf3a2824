"""`PipelineModel`: a composed model, the sum of several models (LJ + Ewald, MPNN + D3 + PME).

On one process it is a model like the others: every output present in every
component (energy, forces, atom energies, virial, stress) is the sum of the
components'. Under domain decomposition the runtime
(``nvdd.dynamics.DistributedPipelineModel``, which ``DomainParallel`` builds
for any model exposing :attr:`PipelineModel.pipeline_components`) runs each
component on the same ``[owned | ghost]`` rows, each communicating and
consolidated by its own spec, and sums the results: a component's energy may
be a per-rank partial and another's replicated, which one forward of the sum
could not express.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from nvdd.core import Batch, ModelOutputs
from nvdd.models._checks import config_error
from nvdd.shardtensor import current_dd_context
from nvdd.spec import BaseModelMixin, MLIPSpec, StrategyKind, as_model

__all__ = ["PipelineModel"]

_SUMMED = ("energy", "forces", "atom_energies", "virial", "stress")


class PipelineModel(BaseModelMixin, torch.nn.Module):
    """The sum of ``models`` (each a ``BaseModelMixin`` module).

    Parameters
    ----------
    models:
        Two or more components (one is allowed too).

    Raises
    ------
    ConfigurationError
        Without components, or with a component that is not a ``torch.nn.Module``
        with a ``distribution_spec``.

    Examples
    --------
    >>> model = PipelineModel([LennardJones(lj), Ewald(EwaldConfig(cutoff=8.0))])
    >>> out = model(assign_charges(batch, {11: 1.0, 17: -1.0}))
    """

    def __init__(self, models: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        models = list(models)
        if not models:
            raise config_error("PipelineModel needs at least one component model")
        for k, m in enumerate(models):
            if not isinstance(m, torch.nn.Module) or not hasattr(m, "distribution_spec"):
                raise config_error(
                    f"PipelineModel component {k} ({type(m).__name__}) must be a torch.nn.Module "
                    "with distribution_spec (a BaseModelMixin)"
                )
        self.components = torch.nn.ModuleList(models)

    @property
    def pipeline_components(self) -> tuple[Any, ...]:
        """The component models, in order (the runtime's marker of a pipeline)."""
        return tuple(self.components)

    @property
    def cutoff(self) -> float:
        """The largest component cutoff (Angstrom)."""
        return max(float(getattr(m, "cutoff", 0.0)) for m in self.components)

    def distribution_spec(self, strategy: StrategyKind | str = StrategyKind.HALO) -> MLIPSpec:
        """The components' specs composed with ``|`` (adapters and sharded fields of
        all; the widest extra halo). The runtime consolidates each component by
        its own spec; this merge is what the pipeline needs as a whole."""
        specs: list[MLIPSpec] = [_spec_of(m, strategy) for m in self.components]
        merged = specs[0]
        for s in specs[1:]:
            merged = merged | s
        widest = max(s.options.extra_ghost_width for s in specs)
        options = dataclasses.replace(
            merged.options,
            extra_ghost_width=widest,
            wraps_periodic_axes=all(s.options.wraps_periodic_axes for s in specs),
        )
        name = "pipeline(" + ", ".join(s.name for s in specs) + ")"
        outputs = dict(merged.outputs)
        folded = [s.output("forces") for s in specs if s.folds_forces]
        if folded:  # the sum's ghost rows hold some component's share: they are folded
            outputs["forces"] = folded[0]
        return merged.replace(options=options, name=name, outputs=outputs)

    def distributed_setup(self, ctx: Any) -> None:
        """Forward the scope's opening to every component."""
        for m in self.components:
            as_model(m).distributed_setup(ctx)

    def distributed_teardown(self) -> None:
        """Forward the scope's closing to every component."""
        for m in self.components:
            as_model(m).distributed_teardown()

    def forward(self, batch: Batch, **kwargs: Any) -> ModelOutputs:
        """The sum of the components' outputs (keys every component returns).

        Raises
        ------
        ConfigurationError
            Under a live DD context: the runtime must run the components one by
            one (``DistributedPipelineModel``), each consolidated by its own spec.
        """
        if current_dd_context().layout is not None:
            raise config_error(
                "PipelineModel called as one model under a live DD context: its components "
                "must run one by one, each consolidated by its own spec; DomainParallel does "
                "that under either strategy (nvdd.dynamics.distributed_model_for picks "
                "DistributedPipelineModel or, for StrategyKind.GRAPH_PARTITION, "
                "GraphPartitionPipelineModel)"
            )
        outs = [m(batch, **kwargs) for m in self.components]
        total: dict[str, torch.Tensor] = {}
        for key in _SUMMED:
            if all(key in o for o in outs):
                total[key] = torch.stack([o[key].detach() for o in outs]).sum(0)
        return total  # type: ignore[return-value]


def _spec_of(model: torch.nn.Module, strategy: StrategyKind | str) -> MLIPSpec:
    spec: MLIPSpec = getattr(model, "distribution_spec")(strategy)  # noqa: B009 - typed as Module
    return spec
