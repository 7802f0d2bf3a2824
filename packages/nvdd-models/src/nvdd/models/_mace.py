"""`MACEModel`: a mace-torch MACE as an nvdd model (one process and under DD).

The wrapper builds MACE's graph dict from a :class:`~nvdd.core.Batch` with the
package's Verlet list, runs the unchanged MACE ``forward`` with
``compute_force=False`` and takes its per-atom energies (``node_energy``);
energy, forces, virial and stress then come from
:func:`~nvdd.models._forces.outputs_by_autograd`, as for the reference MPNN.
That keeps one force / stress code path for every model of the package and
makes the DD rules (owned rows counted, derivative at the runtime's padded
leaf) the same.

Edge convention. nvdd's edges are ``(i receiver, j sender, S)`` with
``r_ij = x[j] - x[i] + S @ cell``. MACE's ``edge_index`` is ``[sender,
receiver]`` and its edge vector is ``x[receiver] - x[sender] + shifts``; so
``edge_index = [j, i]`` and ``shifts = -S @ cell`` (``unit_shifts = -S``).
A test checks the wrapper against mace-torch's own calculator.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, cast

import torch

from nvdd.core import Batch, ModelOutputs, OptionalDependencyError
from nvdd.models._checks import check_positive, config_error
from nvdd.models._dd import HaloModelMixin, InputGate, energy_scope, halo_spec
from nvdd.models._forces import freeze_parameters
from nvdd.models._mace_build import load_mace
from nvdd.models._mace_deps import cueq_available, cueq_import_error, mace_module
from nvdd.models._mace_spec import mace_graph_spec, mace_halo_spec
from nvdd.models._neighbors import EdgeList
from nvdd.models._species import species_table
from nvdd.models._verlet import VerletList
from nvdd.spec import SPEC_MPNN_HALO, MLIPSpec, StrategyKind

__all__ = ["MACEModel"]

_ENERGY_SCOPE = energy_scope(SPEC_MPNN_HALO)
_SUPPORTED = ("MACE", "ScaleShiftMACE")


def _model_dtype(module: torch.nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    raise config_error(f"{type(module).__name__} has no floating-point parameters")


def _check_mace(mace: Any) -> bool:
    """Check the wrapped object; return whether it is a TorchScript module."""
    if isinstance(mace, torch.jit.ScriptModule):
        name = getattr(mace, "original_name", type(mace).__name__)
        if name not in _SUPPORTED:
            raise config_error(
                f"MACEModel wraps mace-torch {' / '.join(_SUPPORTED)} models; the TorchScript "
                f"module is a {name}"
            )
        return True
    models = mace_module("mace.modules.models")
    if not isinstance(mace, models.MACE):
        raise config_error(
            f"MACEModel wraps a mace-torch MACE or ScaleShiftMACE, got {type(mace).__name__} "
            "(dipole / polarisability models and other heads are not supported)"
        )
    if hasattr(mace, "joint_embedding"):
        raise config_error(
            "MACEModel: this MACE has a joint embedding (extra per-graph inputs such as total "
            "charge or spin); those inputs are not supported yet"
        )
    return False


def _head_index(heads: list[str], head: str | None) -> int:
    if head is None:
        if len(heads) == 1:
            return 0
        named = [k for k, h in enumerate(heads) if h.lower() == "default"]
        if named:
            return named[0]
        raise config_error(
            f"this MACE has several heads {heads} and none is called 'default': pass head=..."
        )
    if head not in heads:
        raise config_error(f"head {head!r} is not one of the model's heads {heads}")
    return heads.index(head)


def _to_cueq(mace: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """mace-torch's own e3nn -> cuEquivariance conversion (same weights)."""
    missing = cueq_import_error()
    if missing is not None:
        raise OptionalDependencyError(
            "cuequivariance-torch and its CUDA ops",
            "MACEModel(cueq=True)",
            install="pip install cuequivariance-torch cuequivariance-ops-torch-cu12 "
            "(or -cu13 for CUDA 13)",
            cause=missing,
        ) from missing
    if type(mace).__name__ != "ScaleShiftMACE":
        raise config_error(
            f"mace-torch converts ScaleShiftMACE models to cuEquivariance, not {type(mace).__name__}"
        )
    convert = mace_module("mace.cli.convert_e3nn_cueq")
    default = torch.get_default_dtype()
    try:  # the converter sets the global default dtype; put it back
        with warnings.catch_warnings():
            # mace-torch rebuilds the model passing its atomic_numbers buffer to
            # torch.tensor(): a copy-construct warning about its own code
            warnings.filterwarnings("ignore", "To copy construct from a tensor", UserWarning)
            out: torch.nn.Module = convert.run(mace, device=device.type)
    finally:
        torch.set_default_dtype(default)
    return out


class MACEModel(HaloModelMixin, torch.nn.Module):
    """A mace-torch ``MACE`` / ``ScaleShiftMACE`` as an nvdd model.

    Energy, forces, per-atom energies, virial and stress on one process and
    inside a live DD context (``[owned | ghost]`` rows, owned receivers, one
    ghost refresh before every interaction that reads neighbours), under
    ``StrategyKind.HALO`` (ghosts are explicit periodic images, open
    boundaries) and ``StrategyKind.GRAPH_PARTITION`` (ghosts are the atoms
    themselves, the real cell and pbc): see :meth:`distribution_spec`.

    Parameters
    ----------
    mace:
        A ``mace.modules.MACE`` or ``ScaleShiftMACE`` (e.g. from
        :func:`~nvdd.models.load_mace` or :func:`~nvdd.models.build_mace`). A
        TorchScript-compiled MACE runs on one process only: its interactions
        cannot be intercepted to refresh ghost features.
    dtype:
        Convert the model's parameters (float32 or float64). Default: keep.
    device:
        Move the model. Default: keep.
    head:
        Which output head of a multi-head model (default: the only head, or
        the one named ``default``).
    skin:
        Verlet skin of the wrapper's neighbour list (Angstrom).
    cueq:
        cuEquivariance kernels (mace-torch's own conversion, same weights):
        ``None`` (default) uses them when the model is on CUDA and
        cuequivariance-torch is installed, ``True`` requires them, ``False``
        keeps e3nn. Decided once, here, for ``device``.
    freeze:
        Turn off ``requires_grad`` of every parameter (default ``True``, as
        mace-torch's torch-sim model and calculator do): the forces
        differentiate the positions only, and autograd then keeps no activation
        that only a weight gradient needs (record 0089). ``False`` leaves the
        parameters as they are (to train through the wrapper).

    Attributes
    ----------
    mace:
        The wrapped module (after any conversion; its parameters frozen unless
        ``freeze=False``).
    neighbors:
        The wrapper's :class:`VerletList` (cutoff ``r_max``).
    uses_cueq:
        Whether the cuEquivariance conversion was applied.
    """

    #: ``torch.compile`` is refused at configuration time (see
    #: ``BaseModelMixin.compile_unsupported``): compiled whole, MACE failed on
    #: every rank after about 100 s of tracing.
    compile_unsupported = (
        "torch.compile's Dynamo fails inside e3nn, which MACE is built from "
        "(InternalTorchDynamoError on e3nn's Irreps.__len__ with mace-torch 0.3.16 "
        "and e3nn 0.4.4)"
    )

    def __init__(
        self,
        mace: torch.nn.Module,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        head: str | None = None,
        skin: float = 0.0,
        cueq: bool | None = None,
        freeze: bool = True,
    ) -> None:
        super().__init__()
        self.scripted = _check_mace(mace)
        check_positive("skin", skin, allow_zero=True)
        if dtype is not None and dtype not in (torch.float32, torch.float64):
            raise config_error(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        numbers = [int(z) for z in cast(Any, mace).atomic_numbers.tolist()]  # read before a move
        r_max = float(cast(Any, mace).r_max)
        if dtype is not None or device is not None:
            mace = mace.to(dtype=dtype, device=device)
        where = next(mace.parameters()).device
        self.uses_cueq = False
        if cueq is True or (cueq is None and where.type == "cuda" and cueq_available()):
            if self.scripted:
                raise config_error("cueq needs a Python MACE, not a TorchScript one")
            mace = _to_cueq(mace, where)
            self.uses_cueq = True
        if freeze:
            freeze_parameters(mace)
        self.mace = mace
        self.register_buffer("species_rows", species_table(numbers).to(where))
        self.n_species = len(numbers)
        self._heads = [str(h) for h in getattr(mace, "heads", ["Default"])]
        self.head = _head_index(self._heads, head)
        self._cutoff = r_max
        self.neighbors = VerletList(self._cutoff, skin)
        self._dd_gate = InputGate()
        self._specs: tuple[MLIPSpec, MLIPSpec] | None = None  # (halo, graph partition)

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], *, map_location: str = "cpu", **kwargs: Any
    ) -> MACEModel:
        """Wrap a saved mace-torch model (:func:`~nvdd.models.load_mace`: a trusted
        file only, it is unpickled); ``kwargs`` go to the constructor."""
        return cls(load_mace(path, map_location=map_location), **kwargs)

    # ---------------------------------------------------------- properties
    @property
    def cutoff(self) -> float:
        """MACE's ``r_max`` (Angstrom)."""
        return self._cutoff

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype."""
        return _model_dtype(self.mace)

    @property
    def atomic_numbers(self) -> list[int]:
        """The elements the model knows, in its one-hot order."""
        inner: Any = self.mace
        return [int(z) for z in inner.atomic_numbers.tolist()]

    @property
    def heads(self) -> list[str]:
        """The model's output heads."""
        return list(self._heads)

    def extra_repr(self) -> str:
        """The module repr's summary: cutoff, elements, head, skin and cuEquivariance use."""
        return (
            f"cutoff={self._cutoff}, atomic_numbers={self.atomic_numbers}, "
            f"head={self._heads[self.head]!r}, skin={self.neighbors.skin}, cueq={self.uses_cueq}"
        )

    # ---------------------------------------------------------------- spec
    def distribution_spec(self, strategy: StrategyKind | str = StrategyKind.HALO) -> MLIPSpec:
        """The model's spec for ``strategy`` (a :class:`StrategyKind` or its value).

        ``StrategyKind.HALO``: ``SPEC_MACE_HALO``, the outputs and autograd forces
        of ``SPEC_MPNN_HALO``, owned receivers, a ghost refresh of ``node_feats``
        before every interaction after the first and product blocks on the
        owned rows only (:mod:`nvdd.models._mace_spec`).
        ``StrategyKind.GRAPH_PARTITION``: ``SPEC_MACE_GP``, the same adapters
        and outputs with ``distribution.storage = GRAPH_PARTITION`` (the ghost
        rows are the atoms the owned rows' edges read, at their own positions,
        with the real cell and pbc, and the wrapper's periodic neighbour list
        applies the images). Both are built once per model, from the classes of
        its blocks.

        Raises
        ------
        ConfigurationError
            For a value that is not a strategy, or a TorchScript MACE (its
            interactions cannot be intercepted).
        """
        if self._specs is None:
            if self.scripted:
                raise config_error(
                    "a TorchScript-compiled MACE cannot run under domain decomposition: the "
                    "ghost-feature refresh before each interaction cannot be inserted into "
                    "compiled code; load the (non-compiled) .model file instead"
                )
            inner: Any = self.mace
            interactions = [type(m) for m in list(inner.interactions)[1:]]
            products = [type(m) for m in inner.products]
            self._specs = (
                mace_halo_spec(interactions, products),
                mace_graph_spec(interactions, products),
            )
        return halo_spec(self, strategy, *self._specs)

    # ------------------------------------------------------------- physics
    def graph(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        rows: torch.Tensor,
        system_index: torch.Tensor,
        edges: EdgeList,
    ) -> dict[str, torch.Tensor]:
        """MACE's input dict for ``edges`` (see the module docstring for the convention).

        ``positions`` ``(n_atoms, 3)``, ``cell`` ``(n_systems, 3, 3)``, ``rows``
        int64 ``(n_atoms,)`` (species rows), ``system_index`` int64 ``(n_atoms,)``.
        Differentiable in ``positions`` and ``cell``.
        """
        n_systems = int(cell.shape[0])
        dtype, device = positions.dtype, positions.device
        shift = edges.shift_vectors(cell, system_index)
        n_edges = edges.n_edges
        shifts = -shift if shift is not None else positions.new_zeros(n_edges, 3)
        node_attrs = torch.nn.functional.one_hot(rows, self.n_species).to(dtype)
        return {
            "positions": positions,
            "node_attrs": node_attrs,
            "edge_index": torch.stack([edges.senders, edges.receivers]),
            "shifts": shifts,
            "unit_shifts": -edges.shifts.to(dtype),
            "cell": cell.reshape(-1, 3),
            "batch": system_index,
            "ptr": torch.zeros(n_systems + 1, dtype=torch.int64, device=device),
            "head": torch.full((n_systems,), self.head, dtype=torch.int64, device=device),
        }

    def atom_energies(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        rows: torch.Tensor,
        system_index: torch.Tensor,
        edges: EdgeList,
    ) -> torch.Tensor:
        """Per-atom energies (MACE's ``node_energy``), shape ``(n_atoms,)``,
        differentiable in ``positions`` and ``cell``."""
        data = self.graph(positions, cell, rows, system_index, edges)
        out = self.mace(data, compute_force=False, training=False)
        node_energy: torch.Tensor = out["node_energy"]
        return node_energy.to(positions.dtype)

    def forward(
        self,
        batch: Batch,
        *,
        n_receivers: int | None = None,
        compute_stress: bool = True,
        create_graph: bool = False,
    ) -> ModelOutputs:
        """Energy, forces, atom energies, virial and stress of every system.

        Parameters
        ----------
        batch:
            One or several systems in the model's dtype, with elements the model
            knows (``atomic_numbers``).
        n_receivers:
            Keep only edges into the first ``n_receivers`` rows and count only
            their energies (under a live DD context: the owned rows, the default).
        compute_stress:
            Also return ``virial`` and ``stress``, shape ``(n_systems, 3, 3)``.
        create_graph:
            Keep the autograd graph of the outputs (to train on forces: build the
            wrapper with ``freeze=False`` for weight gradients).

        Returns
        -------
        ModelOutputs
            As :meth:`nvdd.models.ReferenceMPNN.forward`: under a live DD
            context ``energy`` is global on every rank, ``forces`` are this
            rank's ``-dE/dx`` on every padded row (the runtime folds ghost rows),
            ``virial`` / ``stress`` are this rank's partials.

        Raises
        ------
        ValidationError
            On malformed inputs, a dtype mismatch or an element the model does
            not know (on every rank together on a new DD topology).

        Notes
        -----
        **Collective** under a live DD context with the spec's adapters
        installed: one refresh per interaction after the first (and its reverse
        in the backward), one all-reduce of the energy, plus the input check on
        a new halo topology. No communication otherwise.
        """
        n_receivers, rows, edges = self._edges(
            batch, n_receivers, lambda: self._dtype_problem(batch)
        )
        return self._outputs_by_autograd(
            batch,
            rows,
            edges,
            n_receivers,
            compute_stress=compute_stress,
            energy_scope=_ENERGY_SCOPE,
            create_graph=create_graph,
        )

    def _dtype_problem(self, batch: Batch) -> str | None:
        dtype = self.dtype
        if batch.dtype == dtype:
            return None
        return (
            f"batch is {batch.dtype} but the MACE parameters are {dtype}; convert one of them "
            f"(MACEModel(..., dtype={batch.dtype}) or batch.to(dtype={dtype}))"
        )
