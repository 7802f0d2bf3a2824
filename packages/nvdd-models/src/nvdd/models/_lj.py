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

nvalchemi-toolkit-ops ships a Warp LJ kernel, but it does not fit: one
epsilon/sigma for all pairs (no per-species tables), no energy shift, a
full-list mode that updates only the receiver (wrong once ghost receivers are
dropped), and a CSR kernel that reads one cell for the whole batch. The pair
loop here is plain torch over edges (vectorised), on any device.
"""

from __future__ import annotations

import torch

from nvdd.core import Batch, ModelOutputs
from nvdd.models._compiled import CompiledCore, lj_direct, lj_energies
from nvdd.models._dd import HaloModelMixin, InputGate, energy_scope
from nvdd.models._lj_config import ForceMode, LJConfig
from nvdd.models._neighbors import EdgeList
from nvdd.models._reduce import system_energy, system_outer_sum
from nvdd.models._stress import stress_from_virial
from nvdd.models._verlet import VerletList
from nvdd.shardtensor import Scope
from nvdd.spec import SPEC_LJ_HALO, CompilePolicy, DistributionSpec, MLIPSpec, StrategyKind

__all__ = ["LennardJones"]

#: ``Scope.LOCAL``: the energy of ``SPEC_LJ_HALO`` is a per-rank partial.
_ENERGY_SCOPE: Scope = energy_scope(SPEC_LJ_HALO)
#: The graph-partition spec: the same outputs and forces, index-block storage.
SPEC_LJ_GRAPH = SPEC_LJ_HALO | MLIPSpec(
    name="SPEC_LJ_HALO | graph partition",
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
        The model's :class:`VerletList` (cutoff ``config.cutoff``, skin
        ``config.skin``).

    Notes
    -----
    :meth:`distribution_spec` returns ``SPEC_LJ_HALO`` for ``StrategyKind.HALO``:
    direct forces on every padded row (folded into owners by the runtime);
    energy, virial and stress are per-rank partials (``Reduce.ALL_REDUCE``),
    atom energies exact on owned rows. Either force mode fits this spec: in
    ``ForceMode.AUTOGRAD`` the model differentiates its own copy of the
    positions and still returns ``forces``. ``StrategyKind.GRAPH_PARTITION``
    returns the same spec with index-block storage: rows are this rank's atoms
    plus those within reach, with the real cell and pbc.

    Examples
    --------
    >>> model = LennardJones(LJConfig(cutoff=8.5, species={18: (0.0104, 3.40)}))
    >>> out = model(batch)  # energy, forces, atom_energies, virial, stress
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
        self._dd_gate = InputGate()
        self._core: CompiledCore | None = None

    @property
    def config(self) -> LJConfig:
        """The configuration the model was built from."""
        return self._config

    @property
    def cutoff(self) -> float:
        """Interaction cutoff (Angstrom)."""
        return self._config.cutoff

    def extra_repr(self) -> str:
        c = self._config
        return (
            f"cutoff={c.cutoff}, species={dict(c.species)}, default="
            f"{(c.epsilon, c.sigma)}, mixing={c.mixing.value}, shift_energy={c.shift_energy}, "
            f"force_mode={c.force_mode.value}, skin={c.skin}"
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
        self, batch: Batch, *, n_receivers: int | None = None, compute_stress: bool = True
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

        Returns
        -------
        ModelOutputs
            ``energy`` ``(n_systems,)``, ``forces`` ``(n_atoms, 3)``,
            ``atom_energies`` ``(n_atoms,)``, and ``virial`` and ``stress``
            ``(n_systems, 3, 3)`` (ASE sign: ``stress = (1/V) dE/d strain``).
            Under a live DD context (``nvdd.shardtensor.current_dd_context()``
            with a layout): rows are the layout's ``[owned | ghost]`` rows,
            ``forces`` are ``-dE_local/dx`` on every row (fold ghost rows into
            their owners), ``energy``, ``virial`` and ``stress`` are this rank's
            partials (sum them over ranks), ``atom_energies`` are exact on owned
            rows and zero on ghost rows.

        Raises
        ------
        ValidationError
            On malformed inputs or unknown species. Under a live DD context,
            on the first call with a new halo topology the check is shared by
            every rank of the context's group (**Collective**: one all-reduce of
            a flag), so all ranks raise together; no collective otherwise.
        """
        n_receivers, rows, edges = self._edges(batch, n_receivers, lambda: None)
        if self._config.force_mode is ForceMode.AUTOGRAD:
            return self._outputs_by_autograd(
                batch,
                rows,
                edges,
                n_receivers,
                compute_stress=compute_stress,
                energy_scope=_ENERGY_SCOPE,
            )
        with torch.no_grad():
            return self._direct(batch, rows, edges, n_receivers, compute_stress)

    def compile_forward(self, policy: CompilePolicy | None) -> bool:
        """Compile the pair kernel under ``policy`` (see ``BaseModelMixin.compile_forward``):
        one collective-free region (edge vectors, pair terms, scatters, virial in the
        direct mode; per-atom energies in the autograd mode). ``None``: back to eager."""
        if self._core is not None:
            self._core.release()
        self._core = None if policy is None else CompiledCore(policy, "lj", self)
        return self._core is not None

    def _direct(
        self,
        batch: Batch,
        rows: torch.Tensor,
        edges: EdgeList,
        n_counted: int | None,
        compute_stress: bool,
    ) -> ModelOutputs:
        pos, cell, si = batch.positions.detach(), batch.cell.detach(), batch.system_index
        if self._core is not None:
            return self._compiled_direct(self._core, batch, rows, edges, n_counted, compute_stress)
        r_vec = edges.vectors(pos, cell, si)
        i, j = edges.receivers, edges.senders
        phi, g = self.pair_terms(r_vec, rows.index_select(0, i), rows.index_select(0, j))
        atom_energies = torch.zeros_like(pos[:, 0]).index_add(0, i, 0.5 * phi)
        half = (0.5 * g).unsqueeze(1) * r_vec  # -d(phi/2)/dx_j; the receiver gets minus it
        forces = torch.zeros_like(pos).index_add(0, j, half).index_add(0, i, -half)
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
        return out

    def _compiled_direct(
        self,
        core: CompiledCore,
        batch: Batch,
        rows: torch.Tensor,
        edges: EdgeList,
        n_counted: int | None,
        compute_stress: bool,
    ) -> ModelOutputs:
        """:meth:`_direct` through the compiled region (same values). **Collective**
        under a live DD context at a new halo topology (the capacities' all-reduce)."""
        pos, cell, si = batch.positions.detach(), batch.cell.detach(), batch.system_index
        t = core.inputs(pos, rows, si, edges, self._dd_gate.generation)
        atom_e, forces, virial = core.fn("direct", lj_direct)(
            self, batch.n_systems, *t.tensors(cell)
        )
        atom_energies = atom_e[: t.n_atoms]
        out: ModelOutputs = {
            "energy": system_energy(atom_energies, si, batch.n_systems, n_counted, _ENERGY_SCOPE),
            "forces": forces[: t.n_atoms],
            "atom_energies": atom_energies,
        }
        if compute_stress:
            out["virial"] = virial
            out["stress"] = stress_from_virial(virial, cell)
        return out
