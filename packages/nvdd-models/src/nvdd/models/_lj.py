"""`LennardJones`: a pair potential over the package's neighbour lists.

Energy bookkeeping on a *full* (both directions) edge list: each directed edge
``(i, j)`` gives half its pair energy to its receiver ``i``, so
``atom_energies[i] = 1/2 sum_j phi(r_ij)`` and the system energy counts every
pair once.

Direct forces are written to make ``forces = -dE_local/dx`` hold on every row
also when the edge list keeps only owned receivers (domain-decomposition seam
(c)): an edge carries ``phi/2`` into ``E_local``, so it pushes ``-d(phi/2)/dx``
onto BOTH its receiver and its sender. On a full list each pair appears twice
and the halves add up to the usual pair force.

Per-atom virials (``LJConfig.atom_virials``, off by default) follow the
energies: each directed edge gives half its pair virial,
``g r (x) r / 2`` with ``g = -phi'(r) / r``, to its receiver, so
``atom_virials[i] = 1/2 sum_j g_ij r_ij (x) r_ij`` (the pair virial split half
and half between its two atoms) and ``sum_i atom_virials[i] = virial`` (ASE's
sign: ``virial = -dE/d strain``, ``stress = -virial / V``). With owned
receivers only (seam (c)) they are exact on owned rows and zero on ghost rows,
like ``atom_energies``: nothing to fold (``SPEC_LJ_HALO``: per node, owned only).

Two implementations give the same numbers (``LJConfig.backend``): the torch
reference (a vectorised pair loop over the vesin Verlet list, any device,
tensor subclasses) and the Warp path (:class:`WarpLJ`, below: the package's own LJ
kernel over a device neighbour list, CPU and CUDA, no host synchronisation
in a step that rebuilds nothing), the default wherever it applies.
nvalchemi-toolkit-ops ships a Warp LJ kernel, but it does not fit: one
epsilon/sigma for all pairs (no per-species tables), no energy shift, a
full-list mode that updates only the receiver (wrong once ghost receivers are
dropped), and a CSR kernel that reads one cell for the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from nvdd.core import Batch, ModelOutputs, TensorMemo, ValidationError, sum_by_system
from nvdd.models._cell_kernels import MAX_SYSTEMS
from nvdd.models._checks import fail
from nvdd.models._compiled import CompiledCore, lj_direct, lj_direct_owned, lj_energies
from nvdd.models._dd import HaloModelMixin, InputGate, energy_scope, halo_spec, prepare_rows
from nvdd.models._device_neighbors import DeviceVerletList, NeighborMatrix
from nvdd.models._lj_config import ForceMode, LJBackend, LJConfig
from nvdd.models._lj_kernels import lj_atom_virial_kernel, lj_kernel
from nvdd.models._neighbors import EdgeList
from nvdd.models._reduce import stress_from_virial, system_energy, system_outer_sum
from nvdd.models._species import check_species
from nvdd.models._verlet import VerletList
from nvdd.models._warp import Kernel, declare_overloads
from nvdd.shardtensor import Scope, current_dd_context
from nvdd.spec import (
    SPEC_LJ_HALO,
    CompilePolicy,
    DistributionSpec,
    MLIPSpec,
    OutputKind,
    OutputSpec,
    Reduce,
    StrategyKind,
)

__all__ = ["LJKernelOutputs", "LennardJones", "WarpLJ", "virial_by_system", "voigt_to_matrices"]

#: ``Scope.LOCAL``: the energy of ``SPEC_LJ_HALO`` is a per-rank partial.
_ENERGY_SCOPE: Scope = energy_scope(SPEC_LJ_HALO)
#: The graph-partition spec: the same outputs and forces, index-block storage.
SPEC_LJ_GRAPH = SPEC_LJ_HALO | MLIPSpec(
    name="SPEC_LJ_HALO | graph partition",
    distribution=DistributionSpec(storage=StrategyKind.GRAPH_PARTITION),
)
#: The spec of direct forces (``ForceMode.DIRECT``, the default): ``SPEC_LJ_HALO``
#: with forces exact on owned rows. Each rank evaluates every pair with an owned
#: end, so the model puts the whole pair force on each owned end and nothing on
#: ghost rows (``forward(ghost_forces=False)``): the runtime skips the fold and its
#: reverse exchange (LAMMPS's ``newton off``, at no extra pair terms; record 0093).
SPEC_LJ_OWNED = SPEC_LJ_HALO.replace(
    name="SPEC_LJ_HALO | owned forces",
    outputs={**SPEC_LJ_HALO.outputs, "forces": OutputSpec(OutputKind.PER_NODE, Reduce.OWNED_ONLY)},
)
#: :data:`SPEC_LJ_OWNED` with index-block storage (the graph partition).
SPEC_LJ_OWNED_GRAPH = SPEC_LJ_OWNED | MLIPSpec(
    name="SPEC_LJ_HALO | owned forces | graph partition",
    distribution=DistributionSpec(storage=StrategyKind.GRAPH_PARTITION),
)


class LennardJones(HaloModelMixin, torch.nn.Module):
    """Lennard-Jones with per-species parameters, an optional energy shift and a cutoff.

    Runs unchanged on one process and, inside a live DD context, on one rank's
    ``[owned | ghost]`` rows (see :meth:`forward` and :meth:`distribution_spec`).

    Parameters
    ----------
    config:
        Parameters, mixing rule, cutoff, force mode and Verlet skin.

    Attributes
    ----------
    neighbors:
        The torch backend's :class:`VerletList` (cutoff ``config.cutoff``, skin
        ``config.skin``).
    device_neighbors:
        The Warp backend's device neighbour list (same cutoff and skin).

    Notes
    -----
    :meth:`distribution_spec` for ``StrategyKind.HALO``: with direct forces
    (``ForceMode.DIRECT``, the default) ``SPEC_LJ_OWNED``, which is
    ``SPEC_LJ_HALO`` with forces exact on owned rows: each rank evaluates every
    pair with an owned end, so the whole pair force goes to each owned end and
    ghost rows get none; the runtime has nothing to fold and no reverse
    exchange to make. In ``ForceMode.AUTOGRAD`` (the model differentiates its
    own copy of the positions) ``SPEC_LJ_HALO``: ``-dE_local/dx`` on every
    padded row, folded into owners by the runtime. In both, energy, virial and
    stress are per-rank partials (``Reduce.ALL_REDUCE``), atom energies (and,
    with ``LJConfig.atom_virials``, atom virials) exact on owned rows.
    ``StrategyKind.GRAPH_PARTITION`` returns the same spec with index-block
    storage: rows are this rank's atoms plus those within reach, with the real
    cell and pbc.

    Examples
    --------
    >>> model = LennardJones(LJConfig(cutoff=8.5, species={18: (0.0104, 3.40)}))
    >>> out = model(batch)  # energy, forces, atom_energies, virial, stress
    >>> argon = {18: (0.0104, 3.40)}
    >>> per_atom = LennardJones(LJConfig(cutoff=8.5, species=argon, atom_virials=True))
    >>> per_atom(batch)["atom_virials"].sum(0)  # == out["virial"][0] (one system)
    """

    _halo_preset = SPEC_LJ_HALO
    _graph_preset = SPEC_LJ_GRAPH
    epsilon_table: torch.Tensor
    sigma_table: torch.Tensor
    shift_table: torch.Tensor

    def __init__(self, config: LJConfig) -> None:
        super().__init__()
        self._config = config
        rows, eps, sig = config.tables()
        self.register_buffer("species_rows", rows)
        self.register_buffer("epsilon_table", eps)
        self.register_buffer("sigma_table", sig)
        if config.shift_energy:
            s6 = (sig / config.cutoff) ** 6
            shift = 4.0 * eps * (s6 * s6 - s6)
        else:
            shift = torch.zeros_like(eps)
        self.register_buffer("shift_table", shift)
        self.neighbors = VerletList(config.cutoff, config.skin)
        self._warp = WarpLJ(config.cutoff, config.skin, half=config.half_list)
        self._dd_gate = InputGate()
        self._core: CompiledCore | None = None

    @property
    def device_neighbors(self) -> DeviceVerletList:
        """The Warp backend's neighbour list."""
        return self._warp.neighbors

    def reset_neighbors(self) -> None:
        """Forget both neighbour lists: the next call searches afresh.

        Rows that change without a new DD ``topology_version`` (a runtime that
        migrates atoms and reuses the version) must call this; a new version,
        a new layout object or a new number of rows is detected on its own.
        """
        self.neighbors.reset()
        self._warp.reset()

    def distributed_setup(self, ctx: object) -> None:
        """Forget cached neighbours and checks when a distributed scope opens."""
        super().distributed_setup(ctx)
        self._warp.reset()

    def distributed_teardown(self) -> None:
        """Forget cached neighbours and checks when the distributed scope closes."""
        super().distributed_teardown()
        self._warp.reset()

    def distribution_spec(self, strategy: StrategyKind | str = StrategyKind.HALO) -> MLIPSpec:
        """``SPEC_LJ_OWNED`` with direct forces, ``SPEC_LJ_HALO`` with autograd
        forces (a ``spec=`` set on the model wins); see the class notes.

        Raises
        ------
        ConfigurationError
            For a value that is not a strategy.
        """
        if self._spec is None and self._owned_forces():
            graph = None if self._graph_preset is None else SPEC_LJ_OWNED_GRAPH
            return halo_spec(self, strategy, SPEC_LJ_OWNED, graph)
        return super().distribution_spec(strategy)

    def _owned_forces(self) -> bool:
        """Whether forces under DD are complete on owned rows and zero on ghost
        rows (what the model's spec promises), not ``-dE_local/dx`` to fold."""
        if self._config.force_mode is not ForceMode.DIRECT:
            return False
        spec = self._spec
        return spec is None or spec.output("forces").effective_reduce() is Reduce.OWNED_ONLY

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> LennardJones:
        # .to() / .double() / .cuda(): the Warp tables are recomputed from the buffers.
        self._warp.forget_tables()
        return super()._apply(fn, recurse)  # type: ignore[no-untyped-call,no-any-return]

    @property
    def config(self) -> LJConfig:
        """The configuration the model was built from."""
        return self._config

    @property
    def cutoff(self) -> float:
        """Interaction cutoff (Angstrom)."""
        return self._config.cutoff

    def extra_repr(self) -> str:
        """The module repr's summary: the whole configuration."""
        c = self._config
        return (
            f"cutoff={c.cutoff}, species={dict(c.species)}, default="
            f"{(c.epsilon, c.sigma)}, mixing={c.mixing.value}, shift_energy={c.shift_energy}, "
            f"force_mode={c.force_mode.value}, skin={c.skin}, backend={c.backend.value}, "
            f"half_list={c.half_list}, atom_virials={c.atom_virials}"
        )

    # ----------------------------------------------------------------- physics
    def pair_terms(
        self, r_vec: torch.Tensor, row_i: torch.Tensor, row_j: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pair energy ``phi(r)`` and ``g = -phi'(r) / r`` of every edge.

        Parameters
        ----------
        r_vec:
            Edge vectors, shape ``(n_edges, 3)``.
        row_i, row_j:
            Species rows of receivers and senders, int64 shape ``(n_edges,)``.

        Returns
        -------
        (phi, g)
            Both shape ``(n_edges,)``; the force on the sender is ``g * r_vec``.
        """
        dtype = r_vec.dtype
        flat = row_i * self.epsilon_table.shape[0] + row_j
        eps = self.epsilon_table.to(dtype).reshape(-1).index_select(0, flat)
        sig = self.sigma_table.to(dtype).reshape(-1).index_select(0, flat)
        shift = self.shift_table.to(dtype).reshape(-1).index_select(0, flat)
        r2 = (r_vec * r_vec).sum(dim=1)
        s2 = sig * sig / r2
        s6 = s2 * s2 * s2
        s12 = s6 * s6
        phi = 4.0 * eps * (s12 - s6) - shift
        g = 24.0 * eps * (2.0 * s12 - s6) / r2
        return phi, g

    def atom_energies(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        rows: torch.Tensor,
        system_index: torch.Tensor,
        edges: EdgeList,
    ) -> torch.Tensor:
        """Per-atom energies ``1/2 sum_j phi(r_ij)`` over the receivers' edges.

        Differentiable in ``positions`` and ``cell``; shape ``(n_atoms,)``.
        ``rows`` are the species rows of the atoms, int64 ``(n_atoms,)``.
        """
        if self._core is not None:
            t = self._core.inputs(positions, rows, system_index, edges, self._dd_gate.generation)
            energies: torch.Tensor = self._core.fn("energies", lj_energies)(self, *t.tensors(cell))
            return energies[: t.n_atoms]
        r_vec = edges.vectors(positions, cell, system_index)
        phi, _ = self.pair_terms(
            r_vec, rows.index_select(0, edges.receivers), rows.index_select(0, edges.senders)
        )
        out = torch.zeros_like(positions[:, 0])
        return out.index_add(0, edges.receivers, 0.5 * phi)

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        batch: Batch,
        *,
        n_receivers: int | None = None,
        compute_stress: bool = True,
        ghost_forces: bool | None = None,
    ) -> ModelOutputs:
        """Energy, forces, atom energies, virial and stress of every system.

        Parameters
        ----------
        batch:
            One or several systems (``system_index``, per-system cell and pbc).
        n_receivers:
            Domain-decomposition seam (b): count only edges whose receiver is one
            of the first ``n_receivers`` rows (the owned rows of a
            ``[owned | ghost]`` layout, searched with open boundaries). Under a
            live DD context it defaults to the layout's ``n_owned``.
        compute_stress:
            Also return ``virial`` and ``stress`` (shape ``(n_systems, 3, 3)``).
        ghost_forces:
            Where the forces of rows beyond ``n_receivers`` go. None (default):
            what :meth:`distribution_spec` promises (False with direct forces,
            True with autograd forces). True: ``forces`` are ``-dE_local/dx``
            on every row, to be folded into owners. False (direct forces only):
            the complete force on every counted (owned) row and zero on the
            others, so the runtime skips the fold: each rank evaluates its
            owned-ghost pairs anyway, so this costs no extra pair terms (the
            rank owning the other end computes that end's force). Either is
            exact after a fold (the ghost rows of False are zero).

        Returns
        -------
        ModelOutputs
            ``energy`` ``(n_systems,)``, ``forces`` ``(n_atoms, 3)``,
            ``atom_energies`` ``(n_atoms,)``, and ``virial`` and ``stress``
            ``(n_systems, 3, 3)`` (ASE sign: ``stress = (1/V) dE/d strain``).
            With ``LJConfig.atom_virials``: also ``atom_virials``
            ``(n_atoms, 3, 3)`` (whatever ``compute_stress`` says), summing to
            ``virial`` (see the module notes); absent otherwise.
            Under a live DD context (``nvdd.shardtensor.current_dd_context()``
            with a layout): rows are the layout's ``[owned | ghost]`` rows,
            ``forces`` as ``ghost_forces`` says (by default complete on owned
            rows and zero on ghost rows with direct forces; ``-dE_local/dx`` on
            every row, to fold, with autograd forces), ``energy``, ``virial`` and ``stress`` are this rank's
            partials (sum them over ranks), ``atom_energies`` (and
            ``atom_virials``) are exact on owned rows and zero on ghost rows.

        Raises
        ------
        ValidationError
            On malformed inputs or unknown species. Under a live DD context,
            on the first call with a new halo topology the check is shared by
            every rank of the context's group (**Collective**: one all-reduce of
            a flag), so all ranks raise together; no collective otherwise.
            Warp backend: also on an error flag of the device neighbour search
            (NaN positions, a singular cell): outputs are NaN from the call that
            met it; single process, the error is raised at the end of that call
            (CPU) or at the next call (CUDA); under DD it is raised on every rank
            together at the next new topology.
        """
        if ghost_forces is None:
            ghost_forces = not self._owned_forces()
        elif not ghost_forces and self._config.force_mode is not ForceMode.DIRECT:
            fail(
                "ghost_forces=False needs force_mode=ForceMode.DIRECT (autograd gives -dE_local/dx)"
            )
        if self._warp_applies(batch):
            return self._forward_warp(batch, n_receivers, compute_stress, ghost_forces)
        n_receivers, rows, edges = self._edges(batch, n_receivers, lambda: None)
        if self._config.force_mode is ForceMode.AUTOGRAD:
            out = self._outputs_by_autograd(
                batch,
                rows,
                edges,
                n_receivers,
                compute_stress=compute_stress,
                energy_scope=_ENERGY_SCOPE,
            )
            if self._config.atom_virials:
                out["atom_virials"] = self._atom_virials(batch, rows, edges)
            return out
        with torch.no_grad():
            return self._direct(batch, rows, edges, n_receivers, compute_stress, ghost_forces)

    def compile_forward(self, policy: CompilePolicy | None) -> bool:
        """Compile the pair kernel under ``policy`` (see ``BaseModelMixin.compile_forward``):
        one collective-free region of the torch path (edge vectors, pair terms,
        scatters, virial in the direct mode; per-atom energies in the autograd
        mode). ``None``: back to eager.

        With direct forces and ``LJBackend.AUTO`` / ``WARP`` the model runs its Warp
        kernels, which are compiled code already: nothing is compiled, and True is
        returned so that the runtime does not ``torch.compile`` the Warp launches
        either. ``LJBackend.TORCH`` (or autograd forces) compiles the torch path.
        """
        if self._core is not None:
            self._core.release()
        native = (
            self._config.backend is not LJBackend.TORCH
            and self._config.force_mode is ForceMode.DIRECT
        )
        self._core = None if policy is None or native else CompiledCore(policy, "lj", self)
        return policy is not None

    def _direct(
        self,
        batch: Batch,
        rows: torch.Tensor,
        edges: EdgeList,
        n_counted: int | None,
        compute_stress: bool,
        ghost_forces: bool = True,
    ) -> ModelOutputs:
        pos, cell, si = batch.positions.detach(), batch.cell.detach(), batch.system_index
        if self._core is not None:
            return self._compiled_direct(
                self._core, batch, rows, edges, n_counted, compute_stress, ghost_forces
            )
        r_vec = edges.vectors(pos, cell, si)
        i, j = edges.receivers, edges.senders
        phi, g = self.pair_terms(r_vec, rows.index_select(0, i), rows.index_select(0, j))
        atom_energies = torch.zeros_like(pos[:, 0]).index_add(0, i, 0.5 * phi)
        half = (0.5 * g).unsqueeze(1) * r_vec  # -d(phi/2)/dx_j; the receiver gets minus it
        if ghost_forces:
            forces = torch.zeros_like(pos).index_add(0, j, half).index_add(0, i, -half)
        else:  # every edge into a kept (owned) receiver: the whole pair force on it
            forces = torch.zeros_like(pos).index_add(0, i, -2.0 * half)
        out: ModelOutputs = {
            "energy": system_energy(atom_energies, si, batch.n_systems, n_counted, _ENERGY_SCOPE),
            "forces": forces,
            "atom_energies": atom_energies,
        }
        if compute_stress:
            # -d(phi/2)/d strain of an edge is half (x) r_vec
            virial = system_outer_sum(half, r_vec, si.index_select(0, i), batch.n_systems)
            out["virial"] = virial
            out["stress"] = stress_from_virial(virial, cell)
        if self._config.atom_virials:
            out["atom_virials"] = _receiver_outer_sum(half, r_vec, i, pos.shape[0])
        return out

    def _atom_virials(self, batch: Batch, rows: torch.Tensor, edges: EdgeList) -> torch.Tensor:
        """``atom_virials`` ``(n_atoms, 3, 3)`` by a pair pass of their own (the
        autograd and compiled paths, whose outputs do not expose the pair terms)."""
        with torch.no_grad():
            pos, cell = batch.positions.detach(), batch.cell.detach()
            r_vec = edges.vectors(pos, cell, batch.system_index)
            i, j = edges.receivers, edges.senders
            _, g = self.pair_terms(r_vec, rows.index_select(0, i), rows.index_select(0, j))
            half = (0.5 * g).unsqueeze(1) * r_vec
            return _receiver_outer_sum(half, r_vec, i, pos.shape[0])

    # ------------------------------------------------------------ Warp path
    def graph_key(self, batch: Batch) -> Hashable | None:
        """A token for a CUDA-graph capture of :meth:`forward` (see
        ``BaseModelMixin.graph_key``): only the Warp path is capturable (its
        neighbour list decides on the device), in one process or under a DD
        context (on the padded rows; a new halo topology rebuilds the list on
        the host, which changes the token); the token follows the list's
        buffers and the parameter tables."""
        if self._core is not None:
            return None
        try:
            if not self._warp_applies(batch):
                return None
        except ValidationError:
            return None
        tables = tuple(id(t) for found in self._warp._tables.values() for t in found)
        return ("lennard-jones", id(self), self._warp.neighbors.graph_token, tables)

    def _warp_applies(self, batch: Batch) -> bool:
        """Whether this call takes the Warp path (a ValidationError for an explicit
        ``LJBackend.WARP`` that does not apply)."""
        backend = self._config.backend
        if backend is LJBackend.TORCH or self._config.force_mode is not ForceMode.DIRECT:
            return False
        pos = batch.positions
        problem = None
        if type(pos) is not torch.Tensor:
            problem = f"positions are a {type(pos).__name__}, not a plain tensor"
        elif pos.dtype not in (torch.float32, torch.float64):
            problem = f"positions are {pos.dtype}, not float32 or float64"
        elif pos.device.type not in ("cpu", "cuda"):
            problem = f"positions are on {pos.device}, not CPU or CUDA"
        elif batch.n_systems >= MAX_SYSTEMS:
            problem = f"{batch.n_systems} systems, more than {MAX_SYSTEMS - 1}"
        if problem is not None and backend is LJBackend.WARP:
            fail(f"LennardJones backend='warp' does not apply: {problem} (use backend='auto')")
        return problem is None

    def _forward_warp(
        self, batch: Batch, n_receivers: int | None, compute_stress: bool, ghost_forces: bool
    ) -> ModelOutputs:
        warp, neighbors = self._warp, self._warp.neighbors
        distributed = current_dd_context().layout is not None
        neighbors.defer_errors = distributed
        # under DD a rebuild step has the plan and the fold to queue behind the
        # list build: its flags come back asynchronously (errors are deferred anyway)
        neighbors.wait_for_host_builds = not distributed

        def data_check() -> str | None:
            # a deferred neighbour error (under DD) is shared here, at a new topology
            pending, neighbors.pending_error = neighbors.pending_error, None
            if pending is not None:
                return pending
            if warp.knows(batch.atomic_numbers):
                return None
            return check_species(self.species_rows, batch.atomic_numbers)

        checked = self._dd_gate.generation
        n_receivers, topology = prepare_rows(
            self._dd_gate, batch, n_receivers, lambda: None, data_check
        )
        types = warp.species_rows(self.species_rows, batch.atomic_numbers)
        pos = batch.positions.detach()
        matrix = neighbors(
            pos,
            batch.cell,
            batch.pbc,
            batch.system_index,
            n_receivers=n_receivers,
            topology=topology,
            # a new DD topology had its system indices checked just now (one read fewer)
            validated=self._dd_gate.generation != checked,
            checked=distributed,  # (prepare_rows checked the geometry under DD)
        )
        tables = warp.tables(
            self.epsilon_table, self.sigma_table, self.shift_table, pos.dtype, pos.device
        )
        n_types = int(self.epsilon_table.shape[0])
        per_atom = self._config.atom_virials
        forces, atom_energies, rows = warp(
            pos, batch.cell, batch.system_index, types, n_types, tables, matrix,
            compute_virial=compute_stress, ghost_forces=ghost_forces, atom_virials=per_atom,
        )  # fmt: skip
        si, n_sys = batch.system_index, batch.n_systems
        out: ModelOutputs = {
            "energy": system_energy(atom_energies, si, n_sys, n_receivers, _ENERGY_SCOPE),
            "forces": forces,
            "atom_energies": atom_energies,
        }
        if rows is not None and compute_stress:
            virial = virial_by_system(rows, si, n_sys)  # (per-atom rows sum the same)
            out["virial"] = virial
            out["stress"] = stress_from_virial(virial, batch.cell.detach())
        if rows is not None and per_atom:
            out["atom_virials"] = voigt_to_matrices(rows)
        return out

    def _compiled_direct(
        self,
        core: CompiledCore,
        batch: Batch,
        rows: torch.Tensor,
        edges: EdgeList,
        n_counted: int | None,
        compute_stress: bool,
        ghost_forces: bool = True,
    ) -> ModelOutputs:
        """:meth:`_direct` through the compiled region (same values). **Collective**
        under a live DD context at a new halo topology (the capacities' all-reduce)."""
        pos, cell, si = batch.positions.detach(), batch.cell.detach(), batch.system_index
        t = core.inputs(pos, rows, si, edges, self._dd_gate.generation)
        key, region = ("direct", lj_direct) if ghost_forces else ("owned", lj_direct_owned)
        atom_e, forces, virial = core.fn(key, region)(self, batch.n_systems, *t.tensors(cell))
        atom_energies = atom_e[: t.n_atoms]
        out: ModelOutputs = {
            "energy": system_energy(atom_energies, si, batch.n_systems, n_counted, _ENERGY_SCOPE),
            "forces": forces[: t.n_atoms],
            "atom_energies": atom_energies,
        }
        if compute_stress:
            out["virial"] = virial
            out["stress"] = stress_from_virial(virial, cell)
        if self._config.atom_virials:
            out["atom_virials"] = self._atom_virials(batch, rows, edges)
        return out


def _receiver_outer_sum(
    a: torch.Tensor, b: torch.Tensor, receivers: torch.Tensor, n_atoms: int
) -> torch.Tensor:
    """``sum_e a_e (x) b_e`` per receiver: ``(n_atoms, 3, 3)`` from ``(n_edges, 3)``."""
    outer = (a.unsqueeze(2) * b.unsqueeze(1)).reshape(-1, 9)
    return a.new_zeros(n_atoms, 9).index_add(0, receivers, outer).reshape(n_atoms, 3, 3)


# ------------------------------------------------------------------ the Warp path
# Per-row kernel outputs over a DeviceVerletList. Host work per call is a
# handful of launches and no device-to-host copy: the species rows of the atoms
# and the parameter tables are cached (by tensor identity and version, and by
# dtype and device), the neighbour list decides on the device whether to
# rebuild, and per-system sums are torch reductions.
#: Voigt column of each entry of the row-major 3x3 virial (columns xx yy zz yz xz xy).
_VOIGT_TO_FULL = (0, 5, 4, 5, 1, 3, 4, 3, 2)
_VOIGT_INDEX: dict[torch.device, torch.Tensor] = {}

LJKernelOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


class WarpLJ:
    """Species rows, parameter tables and the device neighbour list of one model.

    Parameters
    ----------
    cutoff:
        Interaction cutoff (Angstrom).
    skin:
        Verlet skin of the device list.
    half:
        Half (one direction per pair, atomics) or full (gather) neighbour list.
    """

    def __init__(self, cutoff: float, skin: float, *, half: bool = True) -> None:
        self.cutoff = float(cutoff)
        self.neighbors = DeviceVerletList(cutoff, skin, half=half)
        self._kernels()
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, ...]] = {}
        self._seen_numbers = TensorMemo()
        self._types: torch.Tensor | None = None

    def _kernels(self) -> None:
        # each declares its float overloads before its first launch (not per call)
        self._kernel = Kernel(
            lj_kernel, floats=(8,), prepare=lambda: declare_overloads(self._kernel)
        )
        self._atom_kernel = Kernel(
            lj_atom_virial_kernel, floats=(8,), prepare=lambda: declare_overloads(self._atom_kernel)
        )

    def __getstate__(self) -> dict[str, object]:
        return {"cutoff": self.cutoff, "neighbors": self.neighbors}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.cutoff = float(state["cutoff"])  # type: ignore[arg-type]
        self.neighbors = state["neighbors"]  # type: ignore[assignment]
        self._kernels()
        self._tables = {}
        self._seen_numbers = TensorMemo()
        self._types = None

    def reset(self) -> None:
        """Forget the neighbour list and the cached species rows."""
        self.neighbors.reset()
        self._seen_numbers = TensorMemo()
        self._types = None

    def forget_tables(self) -> None:
        """Drop cached parameter tables (after the model's buffers changed)."""
        self._tables = {}

    def knows(self, atomic_numbers: torch.Tensor) -> bool:
        """Whether ``atomic_numbers`` is the tensor (and version) of the cached rows."""
        return self._types is not None and self._seen_numbers.same(atomic_numbers)

    def species_rows(
        self, species_rows: torch.Tensor, atomic_numbers: torch.Tensor
    ) -> torch.Tensor:
        """Int32 species row of every atom (``species_rows[atomic_numbers]``).

        Cached while ``atomic_numbers`` is the same tensor at the same version;
        the caller checks the species of a tensor it has not seen.
        """
        if self._types is not None and self._seen_numbers.same(atomic_numbers):
            return self._types
        types = species_rows.index_select(0, atomic_numbers).to(torch.int32)
        self._types = types
        self._seen_numbers.remember(atomic_numbers)
        return types

    def tables(
        self,
        epsilon: torch.Tensor,
        sigma: torch.Tensor,
        shift: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, ...]:
        """Flat ``(epsilon, sigma**2, shift)`` tables in ``dtype`` on ``device``."""
        key = (dtype, device)
        found = self._tables.get(key)
        if found is None:
            found = tuple(
                t.to(device=device, dtype=torch.float64).reshape(-1).to(dtype).contiguous()
                for t in (epsilon, sigma * sigma, shift)
            )
            self._tables[key] = found
        return found

    def __call__(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        system_index: torch.Tensor,
        types: torch.Tensor,
        n_types: int,
        tables: tuple[torch.Tensor, ...],
        matrix: NeighborMatrix,
        *,
        compute_virial: bool,
        ghost_forces: bool = True,
        atom_virials: bool = False,
    ) -> LJKernelOutputs:
        """Forces ``(n_atoms, 3)``, atom energies ``(n_atoms,)`` and the per-row
        virial ``(n_rows, 6)`` (Voigt ``xx yy zz yz xz xy``; None unless asked).

        ``ghost_forces=False``: complete forces on owned rows, zero on the others
        (see ``_lj_kernels``). ``atom_virials``: the virial is per atom instead,
        ``(n_atoms, 6)``, exact on owned rows and zero on the others (the
        variant kernel; ``compute_virial`` is implied)."""
        kernel = self._atom_kernel if atom_virials else self._kernel
        compute_virial = compute_virial or atom_virials
        pos = positions.detach()
        dev, dtype = pos.device, pos.dtype
        n = int(pos.shape[0])
        rows = matrix.n_rows
        state = matrix.state
        if matrix.half:
            forces = torch.zeros_like(pos)
            energies = pos.new_zeros(n)
        else:
            forces = torch.empty_like(pos)
            energies = pos.new_empty(n)
        if atom_virials:  # every atom's row, added to (half list) or zero on unlisted rows
            virial = pos.new_zeros(n, 6)
        else:
            virial = pos.new_empty(rows if compute_virial else 1, 6)
        eps, sig2, shift = tables
        kernel(
            rows,
            [pos, system_index, cell.detach(), types, n_types, eps, sig2, shift,
             self.cutoff * self.cutoff, matrix.neighbors, matrix.codes, matrix.counts,
             int(matrix.periodic), matrix.n_receivers, int(matrix.half), int(compute_virial),
             int(ghost_forces), state.row_key, state.row_image, state.grid, state.slot_key,
             state.slot_count, state.slot_end, state.sorted_row, state.sorted_image, state.flags,
             forces, energies, virial],
            dev, dtype,
        )  # fmt: skip
        return forces, energies, virial if compute_virial else None


def virial_by_system(
    rows: torch.Tensor, system_index: torch.Tensor, n_systems: int
) -> torch.Tensor:
    """Sum per-row Voigt virials ``(n_rows, 6)`` into ``(n_systems, 3, 3)``.

    ``system_index`` covers at least the ``n_rows`` first rows.
    """
    if n_systems == 1:  # (sum_by_system's own one-system sum; no index slice)
        return voigt_to_matrices(rows.sum(dim=0, keepdim=True))
    return voigt_to_matrices(sum_by_system(rows, system_index[: rows.shape[0]], n_systems))


def voigt_to_matrices(voigt: torch.Tensor) -> torch.Tensor:
    """Symmetric matrices ``(n, 3, 3)`` of Voigt rows ``(n, 6)`` (``xx yy zz yz xz xy``)."""
    index = _VOIGT_INDEX.get(voigt.device)
    if index is None:  # built once per device: a host-to-device copy can stall the host
        index = torch.tensor(_VOIGT_TO_FULL, device=voigt.device)
        _VOIGT_INDEX[voigt.device] = index
    return voigt.index_select(1, index).reshape(-1, 3, 3)
