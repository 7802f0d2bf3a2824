"""Thermal velocities: the one Maxwell-Boltzmann sampler of nvdd.

Units are ASE's, as everywhere in nvdd: masses in amu, energies in eV, lengths in
Angstrom, so a velocity is in Angstrom per ASE time unit and ``m v**2`` is in eV.
"""

from __future__ import annotations

import torch

__all__ = ["KB_EV_PER_K", "maxwell_boltzmann"]

#: Boltzmann's constant in eV per kelvin (CODATA 2018).
KB_EV_PER_K = 8.617333262e-5


def maxwell_boltzmann(
    masses: torch.Tensor,
    temperature_K: float,
    *,
    seed: int = 0,
    generator: torch.Generator | None = None,
    system_index: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Velocities, shape ``(n_atoms, 3)``, drawn from the Maxwell-Boltzmann
    distribution at ``temperature_K`` for ``masses`` (amu), with zero total
    momentum (mass-weighted) in every system.

    The draw is made on the CPU in float64, so it is the same on every device and
    in every dtype: from ``generator`` when given (a CPU generator; its stream
    continues, e.g. after the positions were jittered from it), else from a fresh
    generator seeded with ``seed``. ``system_index`` (one entry per atom) names
    the system of each atom; without it all atoms form one system. The result is
    in ``dtype`` (default: that of ``masses``) on the device of ``masses``.

    The temperature of the result is not rescaled to ``temperature_K``: it
    fluctuates around it by about ``sqrt(2 / (3 n_atoms))`` relative.
    """
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    m = masses.detach().cpu().double()
    v = torch.randn(m.shape[0], 3, generator=g, dtype=torch.float64)
    v = v * torch.sqrt(KB_EV_PER_K * temperature_K / m)[:, None]
    if system_index is None:
        index = torch.zeros(m.shape[0], dtype=torch.long)
    else:
        index = system_index.detach().cpu().long()
    n_systems = int(index.max()) + 1 if index.numel() else 0
    momentum = torch.zeros(n_systems, 3, dtype=torch.float64).index_add(0, index, m[:, None] * v)
    mass = torch.zeros(n_systems, dtype=torch.float64).index_add(0, index, m)
    v = v - (momentum / mass[:, None]).index_select(0, index)
    return v.to(dtype=dtype if dtype is not None else masses.dtype, device=masses.device)
