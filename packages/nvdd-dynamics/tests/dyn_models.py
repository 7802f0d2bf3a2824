"""Small brute-force pair models for the dynamics tests (not the shipped models).

``SoftPair``: E = sum over pairs within rc of eps * (1 - r/rc)^3, counted once per
pair through per-atom halves; stress from a strain derivative (ASE sign). Under a DD context it runs with open boundaries on
the ``[owned | ghost]`` rows and counts only owned receivers; single-process it
sums over periodic images explicitly. Forces are -dE/dx by autograd, computed
inside the model (``SPEC_LJ_HALO``: direct forces on padded rows, folded).
"""

from __future__ import annotations

import itertools
import math

import torch

from nvdd.core import Batch, ModelOutputs
from nvdd.shardtensor import Scope, current_dd_context, system_sum
from nvdd.spec import SPEC_LJ_HALO, SPEC_MPNN_HALO, BaseModelMixin, MLIPSpec, StrategyKind


def _images(cell: torch.Tensor, pbc: torch.Tensor, rc: float) -> torch.Tensor:
    ranges = []
    vol = abs(float(torch.linalg.det(cell))) if bool(pbc.any()) else 0.0
    for a in range(3):
        if bool(pbc[a]):
            b, c = cell[(a + 1) % 3], cell[(a + 2) % 3]
            spacing = vol / float(torch.linalg.cross(b, c).norm())
            k = math.ceil(rc / spacing)
            ranges.append(range(-k, k + 1))
        else:
            ranges.append(range(1))
    return torch.tensor(list(itertools.product(*ranges)), dtype=cell.dtype)


class SoftPair(BaseModelMixin, torch.nn.Module):
    def __init__(self, rc: float = 2.5, eps: float = 0.2, spec: MLIPSpec = SPEC_LJ_HALO) -> None:
        super().__init__()
        self.rc, self.eps, self._spec = rc, eps, spec

    @property
    def cutoff(self) -> float:
        return self.rc

    def distribution_spec(self, strategy: StrategyKind = StrategyKind.HALO) -> MLIPSpec:
        return self._spec

    def forward(self, batch: Batch, weights: torch.Tensor | None = None) -> ModelOutputs:
        ctx = current_dd_context()
        pos = batch.positions
        leaf = pos if pos.requires_grad else pos.detach().requires_grad_(True)
        n_rows = leaf.shape[0]
        counted = ctx.layout.n_owned if ctx.layout is not None else n_rows
        # strain leaf: stress = (1/V) dE/d strain (ASE sign), a per-rank partial under DD
        strain = torch.zeros(batch.n_systems, 3, 3, dtype=leaf.dtype, requires_grad=True)
        deform = torch.eye(3, dtype=leaf.dtype) + strain
        cell = torch.bmm(batch.cell.detach(), deform)
        strained = torch.bmm(leaf.unsqueeze(1), deform[batch.system_index]).squeeze(1)
        e_atom = leaf.new_zeros(n_rows)
        for s in range(batch.n_systems):
            rows = (batch.system_index == s).nonzero().flatten()
            shifts = _images(batch.cell[s], batch.pbc[s], self.rc).to(cell) @ cell[s]
            x = strained[rows]
            d = x[None, :, None, :] + shifts[None, None, :, :] - x[:, None, None, :]
            r = d.norm(dim=-1)
            same = torch.eye(len(rows), dtype=torch.bool)[:, :, None] & (shifts.norm(dim=-1) == 0)
            mask = (r < self.rc) & ~same & (rows < counted)[:, None, None]
            safe = torch.where(mask, r, torch.full_like(r, self.rc))
            phi = self.eps * (1 - safe / self.rc) ** 3
            e_atom = e_atom.index_add(0, rows, 0.5 * (phi * mask).sum(dim=(1, 2)))
        if weights is not None:  # per-receiver weights (WeightedPair)
            e_atom = e_atom * weights
        scope = (
            Scope.LOCAL
            if self._spec.output("energy").effective_reduce().value == "all_reduce"
            else Scope.OWNED
        )
        energy = system_sum(e_atom, batch.system_index, batch.n_systems, scope=scope)
        grad, de_dstrain = torch.autograd.grad(e_atom[:counted].sum(), (leaf, strain))
        volume = torch.linalg.det(batch.cell.detach()).abs().clamp(min=1e-300)
        return {
            "energy": energy,
            "forces": -grad,
            "atom_energies": e_atom.detach(),
            "stress": de_dstrain / volume[:, None, None],
        }


def soft_pair_mpnn_spec() -> SoftPair:
    """The same physics declared with the MPNN preset (replicated energy, autograd)."""
    return SoftPair(spec=SPEC_MPNN_HALO)


class MPLayer(torch.nn.Module):
    """h_i <- h_i + sum_j w(r_ij) h_j over receivers the context counts.

    Under DD only owned receivers get their sum, so the ghost rows of the output
    are stale: a following layer that reads them is wrong unless something
    refreshes them (a neighbor_refresh_adapters fix)."""

    def __init__(self, rc: float) -> None:
        super().__init__()
        self.rc = rc

    def forward(self, h: torch.Tensor, pos: torch.Tensor, n_recv: int) -> torch.Tensor:
        d = torch.linalg.vector_norm(pos[None, :, :] - pos[:, None, :], dim=-1)
        w = torch.where(d < self.rc, (1 - d / self.rc) ** 2, torch.zeros_like(d))
        w = w * (~torch.eye(len(pos), dtype=torch.bool))
        w[n_recv:] = 0.0
        return h + w @ h


class ToyMP(BaseModelMixin, torch.nn.Module):
    """Two MPLayers on open boundaries (use an open-boundary batch)."""

    def __init__(self, rc: float = 2.5) -> None:
        super().__init__()
        self.rc = rc
        self.layers = torch.nn.ModuleList([MPLayer(rc), MPLayer(rc)])

    @property
    def cutoff(self) -> float:
        return self.rc

    def distribution_spec(self, strategy: StrategyKind = StrategyKind.HALO) -> MLIPSpec:
        return SPEC_MPNN_HALO.replace(name="ToyMP without refresh")

    def forward(self, batch: Batch) -> ModelOutputs:
        ctx = current_dd_context()
        pos = batch.positions
        leaf = pos if pos.requires_grad else pos.detach().requires_grad_(True)
        n_recv = ctx.layout.n_owned if ctx.layout is not None else leaf.shape[0]
        h = torch.ones(leaf.shape[0], 1, dtype=leaf.dtype)
        for layer in self.layers:
            h = layer(h, leaf, n_recv)
        e_atom = h[:, 0] ** 2
        energy = system_sum(e_atom, batch.system_index, batch.n_systems, scope=Scope.OWNED)
        (grad,) = torch.autograd.grad(energy.sum(), leaf)
        return {"energy": energy, "forces": -grad}


class ScriptedToyMP(ToyMP):
    """ToyMP whose layers are TorchScript modules (forward hooks are not supported on them)."""

    def __init__(self, rc: float = 2.5) -> None:
        super().__init__(rc)
        self.layers = torch.nn.ModuleList([torch.jit.script(MPLayer(rc)) for _ in range(2)])


@torch.library.custom_op("nvdd_dyn_test::species_weight", mutates_args=())
def species_weight(z: torch.Tensor, scale: float) -> torch.Tensor:
    """A custom op: one weight per atom from its atomic number (float64)."""
    return 1.0 + scale * (z.to(torch.float64) % 7)


@species_weight.register_fake
def _(z: torch.Tensor, scale: float) -> torch.Tensor:
    return z.new_empty(z.shape, dtype=torch.float64)


class SpeciesWeights(torch.nn.Module):
    """Per-atom weights through the custom op (ghost rows exact: species are exchanged)."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.ops.nvdd_dyn_test.species_weight(z, 0.1)


class WeightedPair(SoftPair):
    """SoftPair whose per-atom energies are scaled by weights from a custom op."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = SpeciesWeights()

    def forward(self, batch: Batch, weights: torch.Tensor | None = None) -> ModelOutputs:
        return super().forward(batch, weights=self.weights(batch.atomic_numbers))


class PairSum(torch.nn.Module):
    """A composed model as DomainParallel sees one: ``pipeline_components`` (the
    pair models in ``parts``) plus the single-process sum (the 1-rank oracle)."""

    def __init__(self, parts: list[torch.nn.Module], cutoff: float) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.cutoff = cutoff

    @property
    def pipeline_components(self) -> tuple[torch.nn.Module, ...]:
        return tuple(self.parts)

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        outs = [m(batch) for m in self.parts]
        return {k: sum(o[k].detach() for o in outs) for k in ("energy", "forces")}
