"""`Ewald`: Ewald summation on nvalchemi-toolkit-ops kernels, domain-decomposable.

Reciprocal space (``k`` over a half space, ``|k| <= k_cutoff``, ``k != 0``;
``g(k) = 8 pi exp(-k^2 / 4 alpha^2) / (V k^2)``):

``E_recip = 1/2 sum_k g(k) |rho(k)|^2``, ``rho(k) = sum_j q_j exp(i k.r_j)``.

``rho`` is a sum over atoms, so under domain decomposition each rank fills
the weighted structure factors ``S(k) = g(k) rho_r(k)`` of its owned charges
(the toolkit's K-major Warp kernel), the ``2K + 1`` numbers per system (real and
imaginary parts, and the total charge) are summed over ranks in ONE all-reduce,
and each rank then evaluates its owned atoms' energies
``E_i = q_i/2 sum_k [S_re cos(k.r_i) + S_im sin(k.r_i)]`` and forces (the
toolkit's atom-major kernel). This is the cheapest exact collective: the
reciprocal term needs every charge's contribution to every ``S(k)``, and the
all-reduce moves ``2K + 1`` numbers however many atoms there are.

The reciprocal virial ``W_ab = sum_k E_k (delta_ab - 2 k_a k_b (1/k^2 +
1/4 alpha^2))`` with ``E_k = |S(k)|^2 / (2 g(k))`` is computed from the reduced
``S`` (identical on every rank) and booked once (rank 0 of the group).
"""

from __future__ import annotations

import math

import torch

from nvdd.models._coulomb import CoulombModel, Reciprocal, books_global_terms
from nvdd.models._coulomb_config import EwaldConfig
from nvdd.models._nvalchemi import elec, launch_scope, to_wp, warp, wp_types
from nvdd.spec import SPEC_EWALD_HALO, GlobalCoupling, MLIPSpec

__all__ = ["Ewald", "ewald_k_vectors"]


def ewald_k_vectors(cell: torch.Tensor, k_cutoff: float) -> torch.Tensor:
    """Half-space reciprocal vectors ``k = 2 pi (n @ inv(cell).T)``, ``0 < |k| <= k_cutoff``.

    Parameters
    ----------
    cell:
        One system's cell, shape ``(3, 3)`` (rows are lattice vectors).
    k_cutoff:
        1/Angstrom.

    Returns
    -------
    torch.Tensor
        Shape ``(K, 3)``, the dtype of ``cell``. Of each pair ``k, -k`` exactly one
        is kept (the first nonzero Miller index positive), ordered by Miller index,
        so every process with the same cell gets the same vectors.
    """
    c64 = cell.detach().to(torch.float64)
    recip = 2.0 * math.pi * torch.linalg.inv(c64).T  # rows: reciprocal vectors b_i
    # |n_i| <= k_cutoff |a_i| / 2 pi bounds every vector inside the sphere.
    lengths = torch.linalg.norm(c64, dim=1).tolist()
    bounds = [math.floor(k_cutoff * length / (2.0 * math.pi)) for length in lengths]
    axes = [torch.arange(-b, b + 1, dtype=torch.float64, device=cell.device) for b in bounds]
    n = torch.cartesian_prod(*axes).reshape(-1, 3)
    first = torch.where(n[:, 0] != 0, n[:, 0], torch.where(n[:, 1] != 0, n[:, 1], n[:, 2]))
    k = n @ recip
    keep = (first > 0) & ((k * k).sum(1) <= k_cutoff * k_cutoff)
    out: torch.Tensor = k[keep].to(cell.dtype)
    return out


class Ewald(CoulombModel):
    """Ewald summation of point charges (``atom_extras["charges"]``) in periodic cells.

    Real space on the model's neighbour list (the toolkit's Warp kernel),
    reciprocal space by explicit k-vectors (the toolkit's structure-factor and
    energy/force kernels). Runs unchanged on one process and, inside a live DD
    context, on one rank's ``[owned | ghost]`` rows.

    Parameters
    ----------
    config:
        Cutoffs, splitting parameter, accuracy and skin.
    spec:
        Overrides the spec returned by :meth:`distribution_spec` (default
        ``SPEC_EWALD_HALO``); its ``global_coupling`` must be ``RECIPROCAL_SUM``.

    Notes
    -----
    ``SPEC_EWALD_HALO``: direct forces on every padded row (the runtime folds
    ghost rows); energy, virial and stress are per-rank partials
    (``Reduce.ALL_REDUCE``); ``"charges"`` is a sharded field (copied to ghost
    rows at halo rebuilds); one all-reduce of ``2K + 1`` float64 per system and
    call (``GlobalCoupling.RECIPROCAL_SUM``).

    Examples
    --------
    >>> model = Ewald(EwaldConfig(cutoff=8.0, accuracy=1e-6))
    >>> out = model(assign_charges(batch, {11: 1.0, 17: -1.0}))
    """

    _halo_preset = SPEC_EWALD_HALO
    _coupling = GlobalCoupling.RECIPROCAL_SUM

    def __init__(self, config: EwaldConfig, *, spec: MLIPSpec | None = None) -> None:
        super().__init__(config.cutoff, config.skin, config.resolved_alpha, spec)
        self._config = config
        self.k_cutoff = config.resolved_k_cutoff
        self._k_cache: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    @property
    def config(self) -> EwaldConfig:
        """The configuration the model was built from."""
        return self._config

    def extra_repr(self) -> str:
        """The module repr's summary: real-space cutoff, ``alpha``, k-space cutoff."""
        return f"cutoff={self.cutoff}, alpha={self.alpha:.6g}, k_cutoff={self.k_cutoff:.6g}"

    def k_vectors(self, cell: torch.Tensor) -> list[torch.Tensor]:
        """The k-vectors of every system, ``(K_s, 3)`` each (cached while the cell is unchanged)."""
        cached = self._k_cache
        if cached is not None and torch.equal(cached[0], cell):
            return cached[1]
        ks = [ewald_k_vectors(cell[s], self.k_cutoff) for s in range(cell.shape[0])]
        self._k_cache = (cell.detach().clone(), ks)
        return ks

    def reciprocal(
        self,
        positions: torch.Tensor,
        charges: torch.Tensor,
        system_index: torch.Tensor,
        cell: torch.Tensor,
    ) -> Reciprocal:
        """Reciprocal-space terms of the given (owned) rows; see the module docstring.

        **Collective** under a live DD context: one all-reduce of every system's
        structure factors and total charge over the context's group.
        """
        n_sys, dev, dtype = cell.shape[0], positions.device, positions.dtype
        ks = self.k_vectors(cell)
        scalar, vec3, mat33 = wp_types(dtype)
        alpha = torch.full((1,), self.alpha, dtype=dtype, device=dev)
        rows = [
            torch.arange(positions.shape[0], device=dev)
            if n_sys == 1
            else (system_index == s).nonzero().squeeze(1)
            for s in range(n_sys)
        ]
        phases: list[tuple[torch.Tensor, torch.Tensor]] = []
        partial: list[torch.Tensor] = []
        with launch_scope(dev) as device:
            for s in range(n_sys):
                k, idx = ks[s], rows[s]
                pos, q = positions.index_select(0, idx), charges.index_select(0, idx)
                cos = torch.zeros(k.shape[0], idx.numel(), dtype=torch.float64, device=dev)
                sin = torch.zeros_like(cos)
                s_re = torch.zeros(k.shape[0], dtype=torch.float64, device=dev)
                s_im = torch.zeros_like(s_re)
                q_over_v = torch.zeros(1, dtype=torch.float64, device=dev)  # the kernel's Q / V
                if idx.numel() and k.shape[0]:
                    elec().ewald_reciprocal_space_fill_structure_factors(
                        to_wp(pos, vec3),
                        to_wp(q, scalar),
                        to_wp(k, vec3),
                        to_wp(cell[s : s + 1], mat33),
                        to_wp(alpha, scalar),
                        to_wp(q_over_v, warp().float64),
                        to_wp(cos, warp().float64),
                        to_wp(sin, warp().float64),
                        to_wp(s_re, warp().float64),
                        to_wp(s_im, warp().float64),
                        scalar,
                        device=device,
                    )
                phases.append((cos, sin))
                partial += [s_re, s_im, q.to(torch.float64).sum().reshape(1)]
        sizes = [t.numel() for t in partial]
        total = torch.split(self._reduce(torch.cat(partial)), sizes)
        energies = torch.zeros(positions.shape[0], dtype=torch.float64, device=dev)
        forces = torch.zeros_like(positions)
        virial = torch.zeros(n_sys, 3, 3, dtype=torch.float64, device=dev)
        q_total = torch.stack([total[3 * s + 2][0] for s in range(n_sys)])
        with launch_scope(dev) as device:
            for s in range(n_sys):
                k, idx = ks[s], rows[s]
                s_re, s_im = total[3 * s], total[3 * s + 1]
                virial[s] = self._virial(k, s_re, s_im, cell[s])
                if not idx.numel() or not k.shape[0]:
                    continue
                e_s = torch.zeros(idx.numel(), dtype=torch.float64, device=dev)
                f_s = torch.zeros(idx.numel(), 3, dtype=dtype, device=dev)
                cos, sin = phases[s]
                elec().ewald_reciprocal_space_energy_forces(
                    to_wp(charges.index_select(0, idx), scalar),
                    to_wp(k, vec3),
                    to_wp(cos, warp().float64),
                    to_wp(sin, warp().float64),
                    to_wp(s_re.contiguous(), warp().float64),
                    to_wp(s_im.contiguous(), warp().float64),
                    to_wp(e_s, warp().float64),
                    to_wp(f_s, vec3),
                    scalar,
                    device=device,
                )
                energies.index_copy_(0, idx, e_s)
                forces.index_copy_(0, idx, f_s)
        return energies, forces, virial * books_global_terms(), q_total

    def _virial(
        self, k: torch.Tensor, s_re: torch.Tensor, s_im: torch.Tensor, cell: torch.Tensor
    ) -> torch.Tensor:
        """``-dE_recip/d strain`` from the reduced weighted structure factors, ``(3, 3)``."""
        k64 = k.to(torch.float64)
        k2 = (k64 * k64).sum(1)
        volume = torch.linalg.det(cell.to(torch.float64)).abs()
        a2 = self.alpha * self.alpha
        g = 8.0 * math.pi * torch.exp(-k2 / (4.0 * a2)) / (volume * k2)
        e_k = (s_re * s_re + s_im * s_im) / (2.0 * g)
        factor = 2.0 * e_k * (1.0 / k2 + 1.0 / (4.0 * a2))
        eye = torch.eye(3, dtype=torch.float64, device=k.device)
        virial: torch.Tensor = e_k.sum() * eye - (k64 * factor[:, None]).T @ k64
        return virial
