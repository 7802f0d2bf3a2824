"""`AIMNet2Model`: an AIMNet2 (``aimnet``) potential as an nvdd model.

AIMNet2 reads a dict of flat tensors in its "nb_mode 1" layout: the atoms of
every system stacked along one axis, followed by a padding atom that is the
*last* row; a dense ``(n_rows, K)`` neighbour matrix ``nbmat`` whose unused
slots hold that last row; the per-slot image shifts; a molecule index
``mol_idx``. That layout is exactly what :class:`nvdd.padding.DenseBatchPadder`
produces (padding atoms in a padding system, unused slots ``atom_cap - 1``),
so the wrapper builds it from its Verlet list through the padder, sized to fit
the batch (growth ``pad_growth``, default 1.0: every padding row and slot is
computed by the model; record 0085).

The model runs in two parts, both aimnet's own modules:

- the body (``AIMNet2.forward_prepared``): the embedding, the geometry
  (``AEVSV``) and ``len(mlps)`` passes, each a convolution over the
  neighbours (``ConvSV``) followed by an MLP. After every pass but the last,
  the *neural charge equilibration* (``AIMNet2._update_q``) moves charge so
  that each system's atomic charges sum to its total charge: ``q_i = q'_i +
  f_i (Q - sum_j q'_j) / (sum_j f_j + eps)``, a sum over every atom of the
  system. The wrapper supplies that step (:func:`_equalize`, the same
  equations) with the two sums over the rows it *counts*: every real row on
  one process; this rank's owned rows under ``DomainParallel``, summed over
  the ranks by one all-reduce whose backward is an all-reduce too
  (:func:`global_system_sum`), so every row's charge, ghost rows included,
  uses the global sums.
- the outputs (``Output``, ``AtomicShift``, ``AtomicSum``, ``SRCoulomb``):
  run with ``mol_idx`` = the row itself, so aimnet's own per-molecule sums are
  per-atom energies (``SRCoulomb``'s pair sum is split half to each atom, its
  own convention). ``LRCoulomb`` with ``method='dsf'`` (a pair sum of the final
  charges within ``dsf_rc``, on a second neighbour list ``nbmat_coulomb``) runs
  on aimnet's own differentiable DSF path (:func:`_dsf_forward`) and is split
  per atom the same way; the halo then reaches ``dsf_rc`` beyond the charges'
  receptive field (:attr:`AIMNet2Model.extra_reach`). Modules whose energy is
  not a sum of such per-atom terms (``LRCoulomb`` ``'simple'``: all pairs;
  ``'ewald'`` / ``'pme'``: the periodic system; ``DFTD3`` / ``D3TS``: a
  system-wide coordination kernel) are refused when the wrapper is built,
  naming the module.

Under ``DomainParallel`` the spec is :func:`nvdd.spec.receptive_field_spec`
with ``layers = len(mlps)`` and ``fold=True`` (record 0067; the equalisation's
sums are the only communication, record 0080): owned atoms' energies are
exact on a halo of ``layers x cutoff + skin`` (+ :attr:`AIMNet2Model.extra_reach`
with DSF), and the runtime's forces are the
derivative of their sum, ghost rows folded to their owners.

Two things the wrapper sets itself rather than aimnet's ``prepare_input``:
aimnet casts coordinates to the default dtype *of the moment it was
imported* (float32, usually), so the wrapper prepares the layout with
aimnet's own ``nbops.set_nb_mode`` and the masks ``calc_masks`` would set
(without its per-call host read of the molecule count, record 0085) and keeps
the model's dtype (float64 runs in float64); and the per-system total charge comes from
``batch.system_extras["charge"]`` (default 0).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from nvdd.core import (
    Batch,
    ModelOutputs,
    TensorMemo,
    ValidationError,
    all_reduce,
    get_rank,
)
from nvdd.models._checks import config_error
from nvdd.models._neighbors import EdgeList
from nvdd.models._receptive_wrapper import OptionalPackage, ReceptiveFieldWrapper
from nvdd.models._verlet import VerletList
from nvdd.padding import DenseBatchGraph, DenseBatchPadder
from nvdd.shardtensor import current_dd_context
from nvdd.spec import MLIPSpec, StrategyKind

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["AIMNet2Model", "global_system_sum"]

#: ``batch.system_extras`` key of each system's total charge (units of e).
TOTAL_CHARGE = "charge"
#: ``batch.system_extras`` key of each system's spin multiplicity (2S + 1; default 1),
#: read by open-shell models (two charge channels).
MULTIPLICITY = "mult"
#: aimnet's ``ops.nse`` epsilon (added to the sum of the weights).
_NSE_EPSILON = 1.0e-6
#: Output modules whose energy is a sum of per-atom terms (see the module docstring).
_PER_ATOM_OUTPUTS = ("Output", "AtomicShift", "AtomicSum", "SRCoulomb", "Dipole", "Quadrupole")
_WHY = {
    "LRCoulomb": "only method='dsf' (a pair sum within dsf_rc) is supported; 'simple' sums "
    "over all pairs of a system and 'ewald'/'pme' over the periodic system, not over a "
    "neighbourhood",
    "DFTD3": "its dispersion runs aimnet's system-wide D3 kernel",
    "D3TS": "its dispersion runs a system-wide kernel",
}

#: ``import_optional`` of an aimnet module with the extra's install hint.
aimnet_module = OptionalPackage("aimnet", "nvdd-models[aimnet2]", "AIMNet2Model")


class _SumOverRanksBoth(torch.autograd.Function):
    """All-reduce (sum) forward and backward: **Collective** over ``group`` in both
    (every rank must run the forward and, later, differentiate through it).

    Unlike ``nvdd.shardtensor.sum_over_ranks`` (identity backward, for a total
    each rank differentiates only through its own share) the result here feeds
    every rank's energies: ``d(sum_r E_r)/d x_r' = sum_r dE_r/dS * dS/dx_r'``,
    so the gradient reaching each rank's share is the sum over ranks.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        all_reduce(out, "sum", group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(out, "sum", ctx.group)
        return out, None


def global_system_sum(
    values: torch.Tensor,
    system_index: torch.Tensor,
    counted: torch.Tensor,
    n_systems: int,
    group: ProcessGroup | None = None,
    *,
    distributed: bool = False,
) -> torch.Tensor:
    """Per-system sums of the counted rows of ``values``, over every rank.

    **Collective** over ``group`` when ``distributed``: one all-reduce forward,
    and one more in the backward (every rank must differentiate through it, as
    the runtime's folded forces do); no communication otherwise.

    Parameters
    ----------
    values:
        Shape ``(n_rows, c)``.
    system_index:
        Int64, shape ``(n_rows,)``, values in ``[0, n_systems]`` (``n_systems``:
        a bucket for rows that are never counted).
    counted:
        Bool, shape ``(n_rows,)``: the rows that count (each atom on exactly one
        rank: the owned rows).
    n_systems, group, distributed:
        The number of systems; the group summed over when ``distributed``.

    Returns
    -------
    torch.Tensor
        Shape ``(n_systems, c)``, differentiable in ``values`` (the gradient of
        a sum every rank uses is summed over the ranks).
    """
    kept = torch.where(counted[:, None], values, torch.zeros_like(values))
    out = values.new_zeros(n_systems + 1, values.shape[1]).index_add(0, system_index, kept)
    out = out[:n_systems]
    if distributed:
        out = cast(torch.Tensor, _SumOverRanksBoth.apply(out, group))  # type: ignore[no-untyped-call]
    return out


def _equalize(
    model: Any, sums: Callable[[torch.Tensor], torch.Tensor], row_system: torch.Tensor
) -> Callable[..., dict[str, torch.Tensor]]:
    """AIMNet2's ``_update_q`` with its two per-system sums given by ``sums``
    (**Collective** when ``sums`` is: one call of it per charge pass).

    The pass's MLP output splits into the charge update, the weights' roots and
    the feature update; the charges become ``q' + f (Q - sum q') / (sum f +
    eps)`` per system, ``f`` the squared roots (aimnet's ``ops.nse``).
    """

    def update(data: dict[str, torch.Tensor], x: torch.Tensor, delta_q: bool = True) -> Any:
        nq = int(model.num_charge_channels)
        q_new, f_root, delta_a = torch.split(x, [nq, nq, x.shape[-1] - 2 * nq], dim=-1)
        q_u = data["charges"] + q_new if delta_q else q_new
        f_u = f_root.pow(2)
        total = sums(torch.cat([q_u, f_u], dim=-1))
        q_sum, f_sum = torch.split(total, [nq, nq], dim=-1)
        target = data["_nvdd_total_charge"]
        scale = (target - q_sum) / (f_sum + _NSE_EPSILON)
        scale = torch.cat([scale, scale.new_zeros(1, nq)])  # (rows never counted)
        data["charges"] = q_u + f_u * scale.index_select(0, row_system)
        data["a"] = data["a"] + delta_a.view_as(data["a"])
        return data

    return update


def _dsf_forward(module: Any) -> Callable[..., dict[str, torch.Tensor]]:
    """``LRCoulomb.forward`` (method ``'dsf'``) on its own differentiable path: its
    forward with ``training_derivatives=True`` (aimnet's closed-form DSF in torch,
    which it uses for forces in training and for Hessians), whose energy is
    differentiable in the positions and the charges; its plain forward calls a
    kernel that detaches the positions."""

    def forward(data: dict[str, torch.Tensor], **_: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = type(module).forward(module, data, training_derivatives=True)
        return out

    return forward


def _output_problem(model: Any) -> str | None:
    for name, module in model.outputs.named_children():
        kind = type(module).__name__
        if kind == "LRCoulomb" and module.method == "dsf":
            continue
        if kind not in _PER_ATOM_OUTPUTS:
            why = _WHY.get(kind, "its energy is not a sum of per-atom terms the wrapper knows")
            return (
                f"AIMNet2Model: output module {name!r} ({kind}) is not supported: {why}. "
                f"Supported outputs: {', '.join(_PER_ATOM_OUTPUTS)}; build the model without "
                f"{name!r} (AIMNet2's own v2 files keep long-range Coulomb and D3 outside the "
                "model, which its calculator adds)"
            )
        if kind == "AtomicShift" and bool(module.reduce_sum):
            return f"AIMNet2Model: output {name!r} (AtomicShift) has reduce_sum=True, unsupported"
    return None


class AIMNet2Model(ReceptiveFieldWrapper):
    """An ``aimnet.models.AIMNet2`` as an nvdd model (one process and under DD).

    Energy, forces and per-atom energies (``atom_energies``) of every system
    of a batch (the equalised atomic charges: :meth:`charges`), with periodic,
    open or mixed boundaries; each system's total charge is
    ``batch.system_extras["charge"]`` (default 0) and, for an open-shell model
    (two charge channels, aimnet's NSE), its spin multiplicity
    ``batch.system_extras["mult"]`` (default 1). Under ``DomainParallel`` it
    runs on the ``[owned | ghost]`` rows of a receptive-field halo
    (:meth:`distribution_spec`); the charge equilibration's sums are global
    (one all-reduce per charge pass, record 0080).

    Parameters
    ----------
    model:
        An ``aimnet.models.AIMNet2`` (from :meth:`from_file`, :meth:`from_config`
        or aimnet's own ``load_model``), closed- or open-shell, with outputs
        among ``Output``, ``AtomicShift``, ``AtomicSum``, ``SRCoulomb`` (and
        the non-energy ``Dipole`` / ``Quadrupole``).
    dtype, device:
        Convert the parameters (float32 or float64), move the model. Default: keep.
    skin:
        Verlet skin of the wrapper's neighbour list (Angstrom).
    pad_growth:
        Growth factor (>= 1) of :attr:`padder`'s capacities. The default 1.0 pads
        the matrix to what the batch needs (its rows plus the padding row, the
        widest row's neighbours; grow-only), so AIMNet2 runs on as many rows and
        slots as aimnet's own calculator gives it; a larger factor leaves headroom
        (e.g. 1.25: a quarter more rows and slots, every one computed), which
        only a shape-specialised compiled or captured forward would use.
    freeze:
        Turn off ``requires_grad`` of every parameter (default ``True``, as aimnet's
        calculator does for inference): the forces differentiate the positions only,
        and autograd then keeps no activation that only a weight gradient needs
        (about a tenth less peak memory per atom on the CPU, as little as aimnet's
        calculator; record 0088). ``False`` leaves the parameters as they are.

    Attributes
    ----------
    aimnet:
        The wrapped module (its parameters frozen unless ``freeze=False``; the
        wrapper supplies the charge equilibration's sums during its own forward
        only).
    neighbors:
        The wrapper's :class:`~nvdd.models.VerletList` (cutoff: the AEV's ``rc_s``).
    layers:
        Interaction passes (``len(model.mlps)``): the receptive field is
        ``layers x cutoff``.
    cutoff, dtype:
        The model's cutoff (the AEV's ``rc_s``, Angstrom) and the parameters' dtype.
    Raises
    ------
    ConfigurationError
        On an unsupported output module or a bad argument, naming it.
    """

    _wrapped = "aimnet"
    _label = "AIMNet2"
    compile_unsupported = (
        "aimnet's forward reads its neighbour mode from a tensor on the host on every call "
        "(nbops.get_nb_mode), which the wrapper does not trace with torch.compile"
    )

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        skin: float = 0.0,
        pad_growth: float = 1.0,
        freeze: bool = True,
    ) -> None:
        super().__init__()
        models = aimnet_module("aimnet.models")
        if not isinstance(model, models.AIMNet2):
            raise config_error(f"AIMNet2Model wraps an aimnet AIMNet2, got {type(model).__name__}")
        self._check_arguments(skin, dtype)
        if isinstance(pad_growth, bool) or not (
            isinstance(pad_growth, int | float) and 1.0 <= pad_growth < float("inf")
        ):
            raise config_error(f"pad_growth must be a finite number >= 1, got {pad_growth!r}")
        inner: Any = model
        problem = _output_problem(inner)
        if problem is not None:
            raise config_error(problem)
        self.layers = len(inner.mlps)
        dsf = [m for m in inner.outputs.children() if type(m).__name__ == "LRCoulomb"]
        if len(dsf) > 1:
            raise config_error("AIMNet2Model: more than one LRCoulomb output module")
        #: DSF Coulomb's cutoff (Angstrom), or None without one.
        self.coulomb_cutoff = float(dsf[0].dsf_rc) if dsf else None
        cutoff = float(inner.aev.rc_s)
        if not cutoff > 0:
            raise config_error(f"AIMNet2Model: the model's cutoff rc_s is {cutoff}")
        self.aimnet = self._convert(model, dtype, device, freeze=freeze)
        self._cutoff = cutoff
        self.neighbors = VerletList(cutoff, skin)
        self.coulomb_neighbors = (
            VerletList(self.coulomb_cutoff, skin) if self.coulomb_cutoff is not None else None
        )
        self.pad_growth = float(pad_growth)
        self._padder: DenseBatchPadder | None = None
        # the atomic numbers last checked against the embedding (see _check_elements)
        self._checked_numbers = TensorMemo()
        # (rows, device, dtype) and the input tensors of that layout (see _layout)
        self._layout_cache: tuple[tuple[int, torch.device, torch.dtype], dict[str, Any]] | None
        self._layout_cache = None
        # each Verlet list's candidates laid out densely (see _within), by id(list)
        self._candidate_cache: dict[int, _Candidates] = {}
        # the elements of its embedding (index 0 is padding)
        self._n_types = int(inner.afv.num_embeddings)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **kwargs: Any) -> AIMNet2Model:
        """Wrap the model of an aimnet v2 ``.pt`` file, read and built by aimnet's own
        ``aimnet.models.load_model`` (restricted ``torch.load``, its import policy);
        ``kwargs`` go to the constructor."""
        base = aimnet_module("aimnet.models.base", "AIMNet2Model.from_file")
        if not os.path.isfile(path):
            raise config_error(f"AIMNet2Model.from_file: no file {os.fspath(path)!r}")
        model, _meta = base.load_model(os.fspath(path), device="cpu")
        return cls(model, **kwargs)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], *, seed: int = 0, **kwargs: Any
    ) -> AIMNet2Model:
        """An AIMNet2 with random weights (``seed``) built by aimnet's own
        ``aimnet.config.build_module`` from its model configuration (the
        structure of aimnet's ``aimnet2.yaml``: ``{"class":
        "aimnet.models.AIMNet2", "kwargs": {...}}``). Nothing is downloaded.
        ``kwargs`` go to the constructor."""
        build = aimnet_module("aimnet.config", "AIMNet2Model.from_config")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = build.build_module(_plain(config))
        if not isinstance(module, torch.nn.Module):
            raise config_error("AIMNet2Model.from_config: the configuration built no module")
        return cls(module, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the padder (its frozen mappings do not pickle; a new one
        starts from small capacities)."""
        state = dict(self.__dict__)
        state["_padder"] = None
        state["_layout_cache"] = None
        state["_candidate_cache"] = {}
        return state

    # ---------------------------------------------------------- properties
    @property
    def padder(self) -> DenseBatchPadder:
        """The :class:`~nvdd.padding.DenseBatchPadder` of the neighbour matrix: growth
        :attr:`pad_growth`, capacities rounded to 1 (no multiple-of-8 slack), and no
        index checks (the matrix is the wrapper's own, valid by construction; the
        checks read the device on every step)."""
        if self._padder is None:
            self._padder = DenseBatchPadder(
                name="aimnet2",
                atom_fill={"atomic_numbers": 0},
                growth=self.pad_growth,
                atom_multiple=1,
                neighbor_multiple=1,
                check_indices=False,
            )
        return self._padder

    def extra_repr(self) -> str:
        """The module repr's summary: cutoff, layers and skin."""
        return f"cutoff={self._cutoff}, layers={self.layers}, skin={self.neighbors.skin}"

    # ---------------------------------------------------------------- spec
    def distribution_spec(self, strategy: StrategyKind | str = StrategyKind.HALO) -> MLIPSpec:
        """``receptive_field_spec(layers=self.layers, strategy=strategy, fold=True,
        extra_ghost_width=self.extra_reach)``.

        The model runs on ``[owned | ghost]`` rows of a halo of ``layers x cutoff
        + skin`` (+ :attr:`extra_reach`); owned atoms' energies are exact there
        (the charge equilibration's sums are global), and the forces are the
        derivative of their sum, ghost rows' parts folded to their owners
        (record 0067).
        """
        return super().distribution_spec(strategy)

    def _extra_reach(self) -> float:
        return self.extra_reach

    @property
    def extra_reach(self) -> float:
        """Angstrom of halo beyond ``layers x cutoff``: a DSF Coulomb term reads the
        final charges (``layers - 1`` passes deep) within ``dsf_rc``."""
        if self.coulomb_cutoff is None:
            return 0.0
        return max(0.0, self.coulomb_cutoff - self._cutoff)

    # ------------------------------------------------------------- physics
    def _check(self, batch: Batch) -> None:
        """The batch's dtype (every call, on the host) and its elements
        (:meth:`_check_elements`)."""
        self._check_dtype(batch)
        self._check_elements(batch.atomic_numbers)

    def _check_elements(self, z: torch.Tensor) -> None:
        """Every atomic number in the embedding (``1 .. n_types - 1``), read from the
        device only when ``z`` is not the tensor last checked (a new batch, a new
        partition or a runtime rebuild: one host read then, none in steady steps)."""
        if self._checked_numbers.same(z):
            return
        bad = (z < 1) | (z >= self._n_types)
        if bool(bad.any()):
            zs = sorted({int(v) for v in z[bad].tolist()})
            raise ValidationError(
                f"AIMNet2Model (rank {get_rank()}): atomic numbers {zs} are outside the "
                f"model's embedding (1..{self._n_types - 1})"
            )
        self._checked_numbers.remember(z)

    def inputs(self, batch: Batch, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """AIMNet2's prepared input dict (nb_mode 1) for ``batch`` at ``positions``.

        The rows are the batch's, padded by :attr:`padder` (the last row a padding
        atom); ``mol_idx`` is the row (per-atom outputs); differentiable in
        ``positions``.
        """
        self._check(batch)
        matrix, counts, vectors = self._within(self.neighbors, batch, fill=0)
        graph = DenseBatchGraph(
            neighbors=matrix,
            num_neighbors=counts,
            system_index=batch.system_index,
            n_systems=batch.n_systems,
            atom_fields={"positions": positions, "atomic_numbers": batch.atomic_numbers},
            neighbor_fields={"shifts": vectors},
        )
        padded = self.padder.pad(graph)
        rows = int(padded.neighbors.shape[0])
        data: dict[str, torch.Tensor] = {
            "coord": padded.atom_fields["positions"],
            "numbers": padded.atom_fields["atomic_numbers"].to(torch.int64),
            "nbmat": padded.neighbors.to(torch.int32),
            "shifts": padded.neighbor_fields["shifts"],
            **self._layout(rows, positions),
        }
        if self.coulomb_neighbors is not None:  # DSF's list, padded to the same rows
            near, _, near_shifts = self._within(self.coulomb_neighbors, batch, fill=rows - 1)
            n, k = near.shape
            data["nbmat_coulomb"] = torch.cat([near, near.new_full((rows - n, k), rows - 1)]).to(
                torch.int32
            )
            data["shifts_coulomb"] = torch.cat([near_shifts, near_shifts.new_zeros(rows - n, k, 3)])
        nbops = aimnet_module("aimnet.nbops")
        data = nbops.set_nb_mode(data)
        if rows < 2:  # (no real row: aimnet's own preparation reads nothing from the device)
            return cast(dict[str, torch.Tensor], nbops.calc_masks(data))
        # aimnet's calc_masks (nb_mode 1) without its host read: it counts the molecules
        # as the largest mol_idx + 1 (read from the device: rows - 1 here) and folds the
        # padding row into the last molecule (the _layout's mol_idx already does).
        # mask_i, mol_sizes and _natom are the layout's; only the pair masks are new.
        for suffix in ("", "_lr", "_coulomb", "_dftd3"):
            if f"nbmat{suffix}" in data:
                data[f"mask_ij{suffix}"] = data[f"nbmat{suffix}"] == rows - 1
        data["_input_padded"] = torch.tensor(True)
        data["_num_mol"] = torch.tensor(rows - 1)
        return data

    def _within(
        self, verlet: VerletList, batch: Batch, *, fill: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``verlet``'s pairs within its cutoff at the batch's positions as a dense
        ``(n_atoms, K)`` matrix (unused slots ``fill``), each row's count and the
        slots' Cartesian image shifts ``(n_atoms, K, 3)`` (zero in unused slots).

        The candidate list (``cutoff + skin``) is laid out densely once per build
        (:func:`_candidates`); each step filters it in place and moves the kept
        slots of a row to its front in their candidate order, so the matrix is the
        one the filtered edge list would give, with one host read (``K``).
        """
        edges = verlet.for_batch(batch, filtered=False)
        key = id(verlet)
        cands = self._candidate_cache.get(key)
        if cands is None or cands.source is not edges:
            cands = _candidates(edges, batch.n_atoms)
            self._candidate_cache[key] = cands
        return _filter(cands, batch, verlet.cutoff, fill)

    def _layout(self, rows: int, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """The input tensors that depend only on the row count (cached for the last
        one): the identity ``cell``, each row its own molecule (``mol_idx``; the
        padding row folded into the last, as aimnet's ``calc_masks`` does), zero
        ``charge`` per molecule (the wrapper supplies the systems' totals itself),
        and aimnet's ``mask_i``, ``mol_sizes`` and ``_natom`` for that layout."""
        key = (rows, positions.device, positions.dtype)
        if self._layout_cache is not None and self._layout_cache[0] == key:
            return self._layout_cache[1]
        dev = positions.device
        mol_idx = torch.arange(rows, device=dev)
        if rows > 1:
            mol_idx[-1] = rows - 2
        sizes = torch.ones(rows - 1, dtype=torch.int64, device=dev)
        fixed = {
            "cell": torch.eye(3, dtype=positions.dtype, device=dev),
            "mol_idx": mol_idx,
            "charge": positions.new_zeros(rows - 1),
            "mask_i": torch.arange(rows, device=dev) == rows - 1,
            "mol_sizes": sizes,
            "_natom": sizes,
        }
        self._layout_cache = (key, fixed)
        return fixed

    def _sums(self, batch: Batch, rows: int) -> tuple[Callable[..., Any], torch.Tensor]:
        """The equalisation's per-system sum and each padded row's system
        (``n_systems`` for padding rows). The sum is :func:`global_system_sum` over
        the owned rows, **Collective** under a live DD context; over every real row,
        local, otherwise."""
        n, s = batch.n_atoms, batch.n_systems
        dev = batch.positions.device
        row_system = torch.full((rows,), s, dtype=torch.int64, device=dev)
        row_system[:n] = batch.system_index
        counted = torch.zeros(rows, dtype=torch.bool, device=dev)
        ctx = current_dd_context()
        layout = ctx.layout
        counted[: n if layout is None else layout.n_owned] = True
        distributed = layout is not None

        def sums(values: torch.Tensor) -> torch.Tensor:
            return global_system_sum(
                values, row_system, counted, s, ctx.group, distributed=distributed
            )

        return sums, row_system

    def _targets(self, batch: Batch, dtype: torch.dtype) -> torch.Tensor:
        """Each system's charge per channel, ``(n_systems, channels)``: its total
        charge ``Q``, or for two channels ``Q/2 +- (mult - 1)/2`` (aimnet's split)."""
        values = {}
        for key, default in ((TOTAL_CHARGE, 0.0), (MULTIPLICITY, 1.0)):
            v = batch.system_extras.get(key)
            if v is None:
                v = torch.full((batch.n_systems,), default, device=batch.device)
            elif tuple(v.shape) != (batch.n_systems,):
                raise ValidationError(
                    f"system_extras[{key!r}] has shape {tuple(v.shape)}, expected "
                    f"({batch.n_systems},): one value per system"
                )
            values[key] = v.to(dtype)
        total = values[TOTAL_CHARGE]
        if int(cast(Any, self.aimnet).num_charge_channels) == 1:
            return total[:, None]
        half_spin = 0.5 * (values[MULTIPLICITY] - 1.0)
        return torch.stack([0.5 * total + half_spin, 0.5 * total - half_spin], dim=1)

    def _run(self, batch: Batch, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-atom energies and equalised charges of ``batch``'s rows at ``positions``."""
        targets = self._targets(batch, positions.dtype)
        inner: Any = self.aimnet
        data = self.inputs(batch, positions)
        sums, row_system = self._sums(batch, int(data["coord"].shape[0]))
        data["_nvdd_total_charge"] = targets
        if int(inner.num_charge_channels) == 2:  # (aimnet's per-molecule split: unused here)
            data["mult"] = torch.ones_like(data["charge"])
        coulomb = [m for m in inner.outputs.children() if type(m).__name__ == "LRCoulomb"]
        inner.__dict__["_update_q"] = _equalize(inner, sums, row_system)
        for module in coulomb:
            module.__dict__["forward"] = _dsf_forward(module)
        try:
            out = inner.forward_prepared(data)
        finally:
            del inner.__dict__["_update_q"]
            for module in coulomb:
                del module.__dict__["forward"]
        n = batch.n_atoms
        return out["energy"][:n].to(positions.dtype), out["charges"][:n]

    def charges(self, batch: Batch) -> torch.Tensor:
        """The equalised atomic charges (e) of ``batch``'s atoms, shape ``(n_atoms,)``:
        each system's sum is its total charge (to aimnet's ``1e-6`` regularisation).

        **Collective** under a live DD context (as :meth:`forward`).
        """
        with torch.no_grad():
            return self._run(batch, batch.positions.detach())[1]

    def forward(self, batch: Batch) -> ModelOutputs:
        """Energy, forces and per-atom energies of every system of ``batch``.

        Forces are ``-dE/dx`` by autograd, every output detached; where ``batch.positions``
        requires grad already (the runtime's leaf) the outputs keep their graph, no forces.

        **Collective** under a live DD context: one all-reduce per charge pass
        (and one per pass in the backward).

        Raises
        ------
        ValidationError
            On a dtype mismatch or an element outside the model's embedding
            (checked when ``batch.atomic_numbers`` is a tensor not checked before:
            a new batch or partition, never in steady steps), or a total charge
            (``batch.system_extras["charge"]``) of the wrong shape.
        """
        return self._outputs(batch, lambda positions: self._run(batch, positions)[0])


@dataclass(frozen=True, eq=False)
class _Candidates:
    """A Verlet candidate list laid out as a dense matrix (built once per build).

    Attributes
    ----------
    source:
        The candidate :class:`EdgeList` it was built from (the cache's key).
    senders:
        Int64 ``(n_atoms, kc)``: each row's candidates in the list's order (stable
        by receiver); unused slots hold the row itself.
    valid:
        Bool ``(n_atoms, kc)``: the used slots.
    shifts:
        ``(n_atoms, kc, 3)`` integer image shifts (zero in unused slots), or None
        when the list is not periodic.
    """

    source: EdgeList
    senders: torch.Tensor
    valid: torch.Tensor
    shifts: torch.Tensor | None


def _candidates(edges: EdgeList, n: int) -> _Candidates:
    """``edges`` as a :class:`_Candidates` of ``n`` rows (one host read: the
    widest row)."""
    order = torch.argsort(edges.receivers, stable=True)
    recv = edges.receivers.index_select(0, order)
    dev = recv.device
    counts = torch.zeros(n, dtype=torch.int64, device=dev).index_add_(
        0, recv, torch.ones_like(recv)
    )
    kc = int(counts.max()) if n and recv.numel() else 0
    slot = torch.arange(recv.shape[0], device=dev) - (torch.cumsum(counts, 0) - counts)[recv]
    senders = torch.arange(n, device=dev)[:, None].repeat(1, kc)
    senders[recv, slot] = edges.senders.index_select(0, order)
    valid = torch.zeros(n, kc, dtype=torch.bool, device=dev)
    valid[recv, slot] = True
    shifts = None
    if edges.periodic:
        shifts = torch.zeros(n, kc, 3, dtype=edges.shifts.dtype, device=dev)
        shifts[recv, slot] = edges.shifts.index_select(0, order)
    return _Candidates(edges, senders, valid, shifts)


def _filter(
    cands: _Candidates, batch: Batch, cutoff: float, fill: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The candidates within ``cutoff`` at ``batch.positions``: the dense matrix (kept
    slots first in each row, in candidate order; unused slots ``fill``), the rows'
    counts and the kept slots' Cartesian shifts ``S @ cell`` (differentiable in the
    cell; zero in unused slots). The distances are ``VerletList``'s (``x[j] - x[i]
    + S @ cell``, squared, against ``cutoff**2``). One host read: the widest row."""
    n, kc = cands.valid.shape
    cell = batch.cell
    shift = None
    if cands.shifts is not None:
        s = cands.shifts.to(cell.dtype)
        if cell.shape[0] == 1:
            shift = s @ cell[0]
        else:
            shift = torch.bmm(s, cell.index_select(0, batch.system_index))
    with torch.no_grad():
        pos = batch.positions.detach()
        r = pos.index_select(0, cands.senders.reshape(-1)).view(n, kc, 3) - pos[:, None, :]
        if shift is not None:
            r = r + shift.detach()
        within = cands.valid & ((r * r).sum(dim=2) < cutoff * cutoff)
        counts = within.sum(dim=1)
        k = int(counts.max()) if n and kc else 0
        # kept slots first, in candidate order (a stable sort of "not kept")
        order = torch.argsort((~within).to(torch.int8), dim=1, stable=True)[:, :k]
        keep = within.gather(1, order)
        matrix = torch.where(keep, cands.senders.gather(1, order), fill)
    if shift is None:
        vectors = batch.positions.new_zeros(n, k, 3)
    else:
        picked = shift.gather(1, order[:, :, None].expand(n, k, 3))
        vectors = torch.where(keep[:, :, None], picked, 0.0)
    return matrix, counts, vectors


def _plain(config: Mapping[str, Any]) -> Any:
    """A deep plain-``dict``/``list`` copy of ``config`` (aimnet's builder mutates it)."""
    if isinstance(config, Mapping):
        return {k: _plain(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [_plain(v) for v in config]
    return config
