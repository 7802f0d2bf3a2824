"""nvdd.core.maxwell_boltzmann: the one thermal-velocity sampler of nvdd."""

from __future__ import annotations

import torch

from nvdd.core import KB_EV_PER_K, maxwell_boltzmann


def _temperature(masses: torch.Tensor, v: torch.Tensor) -> float:
    """Kinetic temperature of all atoms (3 N degrees of freedom), in K."""
    ke = 0.5 * (masses.double()[:, None] * v.double() ** 2).sum()
    return float(2.0 * ke / (3.0 * masses.shape[0] * KB_EV_PER_K))


def test_the_draw_has_the_temperature_equipartition_and_zero_momentum_per_system() -> None:
    """Two systems of a light/heavy mixture: every species at the requested
    temperature (kT per degree of freedom, whatever its mass), and the total
    momentum of each system zero."""
    n = 20_000
    masses = torch.where(torch.arange(n) % 3 == 0, 1.008, 39.948).double()
    system = (torch.arange(n) >= n // 2).long()
    v = maxwell_boltzmann(masses, 300.0, seed=7, system_index=system)
    assert v.shape == (n, 3) and v.dtype == torch.float64
    # 3 n / 3 degrees of freedom per species: relative spread about sqrt(2 / (3 n_species)) < 2 %
    for light in (True, False):
        rows = (masses < 2.0) == light
        assert abs(_temperature(masses[rows], v[rows]) / 300.0 - 1.0) < 0.05
    for s in (0, 1):
        rows = system == s
        momentum = (masses[rows, None] * v[rows]).sum(0)
        assert momentum.abs().max() < 1e-9
    # one system: only the total momentum is zero, not that of each half
    w = maxwell_boltzmann(masses, 300.0, seed=7)
    assert (masses[:, None] * w).sum(0).abs().max() < 1e-9
    assert (masses[: n // 2, None] * w[: n // 2]).sum(0).abs().max() > 1e-3


def test_the_draw_is_the_same_in_every_dtype_and_from_a_seed_or_its_generator() -> None:
    masses = torch.full((50,), 39.948)
    v32 = maxwell_boltzmann(masses, 90.0, seed=3)  # float32 masses: float32 result
    v64 = maxwell_boltzmann(masses.double(), 90.0, seed=3)
    assert v32.dtype == torch.float32 and torch.equal(v32, v64.float())
    assert torch.equal(maxwell_boltzmann(masses, 90.0, seed=3, dtype=torch.float64), v64)
    g = torch.Generator().manual_seed(3)
    assert torch.equal(maxwell_boltzmann(masses.double(), 90.0, generator=g), v64)
    again = maxwell_boltzmann(masses.double(), 90.0, generator=g)  # the stream goes on
    assert not torch.allclose(again, v64)
    assert torch.equal(maxwell_boltzmann(masses, 0.0), torch.zeros(50, 3))
    assert maxwell_boltzmann(masses[:0], 90.0).shape == (0, 3)
