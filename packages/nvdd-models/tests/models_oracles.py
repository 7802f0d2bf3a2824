"""Independent numpy oracles of the long-range tests (no toolkit kernel, no torch model)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from nvdd.models import COULOMB_EV_A


def erfc(x: np.ndarray) -> np.ndarray:
    """The complementary error function, elementwise (float64)."""
    return torch.special.erfc(torch.from_numpy(np.asarray(x, dtype=np.float64))).numpy()


def direct_ewald(
    pos: np.ndarray, q: np.ndarray, cell: np.ndarray, alpha: float, rc: float, kc: float
) -> tuple[float, np.ndarray]:
    """Ewald energy (eV) and forces of point charges, summed directly in numpy.

    Real space over every image within ``rc``, reciprocal space over the FULL
    k-lattice within ``kc`` (both signs), self and background terms. With
    converged ``rc`` / ``kc`` the result does not depend on ``alpha``, which the
    tests use to make the check independent of the model's splitting.
    """
    inv = np.linalg.inv(cell)
    volume = abs(np.linalg.det(cell))
    heights = 1.0 / np.linalg.norm(inv, axis=0)
    reach = [math.ceil(rc / h) + 1 for h in heights]
    energy = 0.0
    forces = np.zeros_like(pos)
    for s in itertools.product(*(range(-m, m + 1) for m in reach)):
        shift = np.asarray(s, dtype=np.float64) @ cell
        d = pos[None, :, :] + shift - pos[:, None, :]  # r_j + S - r_i
        r = np.sqrt((d * d).sum(-1))
        mask = (r < rc) & (r > 1e-12)
        rr = np.where(mask, r, 1.0)
        qq = q[:, None] * q[None, :]
        energy += 0.5 * float((np.where(mask, qq * erfc(alpha * rr) / rr, 0.0)).sum())
        gauss = 2 * alpha / math.sqrt(math.pi) * np.exp(-((alpha * rr) ** 2))
        mag = qq * (erfc(alpha * rr) / rr**3 + gauss / rr**2)
        fij = np.where(mask[..., None], mag[..., None] * d, 0.0)  # force on j from i
        forces -= fij.sum(1)
    recip = 2.0 * math.pi * inv.T
    kreach = [math.ceil(kc / np.linalg.norm(recip[a])) + 1 for a in range(3)]
    for m in itertools.product(*(range(-k, k + 1) for k in kreach)):
        if m == (0, 0, 0):
            continue
        k = np.asarray(m, dtype=np.float64) @ recip
        k2 = float(k @ k)
        if k2 > kc * kc:
            continue
        phase = pos @ k
        rho = complex((q * np.cos(phase)).sum(), (q * np.sin(phase)).sum())
        g = 4.0 * math.pi / (volume * k2) * math.exp(-k2 / (4 * alpha * alpha))
        energy += 0.5 * g * abs(rho) ** 2
        # dE/dr_i = g q_i Im(exp(-i k r_i) rho) k ... force = -dE/dr_i
        im = q * (np.sin(phase) * rho.real - np.cos(phase) * rho.imag)
        forces += g * im[:, None] * k[None, :]
    qt = float(q.sum())
    energy -= alpha / math.sqrt(math.pi) * float((q * q).sum())
    energy -= math.pi * qt * qt / (2 * alpha * alpha * volume)
    return COULOMB_EV_A * energy, COULOMB_EV_A * forces
