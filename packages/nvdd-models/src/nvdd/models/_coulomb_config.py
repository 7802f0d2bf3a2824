"""Accuracy parameters of the Ewald and PME models (:class:`EwaldConfig`, :class:`PMEConfig`).

Every parameter is fixed by the configuration alone (never by the number of
atoms a process holds), so every rank of a decomposed run and the
single-process reference use exactly the same splitting, k-vectors and mesh.

Units: Angstrom, elementary charges, eV. The Coulomb constant is
:data:`COULOMB_EV_A` (``e^2 / (4 pi eps0)`` in eV Angstrom, CODATA 2018).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nvdd.models._checks import check_positive, config_error

__all__ = ["COULOMB_EV_A", "EwaldConfig", "PMEConfig"]

#: ``e^2 / (4 pi eps0)`` in eV Angstrom (CODATA 2018).
COULOMB_EV_A = 14.399645478425668


def _splitting(cutoff: float, accuracy: float, alpha: float | None) -> float:
    """``alpha`` if given, else the one that makes ``erfc(alpha rc) ~ accuracy``."""
    if alpha is not None:
        check_positive("alpha", alpha)
        return float(alpha)
    return math.sqrt(-math.log(accuracy)) / cutoff


@dataclass(frozen=True)
class EwaldConfig:
    """Ewald summation: real space within ``cutoff``, reciprocal space within ``k_cutoff``.

    Parameters
    ----------
    cutoff:
        Real-space cutoff (Angstrom); also the model's halo cutoff.
    accuracy:
        Target relative accuracy; sets ``alpha`` and ``k_cutoff`` when they are
        not given (``erfc(alpha rc) ~ exp(-k^2 / 4 alpha^2) ~ accuracy``).
    alpha:
        Splitting parameter (1/Angstrom); default from ``accuracy``.
    k_cutoff:
        Reciprocal-space cutoff (1/Angstrom); default ``2 alpha sqrt(-ln accuracy)``.
    skin:
        Verlet skin of the model's own neighbour list (Angstrom).
    """

    cutoff: float
    accuracy: float = 1e-6
    alpha: float | None = None
    k_cutoff: float | None = None
    skin: float = 0.0

    def __post_init__(self) -> None:
        check_positive("EwaldConfig.cutoff", self.cutoff)
        check_positive("EwaldConfig.skin", self.skin, allow_zero=True)
        if not (isinstance(self.accuracy, int | float) and 0.0 < self.accuracy < 1.0):
            raise config_error(f"EwaldConfig.accuracy must be in (0, 1), got {self.accuracy!r}")
        if self.k_cutoff is not None:
            check_positive("EwaldConfig.k_cutoff", self.k_cutoff)

    @property
    def resolved_alpha(self) -> float:
        """The splitting parameter in use (1/Angstrom)."""
        return _splitting(self.cutoff, self.accuracy, self.alpha)

    @property
    def resolved_k_cutoff(self) -> float:
        """The reciprocal-space cutoff in use (1/Angstrom)."""
        if self.k_cutoff is not None:
            return float(self.k_cutoff)
        return 2.0 * self.resolved_alpha * math.sqrt(-math.log(self.accuracy))


@dataclass(frozen=True)
class PMEConfig:
    """Particle-mesh Ewald: real space within ``cutoff``, reciprocal space on a mesh.

    Parameters
    ----------
    cutoff:
        Real-space cutoff (Angstrom); also the model's halo cutoff.
    accuracy:
        Sets ``alpha`` when it is not given (``erfc(alpha rc) ~ accuracy``).
    alpha:
        Splitting parameter (1/Angstrom).
    mesh:
        Mesh points along the three cell vectors. Default: from ``mesh_spacing``.
    mesh_spacing:
        Largest mesh spacing (Angstrom) when ``mesh`` is not given: each
        dimension is the smallest FFT-friendly size (2, 3, 5 factors) with
        ``|a_i| / n_i <= mesh_spacing``. The mesh then depends on the cell, which
        every rank knows whole.
    spline_order:
        B-spline order of charge assignment (2 to 6; 4 is cubic).
    skin:
        Verlet skin of the model's own neighbour list (Angstrom).
    """

    cutoff: float
    accuracy: float = 1e-6
    alpha: float | None = None
    mesh: tuple[int, int, int] | None = None
    mesh_spacing: float = 1.0
    spline_order: int = 4
    skin: float = 0.0

    def __post_init__(self) -> None:
        check_positive("PMEConfig.cutoff", self.cutoff)
        check_positive("PMEConfig.skin", self.skin, allow_zero=True)
        check_positive("PMEConfig.mesh_spacing", self.mesh_spacing)
        if not (isinstance(self.accuracy, int | float) and 0.0 < self.accuracy < 1.0):
            raise config_error(f"PMEConfig.accuracy must be in (0, 1), got {self.accuracy!r}")
        if self.mesh is not None:
            mesh = tuple(self.mesh)
            if len(mesh) != 3 or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 4 for n in mesh
            ):
                raise config_error(f"PMEConfig.mesh must be three integers >= 4, got {self.mesh!r}")
            object.__setattr__(self, "mesh", mesh)
        order = self.spline_order
        if isinstance(order, bool) or not isinstance(order, int) or not 2 <= order <= 6:
            raise config_error(f"PMEConfig.spline_order must be an int in 2..6, got {order!r}")

    @property
    def resolved_alpha(self) -> float:
        """The splitting parameter in use (1/Angstrom)."""
        return _splitting(self.cutoff, self.accuracy, self.alpha)

    def mesh_for(self, lengths: tuple[float, float, float]) -> tuple[int, int, int]:
        """The mesh for cell vectors of these lengths (Angstrom)."""
        if self.mesh is not None:
            return self.mesh
        dims = [_fft_size(max(4, math.ceil(length / self.mesh_spacing))) for length in lengths]
        return dims[0], dims[1], dims[2]


def _fft_size(n: int) -> int:
    """The smallest integer >= ``n`` whose only prime factors are 2, 3 and 5."""
    while True:
        m = n
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        if m == 1:
            return n
        n += 1
