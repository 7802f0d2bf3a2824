"""MTK NPT on the atoms' device: the barostat's kernels against NumPy, and
steady NPT steps captured (emulated on CPU) equal to eager steps bit for bit."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
import pytest
import torch

from nvdd.core import Batch, ModelOutputs, ValidationError, emulated_capture
from nvdd.dynamics import MTKNPT, CellDOF, HookStage
from nvdd.dynamics._barostat_device import (
    RowKernel,
    SystemKernel,
    cell_kick_kernel,
    propagators_kernel,
)


def _sym(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    a = rng.normal(size=(n, 3, 3)) * scale
    return 0.5 * (a + a.transpose(0, 2, 1))


def _phi_exp(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """exp(G) and (exp(G) - 1) / G of symmetric matrices by their eigenvectors."""
    lam, u = np.linalg.eigh(g)
    safe = np.where(lam == 0, 1.0, lam)
    phi = np.where(lam == 0, 1.0, np.expm1(safe) / safe)
    e = np.einsum("sij,sj,skj->sik", u, np.exp(lam), u)
    return e, np.einsum("sij,sj,skj->sik", u, phi, u)


@pytest.mark.parametrize("iso", [False, True])
@pytest.mark.parametrize("kick", [False, True])
def test_the_propagators_equal_an_eigendecomposition(iso: bool, kick: bool) -> None:
    """The Taylor series with scaling and squaring gives exp(G) and Phi(G) to
    float64 rounding, from tiny strains to norms that need many halvings."""
    rng = np.random.default_rng(3)
    n_sys = 6
    p = _sym(rng, n_sys, 1.0) * np.array([1e-9, 1e-3, 0.3, 2.0, 40.0, 0.0])[:, None, None]
    if iso:
        p = p[:, :1, :1] * np.eye(3)  # element 0 is the isotropic momentum
    w = rng.uniform(0.5, 2.0, n_sys)
    counts = rng.integers(1, 50, n_sys).astype(np.float64)
    d = 0.7
    rate = p / w[:, None, None]
    g = rate * d
    if kick:
        trace = np.trace(rate, axis1=1, axis2=2) / (3.0 * counts)
        g = -(rate + trace[:, None, None] * np.eye(3)) * d
    want_e, want_phi = _phi_exp(g)
    t = torch.from_numpy
    e, phi = torch.zeros(n_sys, 9, dtype=torch.float64), torch.zeros(n_sys, 9, dtype=torch.float64)
    kernel = SystemKernel(propagators_kernel, n_sys, torch.device("cpu"))
    kernel(t(p.reshape(n_sys, 9).copy()), t(w), t(counts), d, int(kick), int(iso), e, phi)
    scale = np.maximum(1.0, np.abs(want_e).max(axis=(1, 2)))[:, None, None]
    got_e, got_phi = e.numpy().reshape(-1, 3, 3), phi.numpy().reshape(-1, 3, 3)
    assert (np.abs(got_e - want_e) / scale).max() < 1e-12
    assert (np.abs(got_phi - want_phi) / scale).max() < 1e-12
    if iso:  # exact zeros off the diagonal: an isotropic step keeps the cell's shape
        off = ~np.eye(3, dtype=bool)
        assert (got_e[:, off] == 0).all() and (got_phi[:, off] == 0).all()


@pytest.mark.parametrize("iso", [False, True])
def test_the_cell_kick_follows_the_mtk_force(iso: bool) -> None:
    rng = np.random.default_rng(5)
    n_sys = 3
    kin, stress = _sym(rng, n_sys, 2.0), _sym(rng, n_sys, 0.01)
    cell = np.eye(3) * rng.uniform(5, 9, (n_sys, 1, 1)) + rng.normal(size=(n_sys, 3, 3)) * 0.3
    counts, p_ext, d = np.array([10.0, 64.0, 3.0]), 0.002, 0.4
    p0 = _sym(rng, n_sys, 0.5)
    if iso:
        p0 = p0[:, :1, :1] * np.eye(3)
    vol = np.abs(np.linalg.det(cell))
    k2 = np.trace(kin, axis1=1, axis2=2)
    if iso:
        force = k2 - vol * np.trace(stress, axis1=1, axis2=2) - 3 * vol * p_ext + k2 / counts
        want = p0.copy()
        want[:, 0, 0] += d * force
    else:
        f = kin - vol[:, None, None] * stress
        f += (k2 / (3 * counts) - vol * p_ext)[:, None, None] * np.eye(3)
        want = p0 + d * 0.5 * (f + f.transpose(0, 2, 1))
    rows = [torch.from_numpy(a.reshape(n_sys, 9).copy()) for a in (kin, stress, cell, p0)]
    kernel = SystemKernel(cell_kick_kernel, n_sys, torch.device("cpu"))
    kernel(rows[0], rows[1], rows[2], torch.from_numpy(counts), torch.tensor([p_ext], dtype=torch.float64),
           d, int(iso), rows[3])  # fmt: skip
    np.testing.assert_allclose(rows[3].numpy().reshape(-1, 3, 3), want, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_sys", [1, 3])
def test_the_row_update_is_y_e_plus_c_z_phi_in_place(dtype: torch.dtype, n_sys: int) -> None:
    """One thread per atom: ``y E + c (z / m) Phi`` with its system's matrices,
    in float64, written back in place in the batch's dtype; a second call with
    other rows and another role (no division) reuses nothing stale."""
    g = torch.Generator().manual_seed(7)
    n = 11
    y = torch.randn(n, 3, generator=g, dtype=torch.float64)
    z = torch.randn(n, 3, generator=g, dtype=torch.float64)
    m = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    si = torch.randint(0, n_sys, (n,), generator=g)
    e = torch.randn(n_sys, 9, generator=g, dtype=torch.float64)
    phi = torch.randn(n_sys, 9, generator=g, dtype=torch.float64)
    rows = RowKernel(torch.device("cpu"))
    for divide in (True, False, True):
        ys, zs, ms = y.to(dtype), z.to(dtype), m.to(dtype)
        zz = zs.double() / ms.double()[:, None] if divide else zs.double()
        ee, pp = e.view(-1, 3, 3)[si], phi.view(-1, 3, 3)[si]
        want = torch.bmm(ys.double().unsqueeze(1), ee).squeeze(1)
        want = want + 0.3 * torch.bmm(zz.unsqueeze(1), pp).squeeze(1)
        rows(ys, zs, ms, si, e, phi, 0.3, divide, ys)  # (in place)
        torch.testing.assert_close(ys.double(), want.to(dtype).double(), rtol=0, atol=1e-12)
        y, z, m, si = y[1:].clone(), z[1:].clone(), m[1:].clone(), si[1:].clone()


class AnchoredSprings(torch.nn.Module):
    """Harmonic springs to anchors that move with the cell (fixed fractional
    coordinates): forces, energy and stress from torch operations only (no host
    read), so its forward can be captured."""

    def __init__(self, k: float = 0.4) -> None:
        super().__init__()
        self.k = k
        self.frac: torch.Tensor | None = None

    def graph_key(self, batch: Batch) -> Hashable | None:
        return ("anchored-springs", self.k)

    def forward(self, batch: Batch) -> ModelOutputs:
        cell = batch.cell
        if self.frac is None:
            self.frac = batch.positions.detach() @ torch.linalg.inv(cell[0])
        d = batch.positions - self.frac @ cell[0]
        e_atom = 0.5 * self.k * (d * d).sum(dim=1)
        vol = torch.linalg.det(cell).abs()
        virial = self.k * (d.unsqueeze(2) * d.unsqueeze(1)).sum(dim=0)
        return {
            "forces": -self.k * d,
            "energy": e_atom.sum().reshape(1),
            "atom_energies": e_atom,
            "stress": (virial / vol[0]).unsqueeze(0),
        }


def _crystal(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    cell = torch.tensor([[6.0, 0.0, 0.0], [0.7, 5.5, 0.0], [-0.4, 0.6, 6.2]], dtype=torch.float64)
    frac = torch.rand(20, 3, generator=g, dtype=torch.float64)
    return Batch(
        positions=frac @ cell + 0.05 * torch.randn(20, 3, generator=g, dtype=torch.float64),
        atomic_numbers=torch.full((20,), 18),
        velocities=torch.randn(20, 3, generator=g, dtype=torch.float64) * 0.02,
        cell=cell,
        pbc=[True] * 3,
    )


@pytest.mark.parametrize("dof", [CellDOF.ISOTROPIC, CellDOF.FULL])
def test_npt_steps_are_replayed_and_equal_eager_steps(dof: CellDOF) -> None:
    """The chains, the cell momentum and the cell live on the device: a steady
    NPT step is captured (here the CPU emulation, which raises on any host
    read inside the capture) and its replays equal eager steps bit for bit,
    cell and conserved energy included. A new target pressure changes the
    step's key: the next steps run eagerly, then are captured again."""

    def run(graphs: bool) -> Any:
        dyn = MTKNPT(AnchoredSprings(), _crystal(), dt_fs=1.0, temperature_K=200.0,
                     pressure_bar=2.0e4, tau_t_fs=20.0, tau_p_fs=60.0, cell_dof=dof,
                     cuda_graphs=graphs)  # fmt: skip
        dyn.register_hook(HookStage.AFTER_COMPUTE, lambda ctx: None, every=13)  # eager steps too
        with emulated_capture():
            dyn.run(20)
            dyn.pressure_bar = -1.0e4
            dyn.run(20)
        return dyn

    eager, graphed = run(False), run(True)
    for name in ("positions", "velocities", "forces", "cell", "stress", "energy"):
        assert torch.equal(getattr(graphed.batch, name), getattr(eager.batch, name)), name
    assert torch.equal(graphed.conserved_energy(), eager.conserved_energy())
    assert graphed.graphs.captures >= 4 and graphed.graphs.replays > 20
    assert eager.graphs.captures == 0
    start = _crystal().cell[0]
    assert float((eager.batch.cell[0] - start).abs().max()) > 1e-3  # the barostat did work
    if dof is CellDOF.ISOTROPIC:  # the shape is kept: the cell is a multiple of the first
        ratio = eager.batch.cell[0, 0, 0] / start[0, 0]
        torch.testing.assert_close(eager.batch.cell[0], start * ratio, rtol=1e-13, atol=1e-13)


def test_a_diverged_barostat_raises_naming_the_cell_momentum() -> None:
    dyn = MTKNPT(AnchoredSprings(), _crystal(), temperature_K=200.0, cell_dof=CellDOF.FULL)
    dyn.run(2)
    assert dyn.barostat is not None
    dyn.barostat.p_xi[:, 0] = -1.0e300  # (exp overflows in the next half step)
    with pytest.raises(ValidationError, match=r"MTKNPT diverged.*cell momentum"):
        dyn.step()
