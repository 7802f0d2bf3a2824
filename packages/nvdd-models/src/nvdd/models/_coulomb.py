"""What the Ewald and PME models share: charges, real space, corrections, DD wiring.

Energy split (Gaussian charge clouds of width ``1/alpha``; ``k_e`` the Coulomb
constant, :data:`~nvdd.models._coulomb_config.COULOMB_EV_A`):

``E = E_real + E_recip - E_self - E_background``

- ``E_real``: ``k_e q_i q_j erfc(alpha r) / r`` over pairs within the cutoff,
  from the toolkit's Warp kernel on the model's own neighbour list (CSR by
  receiver). Each directed edge carries half its pair energy to its receiver and
  half its pair force onto both ends, so the kernel's forces are
  ``-dE_local/dx`` on every row also when only owned rows receive edges (the
  DD seam of :mod:`nvdd.models._lj`).
- ``E_recip``: the subclass's (Ewald k-sum, PME mesh), computed from the owned
  charges only and combined across ranks by the collective the spec's
  ``global_coupling`` names (:func:`reduce_reciprocal`).
- ``E_self = k_e alpha / sqrt(pi) sum_i q_i^2`` and
  ``E_background = k_e pi Q^2 / (2 alpha^2 V)`` (``Q`` the total charge, zero for
  a neutral system), booked per atom: ``q_i^2`` and ``q_i Q`` shares.

Under a live DD context the rows are ``[owned | ghost]`` with open boundaries
(ghosts are explicit periodic images) and the real cell; per-system energy and
virial are per-rank partials (``Reduce.ALL_REDUCE``), atom energies exact on
owned rows, forces ``-dE_local/dx`` on every row (the runtime folds ghost rows).
"""

from __future__ import annotations

import math

import torch

from nvdd.core import Batch, ModelOutputs, get_rank
from nvdd.models._charges import CHARGES, charges_problem
from nvdd.models._checks import config_error
from nvdd.models._coulomb_config import COULOMB_EV_A
from nvdd.models._dd import HaloModelMixin, InputGate, prepare_rows
from nvdd.models._neighbors import EdgeList
from nvdd.models._nvalchemi import elec, launch_scope, to_wp, warp, wp_types
from nvdd.models._reduce import cell_volume, stress_from_virial, system_energy
from nvdd.models._verlet import VerletList
from nvdd.shardtensor import Scope, current_dd_context, sum_over_ranks
from nvdd.spec import GlobalCoupling, MLIPSpec

__all__ = ["CoulombModel", "Reciprocal", "books_global_terms", "reduce_reciprocal"]

#: ``(atom_energies (n,), forces (n, 3), virial (n_systems, 3, 3), total_charge
#: (n_systems,))``: the owned rows' reciprocal terms in units of ``q^2 / length`` (the
#: caller scales by ``k_e``; energies float64) and every system's total charge (all ranks).
Reciprocal = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def reduce_reciprocal(
    partial: torch.Tensor, coupling: GlobalCoupling, expected: GlobalCoupling, who: str
) -> torch.Tensor:
    """Sum the per-rank reciprocal-space partial sums over the DD context's group.

    **Collective** over ``current_dd_context().group`` (one all-reduce, identity
    backward, every rank calls it at the same point) under a live layout on
    more than one rank; the identity otherwise.

    Parameters
    ----------
    partial:
        This rank's partial sums (structure factors or a charge mesh), any shape.
    coupling:
        The model's spec's ``options.global_coupling``: what the spec says the
        global term is.
    expected:
        The coupling the calling method implements.
    who:
        The model's name, for the error.

    Raises
    ------
    ConfigurationError
        If ``coupling`` is not ``expected`` (the spec and the method disagree:
        a spec without a global term would leave each rank with its own charges).
    """
    if coupling is not expected:
        raise config_error(
            f"{who}: its spec declares global_coupling={coupling.value!r}, but the method needs "
            f"{expected.value!r} (the reciprocal term couples the charges of every rank)"
        )
    ctx = current_dd_context()
    if ctx.layout is None:
        return partial
    return sum_over_ranks(partial, ctx.group)


def _csr(edges: EdgeList, n_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(idx_j, ptr, shifts)`` int32: the edges grouped by receiver (stable order)."""
    order = torch.argsort(edges.receivers, stable=True)
    counts = torch.bincount(edges.receivers, minlength=n_rows)
    ptr = torch.zeros(n_rows + 1, dtype=torch.int64, device=counts.device)
    ptr[1:] = torch.cumsum(counts, 0)
    idx_j = edges.senders.index_select(0, order).to(torch.int32)
    shifts = edges.shifts.index_select(0, order).to(torch.int32)
    return idx_j, ptr.to(torch.int32), shifts


class CoulombModel(HaloModelMixin, torch.nn.Module):
    """Base of :class:`~nvdd.models.Ewald` and :class:`~nvdd.models.ParticleMeshEwald`.

    A subclass sets :attr:`_halo_preset` and :attr:`_coupling` and defines
    :meth:`reciprocal`.
    """

    _coupling: GlobalCoupling

    def __init__(self, cutoff: float, skin: float, alpha: float, spec: MLIPSpec | None) -> None:
        super().__init__()
        self._cutoff = float(cutoff)
        self.alpha = float(alpha)
        self._spec = spec
        self.neighbors = VerletList(self._cutoff, skin)
        self._dd_gate = InputGate()

    @property
    def cutoff(self) -> float:
        """Real-space cutoff (Angstrom): the halo this model needs."""
        return self._cutoff

    # ------------------------------------------------------------ reciprocal
    def reciprocal(
        self,
        positions: torch.Tensor,
        charges: torch.Tensor,
        system_index: torch.Tensor,
        cell: torch.Tensor,
    ) -> Reciprocal:
        """Reciprocal-space energies, forces and virial of the given (owned) rows.

        **Collective** under a live DD context (see :func:`reduce_reciprocal`).
        """
        raise NotImplementedError(f"{type(self).__name__} must define reciprocal")

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """:func:`reduce_reciprocal` with this model's spec (**Collective** under DD)."""
        coupling = self.distribution_spec().options.global_coupling
        return reduce_reciprocal(partial, coupling, self._coupling, type(self).__name__)

    # ----------------------------------------------------------------- forward
    def forward(
        self, batch: Batch, *, n_receivers: int | None = None, compute_stress: bool = True
    ) -> ModelOutputs:
        """Energy, forces, atom energies, virial and stress of every system.

        Parameters
        ----------
        batch:
            Periodic systems with ``atom_extras["charges"]`` (shape ``(n_atoms,)``).
            Under a live DD context: one rank's ``[owned | ghost]`` rows, open
            boundaries, the real cell.
        n_receivers:
            Only under a live DD context, where it defaults to (and must equal)
            the layout's ``n_owned``. Without one it must be None: the
            reciprocal term couples every charge, so a row subset without a
            collective would be wrong.
        compute_stress:
            Also return ``virial`` and ``stress``, shape ``(n_systems, 3, 3)``.

        Returns
        -------
        ModelOutputs
            ``energy`` ``(n_systems,)``, ``forces`` ``(n_atoms, 3)``,
            ``atom_energies`` ``(n_atoms,)`` (zero on ghost rows), and with
            ``compute_stress`` ``virial`` and ``stress``. Under DD the energy,
            virial and stress are this rank's partials.

        Raises
        ------
        ValidationError
            Missing or malformed charges, open boundaries outside DD, a bad
            ``n_receivers``. Under DD, on a new halo topology, raised on every
            rank together.

        Notes
        -----
        **Collective** under a live DD context: the reciprocal term's all-reduce
        (every call) and, on a new halo topology, the input check's flag.
        """
        ctx = current_dd_context()
        if ctx.layout is None and n_receivers is not None:
            raise config_error(
                f"{type(self).__name__}: n_receivers={n_receivers} needs a live DD context (the "
                "reciprocal term couples every charge)"
            )
        n_receivers, topology = prepare_rows(
            self._dd_gate,
            batch,
            n_receivers,
            lambda: None,
            lambda: charges_problem(batch) or self._periodic_problem(batch),
        )
        edges = self.neighbors.for_batch(batch, n_receivers=n_receivers, topology=topology)
        with torch.no_grad():
            return self._outputs(batch, edges, n_receivers, compute_stress)

    def _periodic_problem(self, batch: Batch) -> str | None:
        if current_dd_context().layout is not None:
            return None  # open boundaries by construction; the cell is the real one
        if not bool(batch.pbc.all()):
            return (
                f"{type(self).__name__} needs periodic systems (pbc all True), got pbc "
                f"{batch.pbc.tolist()}"
            )
        return None

    def _outputs(
        self, batch: Batch, edges: EdgeList, n_owned: int | None, compute_stress: bool
    ) -> ModelOutputs:
        pos, cell, si = batch.positions.detach(), batch.cell.detach(), batch.system_index
        q = batch.atom_extras[CHARGES].detach()
        n_rows, n_sys = pos.shape[0], batch.n_systems
        n = n_rows if n_owned is None else n_owned
        e_real, f_real, w_real = self._real_space(pos, q, si, cell, edges)
        e_rec, f_rec, w_rec, q_total = self.reciprocal(pos[:n], q[:n], si[:n], cell)
        e_corr, w_corr = self._corrections(q[:n], si[:n], cell, q_total)
        atom_e = e_real.clone()
        atom_e[:n] += e_rec + e_corr
        forces = f_real.clone()
        forces[:n] += f_rec
        atom_e, forces = COULOMB_EV_A * atom_e.to(pos.dtype), COULOMB_EV_A * forces
        out: ModelOutputs = {
            "energy": system_energy(atom_e, si, n_sys, n, Scope.LOCAL),
            "forces": forces,
            "atom_energies": atom_e,
        }
        if compute_stress:
            virial = COULOMB_EV_A * (w_real + w_rec + w_corr).to(pos.dtype)
            out["virial"] = virial
            out["stress"] = stress_from_virial(virial, cell)
        return out

    def _real_space(
        self,
        pos: torch.Tensor,
        q: torch.Tensor,
        si: torch.Tensor,
        cell: torch.Tensor,
        edges: EdgeList,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-atom energies (float64), forces and virial of the damped pairs."""
        n_rows, n_sys = pos.shape[0], cell.shape[0]
        energies = torch.zeros(n_rows, dtype=torch.float64, device=pos.device)
        forces = torch.zeros_like(pos)
        virial = torch.zeros(n_sys, 3, 3, dtype=pos.dtype, device=pos.device)
        if n_rows == 0 or edges.receivers.numel() == 0:
            return energies, forces, virial
        scalar, vec3, mat33 = wp_types(pos.dtype)
        wp = warp()
        idx_j, ptr, shifts = _csr(edges, n_rows)
        alpha = torch.full((n_sys,), self.alpha, dtype=pos.dtype, device=pos.device)
        with launch_scope(pos.device) as device:
            elec().batch_ewald_real_space_energy_forces(
                to_wp(pos, vec3),
                to_wp(q, scalar),
                to_wp(cell, mat33),
                to_wp(si.to(torch.int32), wp.int32),
                to_wp(idx_j, wp.int32),
                to_wp(ptr, wp.int32),
                to_wp(shifts, wp.vec3i),
                to_wp(alpha, scalar),
                to_wp(energies, wp.float64),
                to_wp(forces, vec3),
                to_wp(virial, mat33),
                scalar,
                device=device,
                compute_virial=True,
            )
        return energies, forces, virial

    def _corrections(
        self, q: torch.Tensor, si: torch.Tensor, cell: torch.Tensor, total: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Self and background energies of the owned rows (float64) and the background
        virial (counted once: see :func:`books_global_terms`); ``total`` is every
        system's total charge, shape ``(n_systems,)``. No communication."""
        q64 = q.to(torch.float64)
        volume = cell_volume(cell.to(torch.float64))
        alpha = self.alpha
        bg = math.pi / (2.0 * alpha * alpha) * total / volume  # per unit charge of an atom
        energies = -alpha / math.sqrt(math.pi) * q64 * q64 - q64 * bg.index_select(0, si)
        e_bg = -bg * total  # each system's background energy: -pi Q^2 / (2 alpha^2 V)
        eye = torch.eye(3, dtype=torch.float64, device=q.device)
        virial = (e_bg[:, None, None] * eye) * books_global_terms()
        return energies, virial.to(cell.dtype)


def books_global_terms() -> float:
    """1.0 where rank-independent global terms are booked (rank 0 of the live DD
    context's group, or any process without one), else 0.0: a term every rank
    computes identically from all-reduced data is then counted once in the sum
    of the per-rank partials."""
    ctx = current_dd_context()
    if ctx.layout is None:
        return 1.0
    return 1.0 if get_rank(ctx.group) == 0 else 0.0
