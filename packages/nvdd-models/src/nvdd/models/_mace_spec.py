"""The distribution specs of a MACE model: owned receivers plus one ghost refresh
before every interaction that reads neighbour features, for the halo
(``SPEC_MACE_HALO``) and the graph partition (``SPEC_MACE_GP``).

Why this is exact (the argument the tests check numerically):

1. Edges exist only for owned receivers (``n_receivers = layout.n_owned``), so
   every message aggregated in an interaction block lands on an owned row, and an
   owned row receives the messages of *all* its neighbours (the halo holds every
   atom within ``cutoff + skin`` of the box). Owned rows of an interaction's output
   are therefore exact whenever the sender rows it reads are exact.
2. The first interaction reads ``node_embedding(node_attrs)``: a per-atom
   function of the species, and ghost species are exchanged with the halo plan.
   Its sender rows are exact without any exchange.
3. Interaction ``i >= 1`` reads the previous product block's output, whose ghost
   rows were computed from incomplete neighbourhoods. Refreshing exactly that
   tensor (``node_feats``, the input of the interaction) copies the owners'
   exact rows into the ghosts: sender rows exact again.
4. Product and readout blocks are per-atom; energies count owned rows only
   (``system_sum``), so ghost rows of the last product need no refresh.
5. So no ghost row of a product block's output is ever read: the next
   interaction reads it refreshed (the refresh overwrites ghost rows, and its
   adjoint gives their input rows no gradient), and the last one's ghost rows
   feed energies that are not counted. The product block therefore runs on the
   owned rows only and returns zeros for the others
   (:func:`owned_rows_product`): the symmetric contraction, the most expensive
   per-atom block, is not paid for the ghosts.

So an ``L``-interaction MACE needs ``L - 1`` refreshes per forward, and each
costs one halo exchange forward and one reverse exchange in the backward (the
adjoint of the refresh folds ghost gradients into their owners): two exchanges
per interaction at most, and none for the first. Refreshing the output of
every ``EquivariantProductBasisBlock`` instead (the generic
``neighbor_refresh_adapters`` fix) is also exact but pays for the last block too.

The graph partition (``StrategyKind.GRAPH_PARTITION``) needs nothing else. Its
ghost rows are the atoms within ``cutoff + skin`` of an owned atom in any
periodic image, at their own positions, with the real cell and pbc: MACE's
graph (the wrapper's periodic Verlet list, edges into owned rows only) reads
each neighbour through its image shift, and a node feature is the same for
every image of an atom. Points 1 to 5 hold as written, with "the halo holds
every atom" read as "the ghost set holds every atom within reach of an owned
one", so ``SPEC_MACE_GP`` is ``SPEC_MACE_HALO`` with ``storage =
GRAPH_PARTITION``: the same adapters and the same ``L - 1`` refreshes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from nvdd.core import ConfigurationError, get_rank
from nvdd.shardtensor import current_dd_context, refresh_neighbors
from nvdd.spec import (
    SPEC_MPNN_HALO,
    DistributionSpec,
    MethodAdapter,
    MLIPSpec,
    ScatterMode,
    StrategyKind,
    StrategyOptions,
    distributed_method,
)

__all__ = [
    "SPEC_MACE_GP_NAME",
    "SPEC_MACE_NAME",
    "mace_graph_spec",
    "mace_halo_spec",
    "owned_rows_product",
    "refresh_interaction_input",
]

#: Name of the halo spec a :class:`~nvdd.models.MACEModel` declares.
SPEC_MACE_NAME = "SPEC_MACE_HALO"
#: Name of its graph-partition spec.
SPEC_MACE_GP_NAME = "SPEC_MACE_GP"


@distributed_method
def refresh_interaction_input(
    original: Callable[..., Any], self_: Any, *args: Any, **kwargs: Any
) -> Any:
    """MethodAdapter body for a MACE interaction block's ``forward``.

    Refreshes the ghost rows of ``node_feats`` (keyword, or the second positional
    argument as in mace-torch's signature) before the block reads it, unless the
    caller says ``first_layer=True`` (MACE's first interaction reads the species
    embedding, exact on ghost rows). **Collective** under a live DD context (one
    halo exchange forward, one reverse exchange backward); the original method
    runs unchanged outside DD.
    """
    if kwargs.get("first_layer", False) is True:
        return original(self_, *args, **kwargs)
    if "node_feats" in kwargs:
        kwargs["node_feats"] = refresh_neighbors(kwargs["node_feats"])
    elif len(args) >= 2 and isinstance(args[1], torch.Tensor):
        args = (args[0], refresh_neighbors(args[1]), *args[2:])
    else:
        raise ConfigurationError(
            f"rank {get_rank()}: refresh_interaction_input: {type(self_).__name__}.forward was "
            "called without node_feats (keyword or second positional argument); it cannot "
            "refresh the neighbour features this interaction reads"
        )
    return original(self_, *args, **kwargs)


@distributed_method
def owned_rows_product(original: Callable[..., Any], self_: Any, *args: Any, **kwargs: Any) -> Any:
    """MethodAdapter body for a MACE product block's ``forward``: per-atom work on
    the owned rows only.

    Under a live DD context whose layout has ghost rows, every tensor argument
    with the layout's ``n_padded`` rows (``node_feats``, ``sc``, ``node_attrs``)
    is cut to its first ``n_owned`` rows, the block runs on them, and its output
    is padded with zero rows back to ``n_padded``. Exact because no ghost row of
    a product's output is read (module notes, point 5). Local (no
    communication); the original runs unchanged outside DD, without ghost rows,
    without owned rows, or when an argument's rows do not match the layout.
    """
    layout = current_dd_context().layout
    # (no owned row: the block runs as it is, since some blocks cannot take 0 rows)
    if layout is None or not 0 < layout.n_owned < layout.n_padded:
        return original(self_, *args, **kwargs)
    n_owned, n_rows = layout.n_owned, layout.n_padded
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    if not tensors or any(t.dim() == 0 or t.shape[0] != n_rows for t in tensors):
        return original(self_, *args, **kwargs)

    def cut(v: Any) -> Any:
        return v[:n_owned] if isinstance(v, torch.Tensor) else v

    out = original(self_, *(cut(a) for a in args), **{k: cut(v) for k, v in kwargs.items()})
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != n_owned:
        raise ConfigurationError(
            f"rank {get_rank()}: owned_rows_product: {type(self_).__name__}.forward on "
            f"{n_owned} owned rows returned "
            f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}; "
            "expected one per-atom tensor with a row per owned atom"
        )
    return torch.cat([out, out.new_zeros((n_rows - n_owned, *out.shape[1:]))])


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _mace_spec(
    name: str,
    storage: StrategyKind,
    interaction_classes: Iterable[type],
    product_classes: Iterable[type],
) -> MLIPSpec:
    adapters = tuple(
        MethodAdapter(f"{_class_name(cls)}.forward", body, declared_in=name)
        for classes, body in (
            (interaction_classes, refresh_interaction_input),
            (product_classes, owned_rows_product),
        )
        for cls in dict.fromkeys(classes)
    )
    return SPEC_MPNN_HALO | MLIPSpec(
        name=name,
        distribution=DistributionSpec(storage=storage, helpers=adapters),
        options=StrategyOptions(scatter=ScatterMode.LOCAL, wraps_periodic_axes=True),
    )


def mace_halo_spec(
    interaction_classes: Iterable[type], product_classes: Iterable[type] = ()
) -> MLIPSpec:
    """The halo spec of a MACE whose interactions ``1..L-1`` have
    ``interaction_classes`` and whose product blocks have ``product_classes``.

    ``SPEC_MPNN_HALO``'s outputs and force strategy (forces by autograd on every
    padded row, replicated energy, virial and stress as per-rank partials), local
    scatters (owned receivers), one :class:`~nvdd.spec.MethodAdapter` per
    interaction class running :func:`refresh_interaction_input` and one per
    product class running :func:`owned_rows_product`.
    """
    return _mace_spec(SPEC_MACE_NAME, StrategyKind.HALO, interaction_classes, product_classes)


def mace_graph_spec(
    interaction_classes: Iterable[type], product_classes: Iterable[type] = ()
) -> MLIPSpec:
    """The graph-partition spec of the same MACE (``SPEC_MACE_GP``): what
    :func:`mace_halo_spec` returns, with ``distribution.storage =
    StrategyKind.GRAPH_PARTITION`` (the same adapters, outputs and force
    strategy; module notes, last paragraph)."""
    return _mace_spec(
        SPEC_MACE_GP_NAME, StrategyKind.GRAPH_PARTITION, interaction_classes, product_classes
    )
