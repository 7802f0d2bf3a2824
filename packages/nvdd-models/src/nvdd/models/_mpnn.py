"""`ReferenceMPNN`: a small, pure-torch message-passing potential.

Architecture (hidden width ``F``, ``K`` radial features, ``L`` layers):

1. ``h0 = embedding[species]``, shape ``(n_atoms, F)``.
2. Per edge ``(i, j)``: radial features ``rbf(r_ij)`` (Bessel basis times a
   smooth envelope, ``_radial.py``) and a filter
   ``w = W2 silu(W1 rbf)`` (no biases: ``w -> 0`` smoothly at the cutoff).
3. Each layer: messages ``m_ij = w_l(r_ij) * (S_l h)[j]`` gathered with
   ``index_select`` from the senders, summed into the receivers with
   ``index_add_``, then a residual update ``h <- h + MLP_l([h, sum_j m_ij])``.
4. Readout: ``e_i = MLP_out(h_i) + e0[species_i]``; the system energy is the sum
   of the counted rows' ``e_i`` (``_reduce.system_energy``).

Forces are ``-dE/dx`` and the virial ``-dE/d strain`` by autograd.

Domain-decomposition seam (d): per-atom tensors flow only through
``index_select``, ``index_add_``, ``zeros_like``, ``cat`` and ``nn.Linear``, so
a per-atom tensor subclass (a ShardTensor) sees every gather and scatter through
``__torch_function__``; no custom or compiled op hides them.

Under a live DD context (``SPEC_MPNN_HALO``, ``ScatterMode.LOCAL``) edges exist
only for owned receivers, so after each aggregation the owned rows are exact
and the ghost rows hold nothing: the owned rows update, and
``refresh_neighbors`` copies the new features to the ghost rows (no update work
on ghost rows, one exchange per layer; none after the last layer, whose ghost
rows nothing reads). The ghost width stays one cutoff however many layers the
model has. With ``ScatterMode.FOLD`` the (zero) ghost partials are folded into
their owners and every row updates (two exchanges per layer, same forces). The energy is summed with
``system_sum(..., scope=Scope.OWNED)`` (replicated on every rank, identity
backward) and forces come from autograd with respect to the runtime's padded
positions leaf (``autograd_target``): the backward of each fold routes the
gradient of ghost features back to the ranks owning them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import silu

from nvdd.core import Batch, ModelOutputs, TensorMemo
from nvdd.models._checks import check_positive, config_error
from nvdd.models._compiled import (
    CompiledCore,
    mpnn_energies,
    mpnn_first,
    mpnn_last,
    mpnn_layer,
)
from nvdd.models._dd import (
    HaloModelMixin,
    InputGate,
    energy_scope,
    per_atom_exchange,
    prepare_rows,
)
from nvdd.models._device_edges import DeviceEdges, PaddedEdges
from nvdd.models._neighbors import EdgeList
from nvdd.models._radial import radial_features
from nvdd.models._species import check_species, species_table
from nvdd.models._verlet import VerletList
from nvdd.shardtensor import (
    ShardTensor,
    current_dd_context,
    refresh_neighbors,
    scatter_to_owners,
)
from nvdd.spec import SPEC_MPNN_GP, SPEC_MPNN_HALO, CompilePolicy, MLIPSpec, ScatterMode

__all__ = ["MPNNConfig", "ReferenceMPNN"]

_NEIGHBOR_MODES = ("auto", "device", "verlet")


@dataclass(frozen=True)
class MPNNConfig:
    """Hyper-parameters of :class:`ReferenceMPNN`.

    Parameters
    ----------
    cutoff:
        Radial cutoff (Angstrom).
    species:
        Atomic numbers the model knows (one embedding row each).
    hidden:
        Feature width ``F``.
    n_basis:
        Number of Bessel functions ``K``.
    n_layers:
        Message-passing layers ``L`` (the reference uses 2 or 3).
    envelope_exponent:
        ``p`` of the polynomial envelope (``>= 2``).
    seed:
        Seed of the deterministic initialisation.
    skin:
        Verlet skin of the model's neighbour cache.
    neighbors:
        Where the edges come from: ``"device"`` (a Warp Verlet list
        compacted on the device at fixed capacities, :class:`DeviceEdges`: no
        host read in a step, so steady steps can be captured in a CUDA graph),
        ``"verlet"`` (vesin candidates compacted on the host side each call) or
        ``"auto"`` (the default: ``"device"`` on CUDA with a skin > 0 outside a
        DD layout, else ``"verlet"``). Under a halo layout ``"device"`` runs
        too (captured halo steps), but each halo rebuild then re-sizes the
        buffers and recaptures the step: it pays only when rebuilds are rare.
    """

    cutoff: float = 5.0
    species: tuple[int, ...] = (1, 6, 7, 8)
    hidden: int = 32
    n_basis: int = 8
    n_layers: int = 2
    envelope_exponent: int = 6
    seed: int = 0
    skin: float = 0.0
    neighbors: str = "auto"

    def __post_init__(self) -> None:
        check_positive("cutoff", self.cutoff)
        check_positive("skin", self.skin, allow_zero=True)
        if self.neighbors not in _NEIGHBOR_MODES:
            raise config_error(
                f"MPNNConfig.neighbors must be one of {_NEIGHBOR_MODES}, got {self.neighbors!r}"
            )
        object.__setattr__(self, "species", tuple(self.species))
        if not self.species:
            raise config_error("MPNNConfig.species must list at least one atomic number")
        for name, low in (("hidden", 1), ("n_basis", 1), ("n_layers", 1), ("envelope_exponent", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise config_error(f"MPNNConfig.{name} must be an int >= {low}, got {value!r}")


class _MessageLayer(torch.nn.Module):
    """One round of messages and a residual update."""

    def __init__(self, hidden: int, n_basis: int) -> None:
        super().__init__()
        self.filter_in = torch.nn.Linear(n_basis, hidden, bias=False)
        self.filter_out = torch.nn.Linear(hidden, hidden, bias=False)
        self.sender = torch.nn.Linear(hidden, hidden, bias=False)
        self.update_in = torch.nn.Linear(2 * hidden, hidden)
        self.update_out = torch.nn.Linear(hidden, hidden)

    def forward(
        self,
        h: torch.Tensor,
        radial: torch.Tensor,
        receivers: torch.Tensor,
        senders: torch.Tensor,
        mode: ScatterMode = ScatterMode.FOLD,
        n_update: int | None = None,
        refresh: bool = True,
    ) -> torch.Tensor:
        """``h`` ``(n_atoms, F)``, ``radial`` ``(n_edges, K)`` -> new ``h``.

        ``mode`` is the spec's ``options.scatter``. ``LOCAL`` under DD (owned
        receivers; ``n_update`` = the owned rows): only the owned rows receive
        messages, so only they are updated, then the ghost rows are refreshed
        from their owners (``refresh``; skipped after the last layer, whose ghost
        rows nothing reads). ``FOLD``: the aggregated messages are folded to
        their owners and every row is updated. ``NONE``: nothing is exchanged.

        **Collective** under a live DD context (one exchange over the layout's
        group for ``LOCAL``, two for ``FOLD``; every rank runs every layer).
        """
        weights = self.filter_out(silu(self.filter_in(radial)))
        messages = weights * self.sender(h).index_select(0, senders)
        if mode is not ScatterMode.LOCAL or n_update is None or isinstance(h, ShardTensor):
            aggregated = torch.zeros_like(h).index_add_(0, receivers, messages)
            if mode is not ScatterMode.NONE and not isinstance(aggregated, ShardTensor):
                aggregated = scatter_to_owners(aggregated)  # a ShardTensor's scatter folded already
            update: torch.Tensor = self.update_out(
                silu(self.update_in(torch.cat([h, aggregated], 1)))
            )
            return h + update
        own = h[:n_update]
        aggregated = own.new_zeros(own.shape).index_add_(0, receivers, messages)
        step: torch.Tensor = self.update_out(silu(self.update_in(torch.cat([own, aggregated], 1))))
        own = own + step
        # refreshed even without ghost rows here: a refresh is an all_to_all that
        # every rank calls (this rank's rows may be ghosts elsewhere)
        padded = own if own.shape[0] == h.shape[0] else torch.cat([own, h[n_update:]])
        return refresh_neighbors(padded) if refresh else padded


class ReferenceMPNN(HaloModelMixin, torch.nn.Module):
    """A deterministic reference message-passing network (energy, forces, stress).

    Runs unchanged on one process and, inside a live DD context, on one rank's
    ``[owned | ghost]`` rows (see :meth:`forward` and :meth:`distribution_spec`).

    Parameters
    ----------
    config:
        Hyper-parameters (cutoff, species, widths, layers, seed, skin).
    dtype:
        Parameter dtype (float32 or float64). Parameters are drawn in float64
        from ``config.seed`` and then cast, so a float32 and a float64 model of
        the same seed agree to float32 rounding.
    device:
        Parameter device.
    spec:
        Replaces ``SPEC_MPNN_HALO``; its ``options.scatter`` selects the per-layer
        exchange: ``LOCAL`` (the preset: owned rows updated, then the ghost rows'
        features refreshed, one exchange per layer but the last; exact since
        receivers are owned rows) or ``FOLD`` (aggregated messages folded with
        ``scatter_to_owners`` and every row updated, two exchanges per layer);
        ``NONE`` only for one layer. Its energy
        declaration must stay replicated (``Reduce.OWNED_ONLY``).

    Attributes
    ----------
    neighbors:
        The model's :class:`VerletList`.

    Notes
    -----
    :meth:`distribution_spec` returns ``SPEC_MPNN_HALO`` for
    ``StrategyKind.HALO``: forces by autograd with respect to the padded
    positions (returned on every padded row, folded into owners by the runtime),
    energy replicated on every rank, virial and stress per-rank partials, atom
    energies exact on owned rows. Under its ``ScatterMode.LOCAL`` receivers are
    owned, so each layer aggregates and updates the owned rows only and then
    refreshes the ghost rows from their owners (one exchange per layer but the
    last; ``ScatterMode.FOLD`` instead folds the aggregated messages and updates
    every row: two exchanges per layer, the same forces).

    ``StrategyKind.GRAPH_PARTITION`` returns ``SPEC_MPNN_GP``: the same rows and
    exchanges, but the rows are this rank's index block plus the atoms its edges
    read, at their own positions, with the real cell and pbc (the layout's
    ``explicit_images`` is False), and the model's neighbour list applies the
    periodic images itself.
    """

    _halo_preset = SPEC_MPNN_HALO
    _graph_preset = SPEC_MPNN_GP

    def __init__(
        self,
        config: MPNNConfig | None = None,
        *,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
        spec: MLIPSpec | None = None,
    ) -> None:
        super().__init__()
        self._spec = spec
        if dtype not in (torch.float32, torch.float64):
            raise config_error(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        self._config = config = config if config is not None else MPNNConfig()
        width, n_species = config.hidden, len(config.species)
        self.register_buffer("species_rows", species_table(config.species))
        self.embedding = torch.nn.Parameter(torch.empty(n_species, width, dtype=torch.float64))
        self.layers = torch.nn.ModuleList(
            _MessageLayer(width, config.n_basis).to(torch.float64) for _ in range(config.n_layers)
        )
        self.readout_in = torch.nn.Linear(width, width, dtype=torch.float64)
        self.readout_out = torch.nn.Linear(width, 1, dtype=torch.float64)
        self.species_energy = torch.nn.Parameter(torch.empty(n_species, dtype=torch.float64))
        self._initialise(config.seed)
        self.to(dtype=dtype, device=device)
        self.neighbors = VerletList(config.cutoff, config.skin)
        self.device_edges = DeviceEdges(config.cutoff, config.skin)
        self._species_seen = TensorMemo()
        self._pending: PaddedEdges | None = None  # edges of begin_step, for the next call
        self._pending_topology: object = None  # the halo topology they were searched on
        self._dd_gate = InputGate()
        if per_atom_exchange(self.distribution_spec()) is None and config.n_layers > 1:
            raise config_error(
                f"ReferenceMPNN with {config.n_layers} layers needs a per-layer exchange of ghost "
                "features: its spec's options.scatter must be FOLD or LOCAL, got NONE"
            )
        self._core: CompiledCore | None = None

    def _initialise(self, seed: int) -> None:
        """Draw every parameter from one generator, in registration order."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                draw = torch.randn(param.shape, generator=gen, dtype=torch.float64)
                if name.endswith("bias") or name == "species_energy":
                    param.copy_(0.1 * draw)
                elif name == "embedding":
                    param.copy_(draw)
                else:  # Linear weights (out, in): unit variance outputs
                    param.copy_(draw / math.sqrt(param.shape[1]))

    @property
    def config(self) -> MPNNConfig:
        """The configuration the model was built from."""
        return self._config

    @property
    def cutoff(self) -> float:
        """Radial cutoff (Angstrom)."""
        return self._config.cutoff

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype."""
        return self.embedding.dtype

    def extra_repr(self) -> str:
        """The module repr's summary: the whole configuration."""
        c = self._config
        return (
            f"cutoff={c.cutoff}, species={c.species}, hidden={c.hidden}, n_basis={c.n_basis}, "
            f"n_layers={c.n_layers}, p={c.envelope_exponent}, seed={c.seed}, skin={c.skin}"
        )

    # ----------------------------------------------------------------- physics
    def atom_energies(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        rows: torch.Tensor,
        system_index: torch.Tensor,
        edges: EdgeList | PaddedEdges,
    ) -> torch.Tensor:
        """Per-atom energies, shape ``(n_atoms,)``; differentiable in positions and cell.

        ``rows`` are the atoms' species rows (int64 ``(n_atoms,)``). ``edges`` may
        be :class:`PaddedEdges` (the device path, outside a DD layout).
        """
        if isinstance(edges, PaddedEdges):
            return self._padded_atom_energies(positions, cell, rows, system_index, edges)
        if self._core is not None:
            return self._compiled_atom_energies(
                self._core, positions, cell, rows, system_index, edges
            )
        c = self._config
        r_vec = edges.vectors(positions, cell, system_index)
        r = torch.sqrt((r_vec * r_vec).sum(dim=1))
        radial = radial_features(r, c.cutoff, c.n_basis, c.envelope_exponent)
        h = self.embedding.index_select(0, rows)
        mode = self.distribution_spec().options.scatter
        n_update = self._owned_rows(mode)
        last = len(self.layers) - 1
        for k, layer in enumerate(self.layers):
            h = layer(h, radial, edges.receivers, edges.senders, mode, n_update, refresh=k < last)
        if n_update is not None and n_update < h.shape[0]:
            # Ghost rows' energies are never counted: read out the owned rows only.
            own = self.readout_out(silu(self.readout_in(h[:n_update]))).squeeze(1)
            energies = torch.cat([own, own.new_zeros(h.shape[0] - n_update)])
        else:
            energies = self.readout_out(silu(self.readout_in(h))).squeeze(1)
        return energies + self.species_energy.index_select(0, rows)

    def _padded_atom_energies(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        rows: torch.Tensor,
        system_index: torch.Tensor,
        edges: PaddedEdges,
    ) -> torch.Tensor:
        """:meth:`atom_energies` on the device edges: the masked regions of
        ``_compiled`` (compiled under the model's core, else as they are), one
        region without ghost rows, else cut at each refresh of the ghost rows.

        **Collective** under a live DD context with ghost rows (one refresh per
        layer but the last).
        """
        n = int(positions.shape[0])
        n_update = self._owned_rows(self.distribution_spec().options.scatter)
        if n_update == 0:  # a rank without owned rows: one dummy row receives the
            # (masked) padded edges, the results are sliced off; the refreshes
            # and reductions still run, as on every other rank
            return self._without_owned_rows(positions, rows)
        core = self._core

        def region(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            return fn if core is None else core.fn(key, fn)

        recv, send, mask = edges.receivers, edges.senders, edges.mask
        # under DD every rank refreshes after every layer but the last, with or
        # without ghost rows of its own (a refresh is an all_to_all: every rank
        # of the group calls it, one whose rows are ghosts elsewhere sends)
        if n_update is None or len(self.layers) == 1:
            owned = rows if n_update is None else rows[:n_update]
            inputs = (positions, cell, rows, system_index, recv, send, edges.shifts, mask)
            energies: torch.Tensor = region("energies", mpnn_energies)(self, *inputs, recv, owned)
        else:  # ghost rows: regions cut at the refreshes
            if core is not None:  # compiled: rows padded to rank-agreed capacities
                cap, owned_cap = core.row_caps(n, n_update, self._dd_gate.generation)
                positions = torch.cat([positions, positions.new_zeros(cap - n, 3)])
                system_index = torch.cat([system_index, system_index.new_zeros(cap - n)])
                rows = torch.cat([rows, rows.new_zeros(cap - n)])
                owned = rows[:owned_cap]  # (rows past n_owned: refreshed or never read)
            else:
                owned = rows[:n_update]
            inputs = (positions, cell, rows, system_index, recv, send, edges.shifts, mask)
            radial, h = region("first", mpnn_first)(self, *inputs, recv, owned)
            for layer in list(self.layers)[1:-1]:
                h = torch.cat([refresh_neighbors(h[:n]), h[n:]])
                h = region("layer", mpnn_layer)(layer, h, radial, recv, send, mask, owned)
            h = torch.cat([refresh_neighbors(h[:n]), h[n:]])
            energies = region("last", mpnn_last)(self, h, radial, recv, send, mask, owned)
            energies = energies[:n_update]
            rows = rows[:n]
        if energies.shape[0] < n:  # ghost rows: their species offset only
            ghost = self.species_energy.index_select(0, rows[energies.shape[0] :])
            energies = torch.cat([energies, ghost])
        return energies + self.device_edges.poison(energies.dtype)  # NaN after a search error

    def _without_owned_rows(self, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """:meth:`_padded_atom_energies` on a rank that owns no row (its edges are
        all padding, so none is read): the same exchanges as a rank that owns some, the ghost
        rows' species offsets as energies. **Collective** as that method."""
        n = int(positions.shape[0])
        # (tied to the positions, so that the backward runs each refresh's fold too)
        h = self.embedding.index_select(0, rows) + 0.0 * positions.sum()
        for _ in range(len(self.layers) - 1):  # each layer's refresh, with nothing to update
            h = refresh_neighbors(h)
        if self._core is not None:  # the capacity agreement the other ranks make
            self._core.row_caps(n, 0, self._dd_gate.generation)
        energies = self.species_energy.index_select(0, rows) + 0.0 * h.sum()
        return energies + self.device_edges.poison(energies.dtype)

    def compile_forward(self, policy: CompilePolicy | None) -> bool:
        """Compile the tensor core under ``policy`` (see ``BaseModelMixin.compile_forward``).

        Compiled regions, all collective-free; each layer updates the first
        ``owned_cap`` rows (a capacity of the owned count). Under a DD context
        with ghost rows and two layers or more, cut where the ghost rows are
        refreshed (eagerly): the embedding, radial features and first layer
        (``mpnn_first``), each middle layer, the last layer and the readout
        (``mpnn_last``). Otherwise (one process, a world of one running the
        whole batch, one layer) the same code as one region
        (``mpnn_energies``). While compiled, the parameters do not
        require grad (forces need none; restored by ``None``, which returns to
        the eager model). Returns False (the runtime compiles the whole forward
        instead) when the preset's scatter mode is not ``ScatterMode.LOCAL``.
        """
        if self._core is not None:
            self._core.release()
            self._core = None
        if policy is None or self.distribution_spec().options.scatter is not ScatterMode.LOCAL:
            return False
        self._core = CompiledCore(policy, "mpnn", self)
        return True

    def _compiled_atom_energies(
        self,
        core: CompiledCore,
        positions: torch.Tensor,
        cell: torch.Tensor,
        rows: torch.Tensor,
        system_index: torch.Tensor,
        edges: EdgeList,
    ) -> torch.Tensor:
        """:meth:`atom_energies` through the compiled regions (same values).

        **Collective** under a live DD context as :meth:`atom_energies` (one
        refresh per layer but the last), plus one all-reduce of the padding
        capacities at a new halo topology.
        """
        n = int(positions.shape[0])
        n_update = self._owned_rows(self.distribution_spec().options.scatter)
        gen = self._dd_gate.generation
        t = core.inputs(positions, rows, system_index, edges, gen, n_update)
        fused = n_update is None or len(self.layers) == 1  # (under DD every rank refreshes)
        if fused:  # no exchange between layers: one region
            whole: torch.Tensor = core.fn("energies", mpnn_energies)(
                self, *t.tensors(cell), t.owned_receivers, t.owned
            )
            energies = whole[:n] if n_update is None else whole[:n_update]
        else:  # embed + first layer | refresh | middle layers, each refreshed | last + readout
            edges_of = (t.owned_receivers, t.senders, t.edge_mask, t.owned)
            radial, h = core.fn("first", mpnn_first)(
                self, *t.tensors(cell), t.owned_receivers, t.owned
            )
            for layer in list(self.layers)[1:-1]:
                h = torch.cat([refresh_neighbors(h[:n]), h[n:]])
                h = core.fn("layer", mpnn_layer)(layer, h, radial, *edges_of)
            h = torch.cat([refresh_neighbors(h[:n]), h[n:]])
            energies = core.fn("last", mpnn_last)(self, h, radial, *edges_of)[:n_update]
        owned = n if n_update is None else n_update
        if owned < n:  # ghost rows: their species offset only
            ghost = self.species_energy.index_select(0, rows[owned:])
            energies = torch.cat([energies, ghost])
        return energies

    def _owned_rows(self, mode: ScatterMode) -> int | None:
        """Rows that receive messages under the live DD context in the refresh mode
        (``ScatterMode.LOCAL``: owned receivers, ghost rows refreshed); ``None``
        in the other modes or outside DD."""
        layout = current_dd_context().layout
        if layout is None or mode is not ScatterMode.LOCAL:
            return None
        return int(layout.n_owned)

    # ----------------------------------------------------------------- forward
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
            One or several systems; its dtype must be the model's.
        n_receivers:
            Domain-decomposition seams (a, b): keep only edges whose receiver is
            one of the first ``n_receivers`` rows, and count only those rows'
            energies (forces still come back on every row). Under a live DD
            context it defaults to the layout's ``n_owned``.
        compute_stress:
            Also return ``virial`` and ``stress``, shape ``(n_systems, 3, 3)``.
        create_graph:
            Keep the autograd graph of the outputs (to train on forces).

        Returns
        -------
        ModelOutputs
            ``energy``, ``forces``, ``atom_energies`` and, with
            ``compute_stress``, ``virial`` and ``stress``. Under a live DD
            context: ``energy`` is the global per-system energy on every rank,
            ``forces`` are this rank's ``-dE/dx`` on every padded row (fold
            ghost rows into their owners), ``virial`` and ``stress`` are this
            rank's partials (sum them over ranks), ``atom_energies`` are exact on
            owned rows (ghost rows hold their species energy only).

        Raises
        ------
        ValidationError
            On malformed inputs, a dtype mismatch or unknown species. Under a
            live DD context, on the first call with a new halo topology the
            check is shared by every rank of the context's group, so all ranks
            raise together.

        Notes
        -----
        **Collective** under a live DD context: one refresh per layer but the
        last and one all-reduce of the energy in the forward, one reverse
        exchange per refresh in the backward, all over the context's group;
        every rank calls it at the same point. No communication otherwise.
        """
        edges: EdgeList | PaddedEdges
        if n_receivers is None and self._device_path(batch):
            n_receivers, rows, edges = self._device_inputs(batch)
        else:
            self._pending = None
            n_receivers, rows, edges = self._edges(
                batch, n_receivers, lambda: self._dtype_problem(batch)
            )
        return self._outputs_by_autograd(
            batch,
            rows,
            edges,
            n_receivers,
            compute_stress=compute_stress,
            energy_scope=energy_scope(self.distribution_spec()),
            create_graph=create_graph,
        )

    def distributed_setup(self, ctx: object) -> None:
        """Forget cached neighbours (both lists) and checks when a DD scope opens."""
        super().distributed_setup(ctx)
        self.device_edges.reset()
        self._pending = None

    def distributed_teardown(self) -> None:
        """Forget cached neighbours (both lists) and checks when the scope closes."""
        super().distributed_teardown()
        self.device_edges.reset()
        self._pending = None

    # ------------------------------------------------------- the device path
    def _device_path(self, batch: Batch) -> bool:
        """Whether a call on ``batch`` takes its edges from :attr:`device_edges`:
        where :attr:`splits_step` allows it, with ``"device"`` always, with
        ``"auto"`` on CUDA with a skin (plain tensors only)."""
        if not self.splits_step or type(batch.positions) is not torch.Tensor:
            return False
        if self._config.neighbors == "device":
            return True
        return batch.positions.device.type == "cuda" and self._config.skin > 0.0

    def _species_problem(self, batch: Batch) -> str | None:
        z = batch.atomic_numbers
        if self._species_seen.same(z):  # (checking is a host read: only a new tensor)
            return None
        problem = check_species(self.species_rows, z)
        if problem is None:
            self._species_seen.remember(z)
        return problem

    def _device_inputs(self, batch: Batch) -> tuple[int | None, torch.Tensor, PaddedEdges]:
        """:meth:`_edges` for the device path: checked inputs, species rows and
        the device edges (those of :meth:`begin_step` when it ran for this step
        on the same topology). **Collective** under a live DD context on a new
        halo topology, as :meth:`_edges`."""
        n_receivers, topology = prepare_rows(
            self._dd_gate,
            batch,
            None,
            lambda: self._dtype_problem(batch),
            lambda: self._species_problem(batch),
        )
        rows = self.species_rows.index_select(0, batch.atomic_numbers)
        edges, self._pending = self._pending, None
        if edges is None or self._pending_topology != topology:  # (another plan's rows)
            edges = self._search(batch, n_receivers, topology)
        return n_receivers, rows, edges

    def _search(self, batch: Batch, n_receivers: int | None, topology: object) -> PaddedEdges:
        """The device edges of ``batch``; under DD (``n_receivers`` given) a search
        error is recorded and poisons the energies instead of raising here alone
        (the runtime's shared finite check raises on every rank)."""
        self.device_edges.defer_errors = n_receivers is not None
        return self.device_edges(
            batch.positions, batch.cell, batch.pbc, batch.system_index,
            n_receivers=n_receivers, topology=topology,
        )  # fmt: skip

    def _steady_topology(self) -> tuple[bool, int | None, object]:
        """``(steady, n_receivers, topology)`` for a call outside :meth:`forward`:
        under a DD context whose topology the forward has not checked yet, not
        steady (the forward checks it first, collectively)."""
        ctx = current_dd_context()
        if ctx.layout is None:
            return True, None, None
        if self._dd_gate.is_new(ctx):
            return False, None, None
        return True, int(ctx.layout.n_owned), self._dd_gate.generation

    def graph_key(self, batch: Batch) -> Hashable | None:
        """A token for a CUDA-graph capture of :meth:`forward` (see
        ``BaseModelMixin.graph_key``): only the device path is capturable, and
        only inside a step split at :meth:`begin_step` / :meth:`take_verdict`
        (an overflow of the edge buffers must be seen before the forces are
        used; under the halo the runtime folds :meth:`overflow_flag` into its
        own decision). None before the first call."""
        if not self._device_path(batch) or self.device_edges.capacity == 0:
            return None
        if not self._species_seen.same(batch.atomic_numbers):
            return None
        steady, _, topology = self._steady_topology()
        if not steady:
            return None
        core = None if self._core is None else id(self._core)
        return ("reference-mpnn", id(self), self.device_edges.graph_token, core, topology)

    @property
    def splits_step(self) -> bool:
        """Whether a step through this model in the current context is split at
        :meth:`begin_step` / :meth:`take_verdict` (the step module cuts a captured
        step there, ``nvdd.dynamics._step.steady_segments``, and
        ``nvdd.dynamics.StepGraphs`` replays the pieces; the model never
        captures; under the halo the runtime then searches in the head of every step):
        when the context's calls may take the device edges. Decided by the
        configuration and the layout's kind, never by a rank's rows, so every
        rank answers alike (the runtime's collectives depend on it): not with
        ``"verlet"``, not under a graph-partition layout, and under a halo
        layout only with ``"device"`` (``"auto"`` keeps the Verlet list there:
        every halo rebuild re-sizes and recaptures, measured slower with
        frequent rebuilds, docs/design.md)."""
        mode = self._config.neighbors
        layout = current_dd_context().layout
        if mode == "verlet" or (
            layout is not None and not getattr(layout, "explicit_images", True)
        ):
            return False
        return mode == "device" or layout is None

    def begin_step(self, batch: Batch) -> None:
        """Search this step's edges on the device (capturable; no host read); the
        next :meth:`forward` uses them. Local (no communication); under a DD
        context ``batch`` is the padded rows with their ghosts current."""
        self._pending = None
        steady, n_receivers, topology = self._steady_topology()
        self._pending_topology = topology
        if steady and self._device_path(batch):
            self._pending = self._search(batch, n_receivers, topology)

    def overflow_flag(self) -> torch.Tensor | None:
        """Int32 ``(1,)`` on the device: whether the edges of :meth:`begin_step`
        overflowed (no host read); None when it searched nothing."""
        return None if self._pending is None else self.device_edges.overflow_flag()

    def take_verdict(self, batch: Batch) -> bool:
        """Whether the edges of :meth:`begin_step` fitted their buffers (one host
        read). False: the buffers grow, and the next forward searches again
        (the step must then run eagerly). Raises
        :class:`~nvdd.core.ValidationError` on a non-finite position or a
        singular cell, as a forward would."""
        try:
            fits = self.device_edges.verdict()
        except BaseException:
            self._pending = None
            raise
        if not fits:
            self._pending = None
        return fits

    def _dtype_problem(self, batch: Batch) -> str | None:
        if batch.dtype == self.dtype:
            return None
        return (
            f"batch is {batch.dtype} but the model's parameters are {self.dtype}; "
            f"convert one of them (model.to({batch.dtype}) or batch.to(dtype={self.dtype}))"
        )
