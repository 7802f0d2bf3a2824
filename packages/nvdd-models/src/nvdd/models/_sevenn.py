"""`SevenNetModel`: a SevenNet (``sevenn``) potential as an nvdd model, unmodified.

SevenNet's ``AtomGraphSequential`` reads a graph dict: the atoms' numbers, the
directed edges ``edge_index = [src, dst]`` and their vectors ``edge_vec =
x[dst] - x[src] + S @ cell``, and returns per-atom energies (``atomic_energy``)
and their per-graph sums. The wrapper builds that dict from a
:class:`~nvdd.core.Batch` with the package's Verlet list on exactly the rows it
is given: on one process the whole system with its cell and pbc; under
``DomainParallel`` this rank's ``[owned | ghost]`` rows with the boundaries the
runtime gives them (open across decomposed axes: the ghosts are explicit
images, record 0006). nvdd's edge ``(i, j, S)`` has ``r_ij = x[j] - x[i] + S @
cell``, so ``src = i``, ``dst = j`` and the vectors are the same ``r_ij``: the
convention of SevenNet's own ASE graph builder (a test checks the wrapper
against ``SevenNetCalculator``).

The model runs as it is, with no adapters: its spec is
:func:`nvdd.spec.receptive_field_spec` with the model's number of interaction
layers and ``fold=True`` (record 0067). The halo is ``layers x cutoff + skin``,
where every owned atom's energy is exact; the runtime differentiates the sum of
the owned rows' ``atom_energies`` with respect to every row it gave the model
and folds the ghost rows' gradients into their owners. That needs per-atom
energies differentiable in the positions the runtime passes, so the wrapper
removes SevenNet's own force module (``force_output``, an ``autograd.grad``
that frees the graph) from the model it wraps and computes forces itself, by
autograd of the same energies, when it runs on its own (one process).

SevenNet builds its one-hot species embedding in float32 whatever the model's
dtype; a forward hook casts it (exact 0/1 values) to the dtype of the edge
vectors, so a float64 model runs in float64 (the equivalence tests do).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, cast

import torch

from nvdd.core import Batch, ModelOutputs, ValidationError
from nvdd.models._checks import config_error
from nvdd.models._receptive_wrapper import OptionalPackage, ReceptiveFieldWrapper
from nvdd.models._verlet import VerletList

__all__ = ["SevenNetModel"]

#: Numbers SevenNet's training computes from data; a model built from a
#: configuration without them (random weights) takes these.
_UNTRAINED = {"shift": 0.0, "scale": 1.0, "conv_denominator": 10.0}
#: ``import_optional`` of a sevenn module with the extra's install hint.
sevenn_module = OptionalPackage("sevenn", "nvdd-models[sevenn]", "SevenNetModel")


def _onehot_to_edge_dtype(module: Any, args: Any, out: Any) -> Any:
    """Forward hook of SevenNet's ``OnehotEmbedding``: its float32 one-hot in the
    dtype of the graph's edge vectors (the model's dtype)."""
    dtype = out["edge_vec"].dtype
    for key in (module.key_output, module.key_additional_output):
        if key is not None and out[key].dtype != dtype:
            out[key] = out[key].to(dtype)
    return out


def _build(config: Mapping[str, Any], seed: int) -> torch.nn.Module:
    """A random SevenNet from its configuration (sevenn's defaults filled in)."""
    const = sevenn_module("sevenn._const", "SevenNetModel.from_config")
    util = sevenn_module("sevenn.util", "SevenNetModel.from_config")
    build = sevenn_module("sevenn.model_build", "SevenNetModel.from_config")
    sevenn = sevenn_module("sevenn", "SevenNetModel.from_config")
    species = config.get("chemical_species")
    if not species:
        raise config_error(
            "SevenNetModel.from_config: the configuration needs 'chemical_species' "
            "(element symbols, e.g. ['O', 'Si'])"
        )
    full: dict[str, Any] = {**const.model_defaults(dict(config)), **_UNTRAINED}
    full.update({k: v for k, v in config.items() if k != "chemical_species"})
    full.update(util.chemical_species_preprocess(list(species)))
    full.setdefault("version", sevenn.__version__)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module: torch.nn.Module = build.build_E3_equivariant_model(full)
    setattr(module, "sevenn_config", full)  # what a checkpoint of it stores as 'config'  # noqa: B010
    return module


class SevenNetModel(ReceptiveFieldWrapper):
    """A SevenNet ``AtomGraphSequential`` as an nvdd model (one process and under DD).

    Energy, forces and per-atom energies (``atom_energies``) of every system of a
    batch, with periodic, open or mixed boundaries. Under ``DomainParallel`` it
    runs unmodified on the ``[owned | ghost]`` rows of a receptive-field halo
    (:meth:`distribution_spec`); no adapters, nothing to declare.

    Parameters
    ----------
    model:
        A ``sevenn.nn.sequential.AtomGraphSequential`` (from
        :meth:`from_checkpoint`, :meth:`from_config`, or sevenn's own
        ``SevenNetCheckpoint.build_model()``). Its ``force_output`` module is
        removed (forces come from autograd of the per-atom energies): wrap a
        model you no longer use elsewhere.
    modal:
        The fidelity of a multi-modal model (one of its ``modal_map``); refused for
        a single-modal one.
    dtype, device:
        Convert the parameters (float32 or float64), move the model. Default: keep.
    skin:
        Verlet skin of the wrapper's neighbour list (Angstrom).
    freeze:
        Turn off ``requires_grad`` of every parameter (default ``True``, as
        ``MACEModel``, ``UMAModel`` and ``AIMNet2Model`` do): the forces
        differentiate the positions only, and autograd then keeps no activation
        that only a weight gradient needs (record 0088). ``False`` leaves the
        parameters as they are.

    Attributes
    ----------
    sevennet:
        The wrapped module (its parameters frozen unless ``freeze=False``).
    neighbors:
        The wrapper's :class:`~nvdd.models.VerletList` (cutoff: the model's).
    layers:
        Interaction (convolution) layers of the model: the receptive field is
        ``layers x cutoff``.
    cutoff, dtype:
        The model's cutoff (Angstrom) and its parameters' dtype.

    Notes
    -----
    Stress and virial are not returned (SevenNet's own come from the force
    module removed here).
    """

    _wrapped = "sevennet"
    _label = "SevenNet"
    compile_unsupported = (
        "SevenNet's modules are e3nn code (TorchScript compile modes, fx-generated "
        "tensor products) that the wrapper does not trace with torch.compile"
    )

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        modal: str | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        skin: float = 0.0,
        freeze: bool = True,
    ) -> None:
        super().__init__()
        sequential = sevenn_module("sevenn.nn.sequential")
        embedding = sevenn_module("sevenn.nn.node_embedding")
        if not isinstance(model, sequential.AtomGraphSequential):
            raise config_error(
                f"SevenNetModel wraps a sevenn AtomGraphSequential, got {type(model).__name__}"
            )
        self._check_arguments(skin, dtype)
        inner: Any = model
        cutoff = float(inner.cutoff)
        if not cutoff > 0:
            raise config_error("SevenNetModel: the model has no cutoff (cutoff 0.0)")
        if not inner.type_map:
            raise config_error("SevenNetModel: the model has no type_map (elements)")
        modal_map = inner.modal_map or {}
        if modal_map and modal not in modal_map:
            raise config_error(
                f"SevenNetModel: this model is multi-modal; pass modal= one of {sorted(modal_map)}"
                f" (got {modal!r})"
            )
        if not modal_map and modal is not None:
            raise config_error(f"SevenNetModel: modal={modal!r} given, the model has no modal_map")
        self.layers = sum(1 for name in inner._modules if name.endswith("_convolution"))
        if self.layers < 1:
            raise config_error("SevenNetModel: found no interaction ('<t>_convolution') module")
        inner.delete_module_by_key("force_output")
        inner.set_is_batch_data(True)
        for module in model.modules():
            if isinstance(module, embedding.OnehotEmbedding):
                module.register_forward_hook(_onehot_to_edge_dtype)
        self.sevennet = model = self._convert(model, dtype, device, freeze=freeze)
        self.modal = modal
        self._cutoff = cutoff
        self._elements = sorted(int(z) for z in inner.type_map)
        known = torch.zeros(128, dtype=torch.bool)
        known[self._elements] = True
        self.register_buffer("known", known.to(next(model.parameters()).device))
        self.neighbors = VerletList(cutoff, skin)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], **kwargs: Any) -> SevenNetModel:
        """Wrap the model of a SevenNet checkpoint file, read and built by sevenn's
        own ``load_checkpoint(path).build_model()`` (a trusted file only: it is
        unpickled); ``kwargs`` go to the constructor."""
        util = sevenn_module("sevenn.util", "SevenNetModel.from_checkpoint")
        if not os.path.isfile(path):
            raise config_error(f"SevenNetModel.from_checkpoint: no file {os.fspath(path)!r}")
        model = util.load_checkpoint(os.fspath(path)).build_model()
        return cls(model, **kwargs)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], *, seed: int = 0, **kwargs: Any
    ) -> SevenNetModel:
        """A SevenNet with random weights (``seed``) built by sevenn from its own
        model configuration (the keys of a SevenNet ``input.yaml``'s ``model``
        section: ``chemical_species``, ``cutoff``, ``channel``, ``lmax``,
        ``num_convolution_layer``, ...; sevenn's defaults for the rest, and
        ``shift`` 0, ``scale`` 1, ``conv_denominator`` 10 unless given, which
        training would compute from data). Nothing is downloaded. The full
        configuration is kept as ``model.sevennet.sevenn_config`` (what a
        checkpoint stores). ``kwargs`` go to the constructor."""
        return cls(_build(config, seed), **kwargs)

    # ---------------------------------------------------------- properties
    @property
    def atomic_numbers(self) -> list[int]:
        """The elements the model knows."""
        return list(self._elements)

    def extra_repr(self) -> str:
        """The module repr's summary: cutoff, layers, elements, modal and skin."""
        return (
            f"cutoff={self._cutoff}, layers={self.layers}, atomic_numbers={self._elements}, "
            f"modal={self.modal!r}, skin={self.neighbors.skin}"
        )

    # ------------------------------------------------------------- physics
    def _check(self, batch: Batch) -> None:
        self._check_dtype(batch)
        z, known = batch.atomic_numbers, cast(torch.Tensor, self.known)
        n = int(known.shape[0])
        ok = known.index_select(0, z.clamp(0, n - 1)) & (z >= 0) & (z < n)
        if not bool(ok.all()):
            bad = sorted({int(v) for v in z[~ok].tolist()})
            raise ValidationError(
                f"SevenNetModel: atomic numbers {bad} are not elements of the model "
                f"{self._elements}"
            )

    def graph(self, batch: Batch, positions: torch.Tensor) -> dict[str, Any]:
        """SevenNet's input dict for ``batch`` at ``positions`` (differentiable in them)."""
        edges = self.neighbors.for_batch(batch)
        if self.neighbors.rebuilt:
            self._check(batch)
        vectors = edges.vectors(positions, batch.cell, batch.system_index)
        counts = torch.bincount(batch.system_index, minlength=batch.n_systems)
        data: dict[str, Any] = {
            "x": batch.atomic_numbers,
            "atomic_numbers": batch.atomic_numbers,
            "pos": positions,
            "edge_index": torch.stack([edges.receivers, edges.senders]),
            "edge_vec": vectors,
            "batch": batch.system_index,
            "num_atoms": counts,
        }
        if self.modal is not None:
            data["data_modality"] = [self.modal] * batch.n_systems
        return data

    def forward(self, batch: Batch) -> ModelOutputs:
        """Energy, forces and per-atom energies of every system of ``batch``.

        Forces are ``-dE/dx`` by autograd, every output detached; where ``batch.positions``
        requires grad already (the runtime's leaf) the outputs keep their graph, no forces.

        Raises
        ------
        ValidationError
            On a dtype mismatch or an element the model does not know (checked
            when the neighbour list is rebuilt).
        """
        return self._outputs(batch, lambda positions: self._atom_energies(batch, positions))

    def _atom_energies(self, batch: Batch, positions: torch.Tensor) -> torch.Tensor:
        """SevenNet's per-atom energies of ``batch`` at ``positions``, shape ``(n_rows,)``."""
        out = self.sevennet(self.graph(batch, positions))
        return cast(torch.Tensor, out["atomic_energy"]).reshape(-1)
