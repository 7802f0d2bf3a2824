"""The receptive-field safe path: a message-passing model run unmodified under DD.

A model of ``L`` message-passing layers of cutoff ``rc`` gives atom ``j`` an
energy ``E_j`` that depends only on the atoms within ``L rc`` of ``j``. The force
on atom ``i`` is ``-sum_j dE_j/dx_i`` over the atoms ``j`` within ``L rc`` of
``i``, so it is exact on any rank that holds every atom within ``2 L rc`` of
``i``, whatever the model computes for the other rows. With a ghost shell of
``2 L rc + skin`` the model's own forces (or the gradient of its own energy) on
the owned rows are therefore exact: no adapters, no ghost refresh between
layers, no fold. The ghost rows' values (forces, features, energies) are wrong
and dropped. The per-system energy is exact only as the sum of owned atoms'
``atom_energies``; a model that returns none has no per-system energy under
DD (asking for it is an error naming the model, never a wrong number).

With ``fold=True`` (the narrower variant) the halo is ``L rc + skin``: the owned
atoms' energies are exact there, and the runtime differentiates their sum with
respect to every padded row and folds the ghost rows' gradients into their
owners. It needs a model that returns ``atom_energies`` differentiable with
respect to the positions it is given (not detached, no forces of its own that
consumed the graph).

It costs a wider halo (``2 L rc`` instead of ``rc``) and the model's work on it;
adapters (``refresh_neighbors``, a preset) are the faster option where the
model has them (docs/decisions/0067-receptive-field-halo.md gives the measured
gain).
"""

from __future__ import annotations

from collections.abc import Sequence

from nvdd.core import ConfigurationError
from nvdd.spec._spec import DistributionSpec, MLIPSpec
from nvdd.spec._types import (
    ForceStrategy,
    OutputKind,
    OutputSpec,
    Reduce,
    StrategyKind,
    StrategyOptions,
)

__all__ = ["receptive_field_spec"]


def receptive_field_spec(
    layers: int,
    strategy: StrategyKind | str = StrategyKind.HALO,
    *,
    sharded_fields: Sequence[str] = ("positions", "atomic_numbers"),
    extra_ghost_width: float = 0.0,
    fold: bool = False,
) -> MLIPSpec:
    """The safe path for a model of ``layers`` message-passing layers, unmodified.

    Pass it as ``DomainParallel(dyn, config, spec=receptive_field_spec(2))``
    (or return it from ``distribution_spec``). The model needs no verbs and no
    adapters: it runs on the padded rows as on one process (its energy may sum
    over every row it is given; its forces may come from its own autograd or,
    when it returns only ``energy``, from the runtime's). The halo is
    ``2 x layers x DomainConfig.cutoff + skin`` (+ ``extra_ghost_width``).

    Parameters
    ----------
    layers:
        Message-passing layers ``L`` (interaction blocks) of the model, each
        reaching ``cutoff``; a pair potential is ``1``. Declaring too few makes
        the owned rows wrong (``DomainParallel.partition`` checks a model nvdd
        does not ship against one process, as for any autograd spec).
    strategy:
        ``StrategyKind.HALO`` (ghosts are explicit images within the width,
        open boundaries) or ``GRAPH_PARTITION`` (ghosts are the atoms within
        the width, at their own positions with the real cell: the ``2 L``-hop
        neighbourhood of the owned block).
    sharded_fields:
        Per-atom batch fields the model reads at neighbours (exchanged to ghost rows).
    extra_ghost_width:
        Angstrom added to the halo on top of ``2 L cutoff + skin``.
    fold:
        The narrower variant: a halo of ``L cutoff + skin``, forces ``-d/dx`` of
        the owned rows' ``atom_energies`` (the model must return them
        differentiable w.r.t. its input positions; its own ``forces`` are
        ignored), ghost rows folded into their owners.

    Returns
    -------
    MLIPSpec
        Named ``receptive_field(L=<layers>)`` (``..., fold)``): forces (folded
        under ``fold``) and ``atom_energies`` kept on owned rows, ``energy`` the per-system sum of
        owned ``atom_energies`` (summed over ranks on demand), autograd force
        strategy, ``StrategyOptions(receptive_field_layers=layers)``.
    """
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ConfigurationError(
            f"receptive_field_spec: layers must be an int >= 1 (message-passing layers), "
            f"got {layers!r}"
        )
    if not isinstance(fold, bool):
        raise ConfigurationError(f"receptive_field_spec: fold must be a bool, got {fold!r}")
    kind = StrategyKind(strategy)
    owned = OutputSpec(OutputKind.PER_NODE, Reduce.OWNED_ONLY)
    folded = OutputSpec(OutputKind.PER_NODE, Reduce.ALL_REDUCE)
    return MLIPSpec(
        name=f"receptive_field(L={layers}{', fold' if fold else ''})",
        outputs={
            "forces": folded if fold else owned,
            "atom_energies": owned,
            # not the model's own "energy" (a sum over ghost rows too): the
            # runtime's per-system sum of owned atom energies, a partial per rank
            "energy": OutputSpec(OutputKind.PER_GRAPH, Reduce.ALL_REDUCE),
        },
        distribution=DistributionSpec(storage=kind, sharded_fields=tuple(sharded_fields)),
        force_strategy=ForceStrategy.AUTOGRAD,
        options=StrategyOptions(
            receptive_field_layers=layers,
            receptive_field_fold=fold,
            extra_ghost_width=float(extra_ghost_width),
        ),
    )
