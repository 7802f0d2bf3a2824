"""`DistributedPipelineModel`: a composed model (a sum of components) under one halo.

Per call, on top of :class:`DistributedModel`'s rebuild check and migration:

1. one forward exchange of ghost positions, shared by every component;
2. each component on the same ``[owned | ghost]`` rows inside the DD context,
   communicating as its own spec says (a CN refresh, a structure-factor or mesh
   all-reduce, per-layer folds, ...), with its own positions leaf when its
   forces come from autograd;
3. the components' padded forces summed, then ONE reverse exchange folds the
   ghost rows into their owners (not one per component); a component whose
   spec declares direct forces ``OWNED_ONLY`` adds its owned rows only;
4. every other output consolidated by its component's spec: per-rank partials
   (``Reduce.ALL_REDUCE``) summed locally and kept pending (one all-reduce when
   a hook asks, as for a single model); values already global on every rank
   (``OWNED_ONLY``) summed and added to the reduced partials.

The halo is as wide as the widest component needs:
``max(cutoff_c + extra_ghost_width_c) + skin`` (+ the migration hysteresis).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from nvdd.core import Batch, ConfigurationError, ModelOutputs
from nvdd.dynamics._config import DomainConfig
from nvdd.dynamics._distributed_model import DistributedModel, shipped_model
from nvdd.dynamics._graph_partition import GraphPartitionModel
from nvdd.dynamics._provider import ProviderBase, consolidate, extract_forces, folds_forces
from nvdd.dynamics._step import StepState
from nvdd.dynamics._whole_batch import WholeBatchModel
from nvdd.shardtensor import dd_scope
from nvdd.spec import (
    BaseModelMixin,
    ForceStrategy,
    MLIPSpec,
    ModelContract,
    StrategyKind,
    as_model,
    unwrap_model,
)

__all__ = [
    "DistributedPipelineModel",
    "GraphPartitionPipelineModel",
    "distributed_model_for",
    "pipeline_components",
]


def pipeline_components(model: Any) -> tuple[Any, ...] | None:
    """The components of a composed model (its ``pipeline_components``), else None."""
    declared = as_model(model).pipeline_components
    if declared is None:
        return None
    parts = tuple(declared)
    if not parts:
        raise ConfigurationError(f"{type(model).__name__}.pipeline_components is empty")
    return parts


def distributed_model_for(
    model: Any,
    config: DomainConfig,
    *,
    spec: MLIPSpec | None = None,
    world_size: int | None = None,
    **kwargs: Any,
) -> ProviderBase:
    """The runtime adapter of ``model``: a :class:`DistributedPipelineModel` for a
    composed model (one exposing ``pipeline_components``, e.g.
    ``nvdd.models.PipelineModel``), else a :class:`DistributedModel`; under
    ``StrategyKind.GRAPH_PARTITION`` their graph-partition counterparts
    (:class:`GraphPartitionPipelineModel`, ``GraphPartitionModel``). A single
    model under the halo on a world of one (``world_size=1``) runs on the
    whole batch (:class:`~nvdd.dynamics.WholeBatchModel`) unless
    ``config.halo_on_one_rank``; a pipeline runs its components on padded rows
    whatever the world size.

    Raises
    ------
    ConfigurationError
        A ``spec`` override with a pipeline (each component brings its own); a
        component without a spec for ``config.strategy`` (its model says which
        strategy it supports).
    """
    graph = config.strategy is StrategyKind.GRAPH_PARTITION
    parts = pipeline_components(model)
    if parts is None:
        if world_size == 1 and not graph and not config.halo_on_one_rank:
            return WholeBatchModel(model, config, spec=spec, **kwargs)
        single = GraphPartitionModel if graph else DistributedModel
        return single(model, config, spec=spec, **kwargs)
    if spec is not None:
        raise ConfigurationError(
            "DomainParallel(spec=...) cannot override a pipeline's spec: each component is "
            "consolidated by its own distribution_spec; set the components' specs instead"
        )
    composed = GraphPartitionPipelineModel if graph else DistributedPipelineModel
    return composed(parts, config, pipeline=model, **kwargs)


class DistributedPipelineModel(DistributedModel):
    """Domain decomposition of a composed (pipeline) model: the sum of its components.

    Parameters
    ----------
    models:
        The components (each a ``BaseModelMixin``), or a composed model exposing
        ``pipeline_components``.
    config:
        The :class:`DomainConfig`; its cutoff must cover every component's.
    pipeline:
        The composed model the components come from (its ``distributed_setup``
        / ``distributed_teardown`` are called); default: none.
    **kwargs:
        As :class:`DistributedModel` (``count``, ``sync_timings``).

    Notes
    -----
    **Collective** like :class:`DistributedModel`: per call one rebuild flag
    all-reduce, one forward and (when some component's forces fold) one reverse
    exchange, plus what each component's spec asks for.
    """

    _captures_halo_steps = False  # (its own step: not captured)

    def __init__(
        self,
        models: Sequence[Any] | Any,
        config: DomainConfig,
        *,
        pipeline: Any = None,
        **kwargs: Any,
    ) -> None:
        parts = pipeline_components(models)
        if parts is not None:
            pipeline, models = models, parts
        models = [as_model(m) for m in models]
        if not models:
            raise ConfigurationError("DistributedPipelineModel needs at least one model")
        self.components = [(m, m.distribution_spec(config.strategy)) for m in models]
        specs = [s for _, s in self.components]
        if any(s.owned_rows_exact for s in specs):
            raise ConfigurationError(
                "a pipeline's components cannot use the receptive-field spec "
                "(receptive_field_spec): run such a model on its own, or declare adapters"
            )
        merged = specs[0]
        for s in specs[1:]:
            merged = merged | s
        reach = max(float(m.cutoff) + s.options.extra_ghost_width for m, s in self.components)
        options = dataclasses.replace(
            merged.options,
            extra_ghost_width=max(0.0, reach - config.cutoff),
            # one halo for every component: periodic whole axes only if all take them
            wraps_periodic_axes=all(s.options.wraps_periodic_axes for s in specs),
        )
        merged = merged.replace(options=options)
        #: Whether some component's ghost rows carry forces to fold (else no reverse exchange).
        self.folds = any(folds_forces(s) for s in specs)
        self.pipeline = pipeline
        scope = None if pipeline is None else as_model(pipeline)
        super().__init__(_Components(models, scope), config, spec=merged, **kwargs)

    def _ships_models(self) -> bool:
        """Whether every component is a model nvdd ships (one halo for all)."""
        return all(shipped_model(unwrap_model(m)) for m, _ in self.components)

    def forward(self, st: StepState) -> None:
        """Phase 4: every component on the padded rows (each by its own spec);
        ``st.raw``: the summed forces to fold, the summed owned-row forces, the
        summed totals and per-system partials."""
        local, padded = st.batch, st.padded.detach()
        plan, static = self.plan, self._static
        assert static is not None
        owned = local.positions.detach()
        f_padded = torch.zeros_like(padded)
        n = plan.n_owned
        f_owned = torch.zeros_like(owned)  # components whose spec says owned rows are exact
        finals: dict[str, torch.Tensor] = {}
        partials: dict[str, torch.Tensor] = {}
        for model, spec in self.components:
            autograd = spec.force_strategy is ForceStrategy.AUTOGRAD
            leaf = padded.detach().requires_grad_(autograd)
            batch = static.replace(positions=leaf, cell=local.cell)
            with (
                dd_scope(self._context(plan, leaf)),
                torch.set_grad_enabled(autograd or torch.is_grad_enabled()),
            ):
                raw = dict(model(batch))
            f_component = extract_forces(raw, leaf, spec.force_strategy, model)
            if folds_forces(spec):
                f_padded = f_padded + f_component
            else:
                f_owned = f_owned + f_component[:n]
            final, partial = consolidate(
                {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in raw.items()},
                spec,
                plan,
                self.sharded.group,
            )
            for target, values in ((finals, final), (partials, partial)):
                for k, v in values.items():
                    if isinstance(v, torch.Tensor):
                        target[k] = target[k] + v if k in target else v
        st.raw = (f_padded, f_owned, finals, partials)
        st.t0 = self._timer("model", st.t0)

    def fold(self, st: StepState) -> ModelOutputs:
        """Phase 5: the summed ghost forces folded to their owners (one reverse
        exchange); per-system partials kept in :attr:`pending`."""
        plan, n = self.plan, self.plan.n_owned
        assert self.pending is not None
        f_padded, f_owned, finals, partials = st.raw
        forces = f_owned + f_padded[:n]
        if self.folds:  # (no component's ghost rows carry forces: no reverse exchange)
            forces = forces + plan.reverse(f_padded[n:])
        t0 = self._timer("fold", st.t0)
        base = {k: finals.pop(k) for k in list(finals) if k in partials}
        self.pending.set(partials, base=base)
        finals["forces"] = forces
        self._timer("reduce", t0)
        return finals  # type: ignore[no-any-return]


class _Components(BaseModelMixin):
    """What :class:`DistributedModel` sees of a pipeline: the largest cutoff, and the
    scope hooks forwarded to the composed model (or to every component)."""

    def __init__(self, models: Sequence[ModelContract], pipeline: ModelContract | None) -> None:
        self.models = list(models)
        self.pipeline = pipeline
        self._cutoff = max(float(m.cutoff) for m in self.models)

    @property
    def cutoff(self) -> float:
        return self._cutoff

    def distributed_setup(self, ctx: Any) -> None:
        for target in [self.pipeline] if self.pipeline is not None else self.models:
            target.distributed_setup(ctx)

    def distributed_teardown(self) -> None:
        for target in [self.pipeline] if self.pipeline is not None else self.models:
            target.distributed_teardown()

    def __call__(self, batch: Batch) -> ModelOutputs:  # pragma: no cover - never called
        raise RuntimeError("the pipeline runs its components one by one")


class GraphPartitionPipelineModel(DistributedPipelineModel, GraphPartitionModel):
    """A composed model under ``StrategyKind.GRAPH_PARTITION``: the components run
    one by one on the index blocks' ``[owned | ghost]`` rows (real cell and pbc),
    as :class:`DistributedPipelineModel` runs them under the halo (one position
    exchange, one fold of the summed forces); the ghost rows, their rebuilds and
    the ghost width are :class:`GraphPartitionModel`'s.

    Every component needs a graph-partition spec
    (``distribution_spec(StrategyKind.GRAPH_PARTITION)``): one without (Ewald,
    PME, DFT-D3) is refused at construction, before any collective.
    **Collective** like :class:`DistributedPipelineModel`.
    """
