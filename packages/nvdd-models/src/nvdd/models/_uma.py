"""`UMAModel`: a fairchem UMA (eSCN-MD backbone) potential as an nvdd model.

fairchem's ``HydraModel`` is a backbone (``eSCNMDBackbone``, or its
mixture-of-linear-experts variant ``eSCNMDMoeBackbone``) and output heads. The
backbone reads a graph dict: the atoms' numbers and positions, each system's
``charge``, ``spin`` and ``dataset`` (task) name, and, with ``otf_graph``
off, the directed edges ``edge_index = [source, target]`` with integer image
offsets (``x[source] - x[target] + offset @ cell``), and returns a node
embedding; the energy head maps each node's scalar channels to a per-atom
energy (``energy_block``) and sums them per system. The wrapper turns
``otf_graph`` off and feeds that dict from a :class:`~nvdd.core.Batch` with
the package's Verlet list on exactly the rows it is given (one process: the
whole system with its cell and pbc; under ``DomainParallel``: this rank's
``[owned | ghost]`` rows, the ghosts explicit images, record 0006). nvdd's
edge ``(i, j, S)`` has ``r_ij = x[j] - x[i] + S @ cell``, so ``source = j``,
``target = i`` (messages reach ``i``) and the offsets are ``S``: the graph
fairchem's own radius graph builds (a test compares with it).

Per-atom energies are fairchem's energy block on the backbone's node
embedding (denormalised with the checkpoint task's ``rmsd`` and element
references); the forces are their derivative. The model runs unmodified under
:func:`nvdd.spec.receptive_field_spec` with ``fold=True``: the edge-degree
embedding is one message-passing step before the ``num_layers`` blocks, so an
atom's energy depends on the atoms within ``(num_layers + 1) x cutoff``
(record 0078). With ``halo="refresh"`` it runs under ``SPEC_UMA_HALO`` instead:
a halo of one cutoff (plus skin), edges for owned receivers only, and forward
hooks on the edge-degree embedding and on every block but the last that
replace the ghost rows of the node features they return by their owners'
(``refresh_neighbors``); the energy sums the owned rows.

What is not local to an atom's neighbourhood is refused under DD, never
computed on the rank's rows: the mixture-of-linear-experts routing (it reads
the whole system's composition) unless the backbone was merged with fairchem's
``merge_MOLE_model`` for the system's composition (``merge_for=``), and the
charge or spin balanced channels (a sum over every atom of a system). The
charge, spin and task embedding is per system, the same on every rank. A merged
model checks the run's composition once per distributed scope, on its first
forward there: one all-reduce of the owned atoms' element counts, the same
verdict on every rank (record 0078).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, cast

import torch

from nvdd.core import (
    Batch,
    ModelOutputs,
    TensorMemo,
    ValidationError,
    all_reduce,
    get_rank,
)
from nvdd.models._checks import check_positive, config_error
from nvdd.models._dd import energy_scope, halo_spec
from nvdd.models._forces import outputs_by_autograd
from nvdd.models._receptive_wrapper import OptionalPackage, ReceptiveFieldWrapper
from nvdd.models._verlet import VerletList
from nvdd.shardtensor import DDContext, current_dd_context, refresh_neighbors
from nvdd.spec import SPEC_UMA_HALO, MLIPSpec, StrategyKind

__all__ = ["UMAModel"]

_HYDRA = "fairchem.core.models.base.HydraModel"
_BACKBONE = "fairchem.core.models.uma.escn_md.eSCNMDBackbone"
_MOE_BACKBONE = "fairchem.core.models.uma.escn_moe.eSCNMDMoeBackbone"
_EFS_HEAD = "fairchem.core.models.uma.escn_md.MLP_EFS_Head"
#: The ``halo=`` choices: the receptive-field halo (unmodified model) or
#: ``SPEC_UMA_HALO`` (one cutoff of halo, ghost rows refreshed per block).
_HALOS = ("receptive", "refresh")
#: fairchem's edge chunk of activation checkpointing, where its module lacks the
#: constant (``ESCNMD_DEFAULT_EDGE_ACTIVATION_CHECKPOINT_CHUNK_SIZE`` in 2.24).
_CHUNK_FALLBACK = 1024 * 128
#: The attribute of fairchem's edge-wise modules (the edge-degree embedding and
#: each block's ``edge_wise``) that turns activation checkpointing on.
_CHUNK_ATTR = "activation_checkpoint_chunk_size"
#: ``import_optional`` of a fairchem module with the extra's install hint.
fairchem_module = OptionalPackage("fairchem-core", "nvdd-models[uma]", "UMAModel")


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` for the block: fairchem builds new
    modules (merged linears, a merged backbone, its constant tables) in the
    default dtype, which would round a float64 model's weights to float32."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class _GraphDict(dict[str, Any]):
    """The backbone's input: a dict whose ``get`` takes ``default=`` by keyword
    (as fairchem's ``AtomicData.get`` does)."""

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key, default)


def _energy_head(model: Any, head: str | None, task: str | None) -> tuple[str, Any]:
    """The name and the inner ``energy_block`` owner of the model's energy head; a
    dataset-specific mixture head is merged (fairchem's ``merge_MOLE_model``) on
    ``task``."""
    heads = dict(model.output_heads.items())
    names = [n for n, h in heads.items() if hasattr(getattr(h, "head", h), "energy_block")]
    if head is None:
        if len(names) != 1:
            raise config_error(
                f"UMAModel: the model has energy heads {names}; pass head= one of them"
            )
        head = names[0]
    if head not in names:
        raise config_error(f"UMAModel: head {head!r} is not an energy head (energy heads: {names})")
    outer = heads[head]
    if hasattr(outer, "dataset_name_to_exp"):  # DatasetSpecificMoEWrapper
        if task not in outer.dataset_name_to_exp:
            raise config_error(
                f"UMAModel: head {head!r} has one expert per task "
                f"{sorted(outer.dataset_name_to_exp)}; pass task= one of them (got {task!r})"
            )
        if outer.merged_on_dataset is None:
            probe = next(model.parameters())
            with _default_dtype(probe.dtype):
                outer.merge_MOLE_model(SimpleNamespace(dataset=[task], pos=probe))
        elif outer.merged_on_dataset != task:
            raise config_error(
                f"UMAModel: head {head!r} is merged on task {outer.merged_on_dataset!r}, "
                f"not {task!r}"
            )
    inner: Any = getattr(outer, "head", outer)
    if getattr(inner, "reduce", "sum") != "sum":
        raise config_error(
            f"UMAModel: head {head!r} averages its energy over the atoms "
            f"(reduce={inner.reduce!r}); only a summed energy has per-atom energies"
        )
    return head, inner


class UMAModel(ReceptiveFieldWrapper):
    """A fairchem UMA (eSCN-MD) ``HydraModel`` as an nvdd model (one process and under DD).

    Energy, forces and per-atom energies (``atom_energies``) of every system of a
    batch, with periodic, open or mixed boundaries, for one task (``omat``,
    ``omol``, ...), charge and spin. Under ``DomainParallel`` it runs unmodified
    on the ``[owned | ghost]`` rows of a receptive-field halo, or with
    ``halo="refresh"`` on a halo of one cutoff with the ghost rows refreshed
    per block (:meth:`distribution_spec`).

    Parameters
    ----------
    model:
        A ``fairchem.core.models.base.HydraModel`` with an eSCN-MD backbone
        (from :meth:`from_checkpoint`, :meth:`from_config`, or fairchem's own
        loaders). Its backbone's ``otf_graph`` is turned off and a
        dataset-specific mixture head is merged on ``task``: wrap a model you no
        longer use elsewhere.
    task:
        The dataset (task) name the backbone embeds and the head predicts for
        (one of the backbone's ``dataset_mapping``); needed when the model has a
        dataset embedding.
    charge, spin:
        Total charge and spin multiplicity of every system (fairchem's
        ``charge`` and ``spin``; they matter for ``omol``).
    merge_for:
        A whole system (a :class:`~nvdd.core.Batch` on one process) to merge a
        mixture-of-linear-experts backbone for, with fairchem's
        ``merge_MOLE_model``: the experts' routing reads the system's
        composition, charge, spin and task, which a rank under DD does not see
        whole. A merged model is exact for systems of the same reduced
        composition (every system of ``merge_for`` must have it): on one
        process a batch of another composition is refused; under DD, where a
        rank holds part of the system, the first forward of each distributed
        scope checks the whole system's composition collectively
        (:meth:`check_composition`) and every rank raises the same error on a
        mismatch (MD keeps the composition: later steps are not checked).
        Without it a mixture backbone runs on one process only.
    head:
        The energy head's name (when the model has several).
    energy_scale, element_references:
        The energy task's normaliser ``rmsd`` and its per-element references
        (shape ``(n_elements,)``): ``E_i = energy_scale * e_i + ref[Z_i]``
        (:meth:`from_checkpoint` reads them from the checkpoint's tasks).
    dtype, device:
        Convert the parameters (float32 or float64), move the model. Default: keep.
    skin:
        Verlet skin of the wrapper's neighbour list (Angstrom).
    halo:
        ``"receptive"`` (default): the receptive-field spec, a halo of
        ``layers x cutoff``, the model unmodified. ``"refresh"``:
        ``SPEC_UMA_HALO``, a halo of one cutoff (the ghost rows' node features
        refreshed from their owners after the edge-degree embedding and every
        block but the last: ``layers - 1`` exchanges per forward, and as many
        in the backward; the energy all-reduced). Both are exact; on one
        process they are the same model.
    activation_checkpointing:
        fairchem's activation checkpointing of the edge-wise work (the
        edge-degree embedding and every block's message step run in chunks of
        edges whose activations are recomputed in the backward instead of
        kept): ``True`` (default, as fairchem's batch predictor and torch-sim
        run UMA) with fairchem's chunk of 131,072 edges, an ``int`` for another
        chunk (edges; smaller: less memory), ``False`` to keep every
        activation (faster, and memory grows by about one block's edge
        activations per layer). The results are the same up to the order of
        the per-chunk sums (record 0084).
    freeze:
        Turn off ``requires_grad`` of every parameter (default ``True``, as
        fairchem's predictor does): the forces differentiate the positions
        only, and autograd then keeps no activation that only a weight
        gradient needs. ``False`` leaves the parameters as they are.

    Attributes
    ----------
    hydra:
        The wrapped module.
    neighbors:
        The wrapper's :class:`~nvdd.models.VerletList` (cutoff: the backbone's).
    layers:
        Message-passing steps: the backbone's ``num_layers`` blocks plus its
        edge-degree embedding. The receptive field is ``layers x cutoff``.
    checkpoint_chunk:
        Edges per activation-checkpointed chunk, or ``None`` (off).
    cutoff, dtype:
        The backbone's cutoff (Angstrom) and the parameters' dtype.

    Notes
    -----
    fairchem's own radius graph caps each atom's neighbours at the backbone's
    ``max_neighbors`` (nearest first); the wrapper's list keeps every neighbour
    within the cutoff. They agree wherever no atom has more neighbours than the
    cap. Stress and virial are not returned.
    """

    _head: Any  # the energy head (fairchem's module, not registered twice)
    _wrapped = "hydra"
    _label = "UMA"

    compile_unsupported = (
        "fairchem's eSCN-MD backbone picks execution backends and Wigner kernels at run "
        "time; the wrapper does not trace it with torch.compile"
    )

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        task: str | None = None,
        charge: int = 0,
        spin: int = 0,
        merge_for: Batch | None = None,
        head: str | None = None,
        energy_scale: float = 1.0,
        element_references: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        skin: float = 0.0,
        halo: str = "receptive",
        activation_checkpointing: bool | int = True,
        freeze: bool = True,
    ) -> None:
        super().__init__()
        hydra_cls = _class(_HYDRA)
        backbone_cls = _class(_BACKBONE)
        if not isinstance(model, hydra_cls):
            raise config_error(f"UMAModel wraps a fairchem HydraModel, got {type(model).__name__}")
        inner: Any = model
        backbone: Any = inner.backbone
        if not isinstance(backbone, backbone_cls):
            raise config_error(
                f"UMAModel: the backbone is {type(backbone).__name__}, not an eSCN-MD "
                "backbone (eSCNMDBackbone or eSCNMDMoeBackbone)"
            )
        self._check_arguments(skin, dtype)
        if halo not in _HALOS:
            raise config_error(f"UMAModel: halo= must be one of {_HALOS}, got {halo!r}")
        check_positive("energy_scale", energy_scale)
        if backbone.regress_config.direct_forces:
            raise config_error(
                "UMAModel: the model predicts direct forces (direct_forces=True); only a "
                "conservative model (forces = -dE/dx) is supported"
            )
        if backbone.use_dataset_embedding and task not in backbone.dataset_mapping:
            raise config_error(
                f"UMAModel: pass task= one of the model's tasks "
                f"{sorted(backbone.dataset_mapping)} (got {task!r})"
            )
        self.task, self.charge, self.spin = task, int(charge), int(spin)
        self.merged_composition: torch.Tensor | None = None
        self.head_name, inner_head = _energy_head(inner, head, task)
        if merge_for is not None:
            backbone = self._merge(backbone, merge_for)
            inner.backbone = backbone
        backbone.otf_graph = False
        self.layers = int(backbone.num_layers) + 1
        self._cutoff = float(backbone.cutoff)
        model = self._convert(model, dtype, device, freeze=freeze)
        self.checkpoint_chunk = _checkpoint_edges(model, activation_checkpointing)
        self.hydra = model
        # (not registered as a submodule: it is the hydra's own head)
        object.__setattr__(self, "_head", inner_head)
        self.energy_scale = float(energy_scale)
        if element_references is None:
            refs = torch.zeros(int(backbone.max_num_elements))
        else:
            refs = element_references.detach().clone()
        param = next(model.parameters())
        self.register_buffer("element_references", refs.to(param.device, param.dtype))
        self._nonlocal = _nonlocal_parts(backbone)
        self.neighbors = VerletList(self._cutoff, skin)
        self.halo = halo
        if halo == "refresh":  # ghost rows made current after each step that reads them
            backbone.edge_degree_embedding.register_forward_hook(_refresh_ghost_rows)
            for block in list(backbone.blocks)[:-1]:  # (the last block's ghost rows: unread)
                block.register_forward_hook(_refresh_ghost_rows)
        # a merged model checks the whole system's composition on its first forward
        # under DD (armed here and by distributed_setup; one all-reduce, then off)
        self._composition_pending = self.merged_composition is not None
        # the atomic numbers / system index last checked (see _check)
        self._checked: tuple[TensorMemo, TensorMemo, bool] | None = None

    # ------------------------------------------------------------- building
    def _merge(self, backbone: Any, whole: Batch) -> Any:
        """fairchem's ``merge_MOLE_model`` of a mixture backbone for ``whole``'s
        composition (every system the same reduced composition), in the
        backbone's dtype."""
        if int(getattr(backbone, "num_experts", 0)) == 0:
            return backbone
        reduced = _reduced_compositions(whole)
        if not torch.allclose(reduced, reduced[:1].expand_as(reduced), rtol=1e-12, atol=0.0):
            raise config_error(
                "UMAModel: merge_for= has systems of different reduced compositions; a "
                "merged mixture-of-experts model is exact for one composition"
            )
        param = next(backbone.parameters())
        data = _GraphDict(
            atomic_numbers=whole.atomic_numbers.to(param.device),
            batch=whole.system_index.to(param.device),
            charge=torch.full((whole.n_systems,), self.charge, device=param.device),
            spin=torch.full((whole.n_systems,), self.spin, device=param.device),
            dataset=[self.task] * whole.n_systems,
        )
        with _default_dtype(param.dtype), torch.no_grad():
            merged = backbone.merge_MOLE_model(data)
        self.merged_composition = reduced[0]
        return merged.to(param.device)

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike[str], *, task: str | None = None, **kwargs: Any
    ) -> UMAModel:
        """Wrap the model of a fairchem inference checkpoint, read and built by
        fairchem's own ``load_inference_model(path, use_ema=True)`` (a trusted
        file only: it is unpickled); the energy task of ``task`` gives
        ``energy_scale`` (its normaliser's ``rmsd``) and ``element_references``
        (a normaliser with a nonzero mean is refused: it has no per-atom
        share). ``kwargs`` go to the constructor."""
        utils = fairchem_module("fairchem.core.units.mlip_unit.utils", "UMAModel.from_checkpoint")
        if not os.path.isfile(path):
            raise config_error(f"UMAModel.from_checkpoint: no file {os.fspath(path)!r}")
        model, _ = utils.load_inference_model(os.fspath(path), use_ema=True)
        model = getattr(model, "module", model)  # (the averaged model's module)
        tasks = [t for t in utils.load_tasks(os.fspath(path)) if t.property == "energy"]
        if task is None and len(tasks) == 1 and len(tasks[0].datasets) == 1:
            task = tasks[0].datasets[0]
        chosen = [t for t in tasks if task in t.datasets]
        if not chosen:
            known = sorted({d for t in tasks for d in t.datasets})
            raise config_error(
                f"UMAModel.from_checkpoint: pass task= one of the checkpoint's energy "
                f"tasks {known} (got {task!r})"
            )
        norm = chosen[0].normalizer
        if float(norm.mean) != 0.0:
            raise config_error(
                f"UMAModel.from_checkpoint: the energy normaliser of task {task!r} has mean "
                f"{float(norm.mean)} (a per-system constant with no per-atom share)"
            )
        refs = chosen[0].element_references
        kwargs.setdefault("energy_scale", float(norm.rmsd))
        if refs is not None:
            kwargs.setdefault("element_references", refs.element_references)
        return cls(model, task=task, **kwargs)

    @classmethod
    def from_config(
        cls,
        backbone: Mapping[str, Any],
        heads: Mapping[str, Any] | None = None,
        *,
        seed: int = 0,
        **kwargs: Any,
    ) -> UMAModel:
        """A UMA with random weights (``seed``) built by fairchem from its own
        configuration: ``backbone`` is the ``HydraModel``'s backbone section
        (``model`` defaults to ``eSCNMDBackbone``; ``eSCNMDMoeBackbone`` for
        mixture-of-experts; ``sphere_channels``, ``lmax``, ``mmax``,
        ``num_layers``, ``cutoff``, ``dataset_mapping``, ...), ``heads`` its heads
        section (default: one ``MLP_EFS_Head`` named ``energyandforcehead``).
        Nothing is downloaded. With ``dtype=`` in ``kwargs`` the model is built
        in that dtype (fairchem's constant tables too). ``kwargs`` go to the
        constructor."""
        base = fairchem_module("fairchem.core.models.base", "UMAModel.from_config")
        section = {"model": _BACKBONE, "otf_graph": False, **dict(backbone)}
        section.setdefault("regress_forces", True)
        section.setdefault("direct_forces", False)
        if heads is None:
            heads = {"energyandforcehead": {"module": _EFS_HEAD}}
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        with torch.random.fork_rng(devices=[]), _default_dtype(dtype):
            torch.manual_seed(seed)
            model = base.HydraModel(backbone=section, heads={k: dict(v) for k, v in heads.items()})
        return cls(model, **kwargs)

    # ---------------------------------------------------------- properties
    @property
    def backbone(self) -> Any:
        """The wrapped ``HydraModel``'s backbone (merged, if it was)."""
        return cast(Any, self.hydra).backbone

    def extra_repr(self) -> str:
        """The module repr's summary: cutoff, layers, task, charge, spin, skin, halo
        and the activation-checkpoint chunk."""
        return (
            f"cutoff={self._cutoff}, layers={self.layers}, task={self.task!r}, "
            f"charge={self.charge}, spin={self.spin}, skin={self.neighbors.skin}, "
            f"halo={self.halo!r}, checkpoint_chunk={self.checkpoint_chunk}"
        )

    # ---------------------------------------------------------------- spec
    def distribution_spec(self, strategy: StrategyKind | str = StrategyKind.HALO) -> MLIPSpec:
        """``receptive_field_spec(layers=self.layers, strategy=strategy, fold=True)``,
        or with ``halo="refresh"`` ``SPEC_UMA_HALO`` (``StrategyKind.HALO`` only).

        The receptive field: the model runs unmodified on ``[owned | ghost]``
        rows of a halo of ``layers x cutoff + skin``; owned atoms' energies are
        exact there and the forces are the derivative of their sum, ghost rows'
        parts folded to their owners (record 0067). ``SPEC_UMA_HALO``: a halo of
        one cutoff (plus skin), edges for owned receivers only, the ghost rows'
        node features refreshed from their owners after the edge-degree
        embedding and after every block but the last, the energy summed over
        owned rows (all-reduced: replicated).

        Raises
        ------
        ConfigurationError
            For a model with a part that reads the whole system (an unmerged
            mixture-of-experts backbone, charge or spin balanced channels):
            its owned rows would be wrong on a rank's rows.
        """
        if self._nonlocal is not None:
            raise config_error(f"UMAModel cannot run under domain decomposition: {self._nonlocal}")
        if self.halo == "refresh":
            return halo_spec(self, strategy, SPEC_UMA_HALO)
        return super().distribution_spec(strategy)

    def distributed_setup(self, ctx: Any) -> None:
        """Arm the composition check of a merged model: the first forward of the
        scope runs :meth:`check_composition` (every rank makes that call)."""
        super().distributed_setup(ctx)
        self._composition_pending = self.merged_composition is not None

    def check_composition(self, batch: Batch, ctx: DDContext) -> None:
        """Refuse a decomposed run whose systems' composition is not the one the
        mixture-of-experts backbone was merged for.

        **Collective** over ``ctx.group``: one all-reduce of the per-system element
        counts of this rank's owned rows (the first ``ctx.n_owned`` of ``batch``),
        so every rank sees the whole systems' compositions and reaches the same
        verdict. Called by :meth:`forward` on its first call under a DD context
        after construction or :meth:`distributed_setup` (never on a steady step).

        Raises
        ------
        ValidationError
            On every rank together, naming the merged composition and the run's.
        """
        merged = self.merged_composition
        if merged is None or ctx.layout is None:
            return
        n_owned = int(ctx.layout.n_owned)
        n_sys = max(int(ctx.n_systems), batch.n_systems)
        z = batch.atomic_numbers[:n_owned]
        counts = torch.zeros(n_sys, 128, dtype=torch.float64, device=z.device)
        counts.index_put_(
            (batch.system_index[:n_owned], z),
            torch.ones(n_owned, dtype=torch.float64, device=z.device),
            accumulate=True,
        )
        all_reduce(counts, group=ctx.group)
        counts = counts.cpu()
        present = counts.sum(dim=1) > 0
        reduced = counts[present] / counts[present].sum(dim=1, keepdim=True)
        if torch.allclose(reduced, merged.expand_as(reduced), rtol=1e-12, atol=0.0):
            return
        bad = next(
            k
            for k in range(n_sys)
            if bool(present[k])
            and not torch.allclose(counts[k] / counts[k].sum(), merged, rtol=1e-12, atol=0.0)
        )
        raise ValidationError(
            "UMAModel: the mixture-of-experts backbone was merged (merge_for=) for the "
            f"composition {_formula(merged)}, but system {bad} of this decomposed run is "
            f"{_formula(counts[bad])} (over all ranks); merging is exact for one "
            "composition only: merge it for this system"
        )

    # ------------------------------------------------------------- physics
    def _check(self, batch: Batch) -> None:
        """The batch's dtype (every call, on the host), and its atomic numbers and
        (a merged mixture, whole batch) composition: those read the device, so
        only on the first sight of an ``atomic_numbers`` / ``system_index``
        tensor (by identity and version: a step keeps them, a halo rebuild or a
        new batch brings new ones), never on a steady step."""
        self._check_dtype(batch)
        whole = current_dd_context().layout is None
        z, system = batch.atomic_numbers, batch.system_index
        seen = self._checked
        if seen is not None and seen[0].same(z) and seen[1].same(system) and seen[2] == whole:
            return
        self._checked = None
        n = int(self.backbone.max_num_elements)
        outside = (z < 1) | (z >= n)
        if bool(outside.any()):
            bad = sorted({int(v) for v in z[outside].tolist()})
            rows = outside.nonzero().squeeze(1)[:8].tolist()
            raise ValidationError(
                f"UMAModel: atomic numbers {bad} outside 1..{n - 1} (rows {rows} of "
                f"{int(z.shape[0])} on rank {get_rank()})"
            )
        merged = self.merged_composition
        if merged is not None and whole:  # a whole batch
            reduced = _reduced_compositions(batch).to(merged.device)
            if not torch.allclose(reduced, merged.expand_as(reduced), rtol=1e-12, atol=0.0):
                raise ValidationError(
                    "UMAModel: the mixture-of-experts backbone was merged for another "
                    "composition (merge_for=); merge it for this system"
                )
        memos = (TensorMemo(), TensorMemo())
        memos[0].remember(z)
        memos[1].remember(system)
        self._checked = (memos[0], memos[1], whole)

    def graph(self, batch: Batch, positions: torch.Tensor) -> dict[str, Any]:
        """The backbone's input dict for ``batch`` at ``positions`` (differentiable
        in them): nvdd's edges, grouped by system as fairchem expects."""
        self._check(batch)
        n_receivers = self._refreshed_rows()
        edges = self.neighbors.for_batch(batch, n_receivers=n_receivers)
        n_sys = batch.n_systems
        if n_sys > 1:
            order = torch.argsort(batch.system_index.index_select(0, edges.receivers), stable=True)
            edges = edges.select(order)
        per_edge = batch.system_index.index_select(0, edges.receivers)
        dev = positions.device
        return _GraphDict(
            atomic_numbers=batch.atomic_numbers,
            pos=positions,
            cell=batch.cell.detach(),
            batch=batch.system_index,
            natoms=_per_system(batch.system_index, n_sys),
            nedges=_per_system(per_edge, n_sys),
            edge_index=torch.stack([edges.senders, edges.receivers]),
            cell_offsets=edges.shifts,
            charge=torch.full((n_sys,), self.charge, dtype=torch.long, device=dev),
            spin=torch.full((n_sys,), self.spin, dtype=torch.long, device=dev),
            dataset=[self.task] * n_sys,
        )

    def _refreshed_rows(self) -> int | None:
        """The owned rows under a live DD context with ``halo="refresh"`` (the
        receivers, whose energies count); ``None`` otherwise."""
        layout = current_dd_context().layout
        return None if layout is None or self.halo != "refresh" else int(layout.n_owned)

    def _atom_energies(self, batch: Batch, positions: torch.Tensor) -> torch.Tensor:
        """Per-atom energies of ``batch`` at ``positions`` (differentiable in them):
        the energy block on the backbone's scalar channels, denormalised.
        **Collective** under a live DD context with ``halo="refresh"`` (the ghost
        rows' refreshes, forward and backward)."""
        emb = self.backbone(self.graph(batch, positions))
        scalars = emb["node_embedding"][:, 0, :]
        raw = cast(torch.Tensor, self._head.energy_block(scalars)).reshape(-1)
        refs = cast(torch.Tensor, self.element_references)
        return raw * self.energy_scale + refs.index_select(0, batch.atomic_numbers)

    def forward(self, batch: Batch) -> ModelOutputs:
        """Energy, forces and per-atom energies of every system of ``batch``.

        Forces are ``-dE/dx`` by autograd, every output detached; where ``batch.positions``
        requires grad already (the runtime's leaf) the outputs keep their graph, no forces.

        Raises
        ------
        ValidationError
            On a dtype mismatch, an atomic number outside the model's range, a
            whole batch (outside DD) of another composition than the one a
            mixture-of-experts backbone was merged for (checked on the first
            sight of the batch's ``atomic_numbers`` and ``system_index``
            tensors, never on a steady step; under DD by :meth:`check_composition`,
            on every rank), or fairchem's own graph parallelism
            initialised in this process.
        """
        gp = fairchem_module("fairchem.core.common.gp_utils")
        if gp.initialized():
            raise ValidationError(
                "UMAModel: fairchem's graph parallelism is initialised in this process; "
                "nvdd decomposes the system itself (tear fairchem's down first)"
            )
        if self._composition_pending:
            ctx = current_dd_context()
            if ctx.layout is not None:
                self._composition_pending = False
                self.check_composition(batch, ctx)
        n_owned = self._refreshed_rows()
        if n_owned is not None:  # SPEC_UMA_HALO: owned rows' energies, refreshed ghosts
            return outputs_by_autograd(
                lambda pos, cell: self._atom_energies(batch, pos),
                batch.positions,
                batch.cell,
                batch.system_index,
                n_counted=n_owned,
                compute_stress=False,
                energy_scope=energy_scope(SPEC_UMA_HALO),
            )
        return self._outputs(batch, lambda positions: self._atom_energies(batch, positions))


def _class(path: str) -> Any:
    """The fairchem class at ``module.Name`` (the extra's hint if missing)."""
    module, _, name = path.rpartition(".")
    return getattr(fairchem_module(module), name)


def _per_system(index: torch.Tensor, n_systems: int) -> torch.Tensor:
    """How many entries of ``index`` name each system (int64, ``(n_systems,)``),
    without a host read (``torch.bincount`` reads the maximum back on CUDA)."""
    if n_systems == 1:
        return torch.full((1,), index.shape[0], dtype=torch.long, device=index.device)
    counts = torch.zeros(n_systems, dtype=torch.long, device=index.device)
    return counts.index_add_(0, index, torch.ones_like(index, dtype=torch.long))


def _reduced_compositions(batch: Batch) -> torch.Tensor:
    """Each system's fraction of every element, shape ``(n_systems, 128)`` (float64, CPU)."""
    counts = torch.zeros(batch.n_systems, 128, dtype=torch.float64)
    counts.index_put_(
        (batch.system_index.cpu(), batch.atomic_numbers.cpu()),
        torch.ones(batch.n_atoms, dtype=torch.float64),
        accumulate=True,
    )
    return counts / counts.sum(dim=1, keepdim=True)


def _formula(composition: torch.Tensor) -> str:
    """A composition (counts or fractions by atomic number, shape ``(128,)``) as
    ``Z8:2 Z14:1`` (counts) or ``Z8:0.6667 Z14:0.3333`` (fractions)."""
    values = composition.tolist()
    whole = all(float(v).is_integer() for v in values)
    parts = [f"Z{z}:{int(v)}" if whole else f"Z{z}:{v:.4g}" for z, v in enumerate(values) if v > 0]
    return " ".join(parts) or "(no atoms)"


def _refresh_ghost_rows(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor | None:
    """Forward hook (``halo="refresh"``) on the edge-degree embedding and the
    blocks: under a live DD context the ghost rows of the node features they
    return are replaced by their owners' (owned rows are exact: edges exist for
    owned receivers only). **Collective** then (one exchange, its adjoint in the
    backward); outside DD it changes nothing."""
    if current_dd_context().layout is None:
        return None
    return refresh_neighbors(output)


def _checkpoint_edges(model: torch.nn.Module, setting: bool | int) -> int | None:
    """Set fairchem's activation-checkpoint chunk (edges) on every edge-wise module
    of ``model`` from the ``activation_checkpointing=`` setting; return it (None: off)."""
    chunk: int | None = None
    if setting is True:
        escn = fairchem_module(_BACKBONE.rpartition(".")[0])
        default = getattr(escn, "ESCNMD_DEFAULT_EDGE_ACTIVATION_CHECKPOINT_CHUNK_SIZE", None)
        chunk = int(default or _CHUNK_FALLBACK)
    elif not isinstance(setting, bool) and isinstance(setting, int) and setting > 0:
        chunk = int(setting)
    elif setting is not False:
        raise config_error(
            "UMAModel: activation_checkpointing= is True, False or a positive number of "
            f"edges per chunk, got {setting!r}"
        )
    owners = [m for m in model.modules() if hasattr(m, _CHUNK_ATTR)]
    if chunk is not None and not owners:
        raise config_error(
            "UMAModel: this fairchem backbone has no activation-checkpointed edge modules "
            f"(no {_CHUNK_ATTR!r}); pass activation_checkpointing=False"
        )
    for module in owners:
        setattr(module, _CHUNK_ATTR, chunk)
    return chunk


def _nonlocal_parts(backbone: Any) -> str | None:
    """Why the backbone reads more than an atom's neighbourhood, or None."""
    if int(getattr(backbone, "num_experts", 0)) > 0:
        return (
            "its mixture-of-linear-experts routing reads the whole system's composition; "
            "merge it for the system first (UMAModel(..., merge_for=whole_batch))"
        )
    if backbone.charge_channel_end > backbone.charge_channel_start:
        return "its charge-balanced channels sum over every atom of a system"
    if backbone.spin_channel_end > backbone.spin_channel_start:
        return "its spin-balanced channels sum over every atom of a system"
    return None
