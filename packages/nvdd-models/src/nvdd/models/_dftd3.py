"""`DFTD3`: Grimme's D3 dispersion with Becke-Johnson damping, domain-decomposable.

Two-body D3(BJ) (Grimme, Antony, Ehrlich, Krieg 2010; Grimme, Ehrlich, Goerigk
2011), in atomic units inside, eV and Angstrom outside:

- coordination numbers ``CN_i = sum_j 1 / (1 + exp(-k1 (R_ij / r_ij - 1)))`` over
  neighbours within ``cn_cutoff`` (``k1 = 16``, ``R_ij`` the sum of the scaled
  covalent radii);
- Gaussian weights of the element's reference systems,
  ``w_i^a ~ exp(-k3 (CN_i - CN_i^a)^2)`` (``k3 = 4``), normalised; when every weight
  underflows, the reference with the largest CN gets weight one;
- ``C6_ij = sum_ab w_i^a w_j^b C6ref_ij^ab``, ``C8_ij = 3 C6_ij r4r2_i r4r2_j``;
- ``E = -1/2 sum_ij [s6 C6 / (r^6 + f^6) + s8 C8 / (r^8 + f^8)]`` over pairs within
  ``cutoff``, ``f = a1 sqrt(C8 / C6) + a2``.

The three-body (ATM) term is not included. Forces and virial by autograd.

Domain decomposition. The energy of a pair reads the CN of both atoms, and
the CN of a ghost atom needs ITS neighbours. ``SPEC_DFTD3_HALO``
(``ScatterMode.LOCAL``) computes CN only for owned atoms (owned receivers, exact
with a halo of ``max(cutoff, cn_cutoff) + skin``), then refreshes the ghost
rows from their owners (one forward exchange; its adjoint folds ``dE/dCN`` of
ghost rows back to the owners in the backward), before the dispersion energy.
With ``ScatterMode.NONE`` the model instead computes CN on every padded row
(no exchange); ghosts within ``cutoff`` of the box then need complete
neighbourhoods, so the spec must widen the halo by ``min(cutoff, cn_cutoff)``
(``extra_ghost_width``). Both are exact; the refresh moves one number per
ghost per step instead of widening the halo, and is the default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvdd.core import Batch, ModelOutputs
from nvdd.models._checks import check_positive, config_error
from nvdd.models._d3_params import (
    ANGSTROM_TO_BOHR,
    HARTREE_TO_EV,
    MAX_Z_D3,
    d3_tables,
    functional_bj,
)
from nvdd.models._dd import HaloModelMixin, InputGate, energy_scope, per_atom_exchange, prepare_rows
from nvdd.models._forces import outputs_by_autograd
from nvdd.models._neighbors import EdgeList
from nvdd.models._verlet import VerletList
from nvdd.shardtensor import current_dd_context
from nvdd.spec import DFTD3_CN_CUTOFF, SPEC_DFTD3_HALO, MLIPSpec

__all__ = ["D3Config", "DFTD3"]

_K1 = 16.0
_K3 = 4.0


@dataclass(frozen=True)
class D3Config:
    """D3(BJ) damping parameters and cutoffs.

    Parameters
    ----------
    a1, a2, s8:
        BJ damping parameters of the functional (``a2`` in Bohr, as published).
    s6:
        C6 scaling (1 for most functionals).
    cutoff:
        Pair cutoff of the dispersion energy (Angstrom).
    cn_cutoff:
        Cutoff of the coordination numbers (Angstrom).
    skin:
        Verlet skin of the model's own neighbour list (Angstrom).
    """

    a1: float
    a2: float
    s8: float
    s6: float = 1.0
    cutoff: float = 15.0
    cn_cutoff: float = DFTD3_CN_CUTOFF
    skin: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a1", "a2", "s8", "s6"):
            check_positive(f"D3Config.{name}", getattr(self, name), allow_zero=True)
        check_positive("D3Config.cutoff", self.cutoff)
        check_positive("D3Config.cn_cutoff", self.cn_cutoff)
        check_positive("D3Config.skin", self.skin, allow_zero=True)

    @classmethod
    def from_functional(cls, name: str, **kwargs: float) -> D3Config:
        """The BJ parameters of functional ``name`` (tad-dftd3's table), plus ``kwargs``.

        Raises
        ------
        ConfigurationError
            For a functional without D3(BJ) parameters.
        """
        try:
            params = functional_bj(name)
        except KeyError as exc:
            raise config_error(str(exc.args[0])) from None
        return cls(**{**params, **kwargs})


class DFTD3(HaloModelMixin, torch.nn.Module):
    """D3(BJ) dispersion over the model's neighbour list (see the module docstring).

    Parameters
    ----------
    config:
        Damping parameters and cutoffs.
    spec:
        Replaces ``SPEC_DFTD3_HALO``; its ``options.scatter`` selects how ghost
        coordination numbers are made exact (``LOCAL`` / ``FOLD``: exchanged;
        ``NONE``: computed in a halo widened by ``min(cutoff, cn_cutoff)``).

    Raises
    ------
    ConfigurationError
        A ``NONE`` spec whose ``extra_ghost_width`` is too small.
    """

    _halo_preset = SPEC_DFTD3_HALO
    rcov: torch.Tensor
    r4r2: torch.Tensor
    ref_cn: torch.Tensor
    ref_c6: torch.Tensor

    def __init__(self, config: D3Config, *, spec: MLIPSpec | None = None) -> None:
        super().__init__()
        self._config = config
        self._spec = spec
        tables = d3_tables()
        self.register_buffer("rcov", tables.rcov.clone())
        self.register_buffer("r4r2", tables.r4r2.clone())
        self.register_buffer("ref_cn", tables.ref_cn.clone())
        self.register_buffer("ref_c6", tables.ref_c6.clone())
        self.neighbors = VerletList(self.cutoff, config.skin)
        self._dd_gate = InputGate()
        self._exchange = per_atom_exchange(self.distribution_spec())
        need = min(config.cutoff, config.cn_cutoff)
        have = self.distribution_spec().options.extra_ghost_width
        if self._exchange is None and have < need - 1e-12:
            raise config_error(
                f"DFTD3 with ScatterMode.NONE computes ghost coordination numbers in place: its "
                f"spec must widen the halo by min(cutoff, cn_cutoff) = {need}, got "
                f"extra_ghost_width={have}"
            )

    @property
    def config(self) -> D3Config:
        """The configuration the model was built from."""
        return self._config

    @property
    def cutoff(self) -> float:
        """``max(cutoff, cn_cutoff)`` (Angstrom): the neighbour list and the halo."""
        return max(self._config.cutoff, self._config.cn_cutoff)

    def extra_repr(self) -> str:
        """The module repr's summary: damping and scaling parameters, cutoffs, skin."""
        c = self._config
        return (
            f"a1={c.a1}, a2={c.a2}, s6={c.s6}, s8={c.s8}, cutoff={c.cutoff}, "
            f"cn_cutoff={c.cn_cutoff}, skin={c.skin}"
        )

    # ----------------------------------------------------------------- physics
    def coordination_numbers(
        self, r: torch.Tensor, zi: torch.Tensor, zj: torch.Tensor, receivers: torch.Tensor, n: int
    ) -> torch.Tensor:
        """``CN`` of every row (shape ``(n,)``) from edge distances ``r`` (Angstrom)."""
        r0 = self.rcov.to(r.dtype).index_select(0, zi) + self.rcov.to(r.dtype).index_select(0, zj)
        rb = r * ANGSTROM_TO_BOHR
        count = torch.sigmoid(_K1 * (r0 / rb - 1.0))
        count = torch.where(r < self._config.cn_cutoff, count, torch.zeros_like(count))
        return torch.zeros(n, dtype=r.dtype, device=r.device).index_add(0, receivers, count)

    def weights(self, cn: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Normalised reference weights, shape ``(n, 7)``, in the dtype of ``cn``.

        Evaluated in float64 whatever the model's dtype: in float32 the Gaussians
        underflow for CNs far from a reference, and the normalisation's backward
        divides by their tiny sums (NaN forces).
        """
        ref = self.ref_cn.to(torch.float64).index_select(0, z)
        cn64 = cn.to(torch.float64)
        valid = ref >= 0
        raw = torch.where(
            valid, torch.exp(-_K3 * (ref - cn64.unsqueeze(1)) ** 2), torch.zeros_like(ref)
        )
        norm = raw.sum(1, keepdim=True)
        ok = norm > 1e-300
        w = raw / torch.where(ok, norm, torch.ones_like(norm))
        largest = (ref == ref.max(1, keepdim=True).values) & valid
        return torch.where(ok, w, largest.to(torch.float64)).to(cn.dtype)

    def dispersion_energies(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        z: torch.Tensor,
        system_index: torch.Tensor,
        edges: EdgeList,
        n_counted: int | None,
    ) -> torch.Tensor:
        """Per-atom dispersion energies (eV), shape ``(n_atoms,)``; zero on rows past
        ``n_counted``. **Collective** under a live DD context with an exchanging spec."""
        c = self._config
        n = positions.shape[0]
        i, j = edges.receivers, edges.senders
        r_vec = edges.vectors(positions, cell, system_index)
        r = torch.sqrt((r_vec * r_vec).sum(1))
        zi, zj = z.index_select(0, i), z.index_select(0, j)
        cn = self.coordination_numbers(r, zi, zj, i, n)
        if self._exchange is not None:
            cn = self._exchange(cn)
        w = self.weights(cn, z)
        ref = self.ref_c6[zi, zj].to(r.dtype)  # (n_edges, 7, 7)
        c6 = torch.einsum("ea,eab,eb->e", w.index_select(0, i), ref, w.index_select(0, j))
        r4r2 = self.r4r2.to(r.dtype)
        qq = 3.0 * r4r2.index_select(0, zi) * r4r2.index_select(0, zj)
        f = c.a1 * torch.sqrt(qq) + c.a2
        rb = r * ANGSTROM_TO_BOHR
        pair = c.s6 * c6 / (rb**6 + f**6) + c.s8 * c6 * qq / (rb**8 + f**8)
        keep = r < c.cutoff
        if n_counted is not None:
            keep = keep & (i < n_counted)
        pair = torch.where(keep, pair, torch.zeros_like(pair))
        out = torch.zeros(n, dtype=r.dtype, device=r.device)
        return out.index_add(0, i, -0.5 * HARTREE_TO_EV * pair)

    # ----------------------------------------------------------------- forward
    def forward(
        self, batch: Batch, *, n_receivers: int | None = None, compute_stress: bool = True
    ) -> ModelOutputs:
        """Energy, forces, atom energies, virial and stress of every system.

        Parameters
        ----------
        batch:
            One or several systems (open, periodic or mixed boundaries); elements 1..103.
        n_receivers:
            Under a live DD context it defaults to (and must equal) the layout's ``n_owned``.
        compute_stress:
            Also return ``virial`` and ``stress``.

        Returns
        -------
        ModelOutputs
            ``energy`` ``(n_systems,)``, ``forces`` ``(n_atoms, 3)``,
            ``atom_energies`` and, with ``compute_stress``, ``virial`` and
            ``stress``. Under a live DD context: forces ``-dE_local/dx`` on
            every padded row (fold ghost rows), energy, virial and stress this
            rank's partials.

        Raises
        ------
        ValidationError
            Malformed input or an element without D3 data (under DD on a new
            topology: on every rank together).

        Notes
        -----
        **Collective** under a live DD context with ``LOCAL`` / ``FOLD``: the
        coordination-number exchange in the forward and its adjoint in the
        backward (every rank calls this at the same point).
        """
        n_receivers, topology = prepare_rows(
            self._dd_gate, batch, n_receivers, lambda: None, lambda: self._species_problem(batch)
        )
        dd = current_dd_context().layout is not None
        search_rows = None if (dd and self._exchange is None) else n_receivers
        edges = self.neighbors.for_batch(batch, n_receivers=search_rows, topology=topology)
        z = batch.atomic_numbers
        return outputs_by_autograd(
            lambda pos, cell: self.dispersion_energies(
                pos, cell, z, batch.system_index, edges, n_receivers
            ),
            batch.positions,
            batch.cell,
            batch.system_index,
            n_counted=n_receivers,
            compute_stress=compute_stress,
            energy_scope=energy_scope(self.distribution_spec()),
        )

    def _species_problem(self, batch: Batch) -> str | None:
        z = batch.atomic_numbers
        if z.numel() == 0:
            return None
        bad = (z < 1) | (z > MAX_Z_D3)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            return f"atomic_numbers[{row}] = {int(z[row])} has no D3 data (elements 1..{MAX_Z_D3})"
        return None
