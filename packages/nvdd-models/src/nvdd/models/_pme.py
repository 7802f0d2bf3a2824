"""`ParticleMeshEwald`: smooth PME on nvalchemi-toolkit-ops kernels, domain-decomposable.

Reciprocal space (per system):

1. spread the charges on a ``K1 x K2 x K3`` mesh with cardinal B-splines of
   order ``p`` (the toolkit's Warp spread kernel);
2. FFT, multiply by the toolkit's fused Green's function / B-spline modulus
   convolution, inverse FFT: the potential mesh;
3. gather the potential and its gradient back at the atoms (the toolkit's
   fused gather-with-force kernel): ``E_i = q_i phi(r_i)``, ``F_i = -q_i grad phi``.

Under domain decomposition each rank spreads its OWNED charges only; the mesh
is linear in the charges, so the sum of the ranks' meshes is the mesh of the
whole system: ONE all-reduce of ``K1 K2 K3`` numbers per system and call
(``GlobalCoupling.MESH_SUM``). Every rank then transforms the whole mesh and
gathers at its owned atoms. The alternative, a decomposed mesh (reduce-scatter
of slabs, a distributed FFT with two all-to-all transposes, an all-gather of
the potential for the B-spline stencils that cross slab faces), moves at least
as many bytes (a reduce-scatter plus an all-gather IS an all-reduce, and the
transposes come on top) and saves only FFT work, which is small next to the
spread and gather at the mesh sizes a cutoff of ~1 nm implies; see
docs/design.md.

The total charge of each system is the sum of the reduced mesh (B-spline
weights sum to one), so the background correction needs no extra collective.
The reciprocal virial is computed from the reduced mesh (identical on every
rank) and booked once (rank 0 of the group).
"""

from __future__ import annotations

import math

import torch

from nvdd.models._coulomb import CoulombModel, Reciprocal, books_global_terms
from nvdd.models._coulomb_config import PMEConfig
from nvdd.models._nvalchemi import pme_torch, spline
from nvdd.spec import SPEC_PME_HALO, GlobalCoupling, MLIPSpec

__all__ = ["ParticleMeshEwald"]


class ParticleMeshEwald(CoulombModel):
    """Smooth particle-mesh Ewald of point charges (``atom_extras["charges"]``).

    Real space on the model's neighbour list (the toolkit's Warp kernel, as
    :class:`~nvdd.models.Ewald`), reciprocal space on a mesh. Runs unchanged on
    one process and, inside a live DD context, on one rank's ``[owned | ghost]``
    rows.

    Parameters
    ----------
    config:
        Cutoff, splitting parameter, mesh and spline order.
    spec:
        Overrides the spec of :meth:`distribution_spec` (default
        ``SPEC_PME_HALO``); its ``global_coupling`` must be ``MESH_SUM``.

    Notes
    -----
    ``SPEC_PME_HALO``: as ``SPEC_EWALD_HALO`` (direct forces folded by the
    runtime, per-rank partial energy / virial / stress, charges a sharded
    field), but the collective is the charge mesh (``GlobalCoupling.MESH_SUM``).
    """

    _halo_preset = SPEC_PME_HALO
    _coupling = GlobalCoupling.MESH_SUM

    def __init__(self, config: PMEConfig, *, spec: MLIPSpec | None = None) -> None:
        super().__init__(config.cutoff, config.skin, config.resolved_alpha, spec)
        self._config = config

    @property
    def config(self) -> PMEConfig:
        """The configuration the model was built from."""
        return self._config

    def extra_repr(self) -> str:
        """The module repr's summary: cutoff, ``alpha``, mesh, spline order."""
        c = self._config
        mesh = c.mesh if c.mesh is not None else f"spacing {c.mesh_spacing}"
        return f"cutoff={self.cutoff}, alpha={self.alpha:.6g}, mesh={mesh}, order={c.spline_order}"

    def mesh_of(self, cell: torch.Tensor) -> tuple[int, int, int]:
        """The mesh of one system's cell, shape ``(3, 3)``."""
        lengths = torch.linalg.norm(cell.detach().to(torch.float64), dim=1).tolist()
        return self._config.mesh_for((lengths[0], lengths[1], lengths[2]))

    def reciprocal(
        self,
        positions: torch.Tensor,
        charges: torch.Tensor,
        system_index: torch.Tensor,
        cell: torch.Tensor,
    ) -> Reciprocal:
        """Reciprocal-space terms of the given (owned) rows; see the module docstring.

        **Collective** under a live DD context: one all-reduce of every system's
        charge mesh over the context's group.
        """
        n_sys, dev, dtype = cell.shape[0], positions.device, positions.dtype
        order = self._config.spline_order
        meshes = [self.mesh_of(cell[s]) for s in range(n_sys)]
        rows = [
            torch.arange(positions.shape[0], device=dev)
            if n_sys == 1
            else (system_index == s).nonzero().squeeze(1)
            for s in range(n_sys)
        ]
        local = []
        for s in range(n_sys):
            idx = rows[s]
            if idx.numel():
                grid = spline().spline_spread(
                    positions.index_select(0, idx),
                    charges.index_select(0, idx),
                    cell[s : s + 1],
                    mesh_dims=meshes[s],
                    spline_order=order,
                )
            else:
                grid = torch.zeros(meshes[s], dtype=dtype, device=dev)
            local.append(grid.reshape(-1))
        sizes = [g.numel() for g in local]
        reduced = torch.split(self._reduce(torch.cat(local)), sizes)
        energies = torch.zeros(positions.shape[0], dtype=torch.float64, device=dev)
        forces = torch.zeros_like(positions)
        virial = torch.zeros(n_sys, 3, 3, dtype=torch.float64, device=dev)
        q_total = torch.zeros(n_sys, dtype=torch.float64, device=dev)
        for s in range(n_sys):
            mesh = reduced[s].reshape(meshes[s])
            q_total[s] = mesh.to(torch.float64).sum()
            potential, w = self._potential(mesh, cell[s], meshes[s])
            virial[s] = w
            idx = rows[s]
            if not idx.numel():
                continue
            q = charges.index_select(0, idx)
            raw, grad = spline().spline_gather_with_force(
                positions.index_select(0, idx), q, potential, cell[s : s + 1], spline_order=order
            )
            # The toolkit's Green's function carries the 1/2 of the pair sum: E_i = q_i phi_i
            # and F_i = 2 x (-q_i grad phi_i).
            energies.index_copy_(0, idx, (q * raw).to(torch.float64))
            forces.index_copy_(0, idx, 2.0 * grad.to(dtype))
        return energies, forces, virial * books_global_terms(), q_total

    def _potential(
        self, mesh: torch.Tensor, cell: torch.Tensor, dims: tuple[int, int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The potential mesh of a charge mesh, and the reciprocal virial ``(3, 3)``."""
        dtype, dev = mesh.dtype, mesh.device
        order = self._config.spline_order
        nx, ny, nz = dims
        c64 = cell.to(torch.float64)
        recip = 2.0 * math.pi * torch.linalg.inv(c64).T  # rows: reciprocal vectors
        mx = torch.fft.fftfreq(nx, d=1.0 / nx, device=dev, dtype=torch.float64)
        my = torch.fft.fftfreq(ny, d=1.0 / ny, device=dev, dtype=torch.float64)
        mz = torch.fft.rfftfreq(nz, d=1.0 / nz, device=dev, dtype=torch.float64)
        miller = torch.stack(torch.meshgrid(mx, my, mz, indexing="ij"), dim=-1)
        k = miller @ recip  # (nx, ny, nz//2+1, 3)
        k2 = (k * k).sum(-1)
        k2_safe = torch.where(k2 > 0, k2, torch.full_like(k2, 1e-12))
        module = pme_torch()
        moduli = [
            module.compute_bspline_moduli_1d(m.to(dtype), n, order)
            for m, n in ((mx, nx), (my, ny), (mz, nz))
        ]
        volume = torch.linalg.det(c64).abs().reshape(1)
        alpha = torch.full((1,), self.alpha, dtype=dtype, device=dev)
        fft = torch.fft.rfftn(mesh, norm="backward", dim=(0, 1, 2))
        convolved = torch.ops.nvalchemiops.pme_fused_convolve(
            fft, k2_safe.to(dtype), *moduli, alpha, volume.to(dtype), False, False
        )
        potential = torch.fft.irfftn(convolved, norm="forward", s=dims, dim=(0, 1, 2)).to(dtype)
        # -dE/d strain: sum_k E_k (delta - 2 k k (1/k^2 + 1/4 alpha^2)); E_k from the
        # spectral pair (Parseval), rfft half-space weights 2 except k_z = 0 / Nyquist.
        density = (fft.to(torch.complex128) * convolved.to(torch.complex128).conj()).real
        weight = torch.full_like(density, 2.0)
        weight[..., 0] = 1.0
        if nz % 2 == 0:
            weight[..., -1] = 1.0
        e_k = torch.where(k2 > 0, weight * density, torch.zeros_like(density))
        factor = 2.0 * e_k * (1.0 / k2_safe + 0.25 / (self.alpha * self.alpha))
        kf = k.reshape(-1, 3)
        eye = torch.eye(3, dtype=torch.float64, device=dev)
        virial = e_k.sum() * eye - (kf * factor.reshape(-1, 1)).T @ kf
        return potential, virial
