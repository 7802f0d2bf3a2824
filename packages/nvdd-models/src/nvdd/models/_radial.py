"""Radial features of an edge: a Bessel basis times a smooth cutoff envelope.

``b_n(r) = sqrt(2 / rc) sin(n pi r / rc) / r`` for ``n = 1..K`` (the zeroth-order
spherical Bessel functions that vanish at the cutoff), multiplied by the
polynomial envelope ``u(d)``, ``d = r / rc``:

``u(d) = 1 - (p+1)(p+2)/2 d**p + p(p+2) d**(p+1) - p(p+1)/2 d**(p+2)`` for
``d < 1``, else 0.

``u(1) = u'(1) = u''(1) = 0``, so anything linear (without bias) in these
features goes to zero smoothly at the cutoff and the energy is continuous, with
continuous forces, when a pair crosses it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["bessel_basis", "polynomial_envelope", "radial_features"]


def polynomial_envelope(d: torch.Tensor, p: int) -> torch.Tensor:
    """The envelope ``u(d)`` above; ``d = r / cutoff``, any shape."""
    a = -(p + 1) * (p + 2) / 2.0
    b = float(p * (p + 2))
    c = -p * (p + 1) / 2.0
    dp = d**p
    u = 1.0 + dp * (a + d * (b + c * d))
    return torch.where(d < 1.0, u, torch.zeros_like(u))


def bessel_basis(r: torch.Tensor, cutoff: float, n_basis: int) -> torch.Tensor:
    """``b_n(r)``, shape ``(*r.shape, n_basis)``; ``r`` must be positive."""
    n = torch.arange(1, n_basis + 1, dtype=r.dtype, device=r.device)
    arg = (math.pi / cutoff) * r.unsqueeze(-1) * n
    return math.sqrt(2.0 / cutoff) * torch.sin(arg) / r.unsqueeze(-1)


def radial_features(r: torch.Tensor, cutoff: float, n_basis: int, p: int) -> torch.Tensor:
    """``b_n(r) u(r / cutoff)``, shape ``(n_edges, n_basis)``."""
    return bessel_basis(r, cutoff, n_basis) * polynomial_envelope(r / cutoff, p).unsqueeze(-1)
