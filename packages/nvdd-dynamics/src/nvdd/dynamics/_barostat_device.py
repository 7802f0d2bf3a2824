"""The MTK barostat's per-system arithmetic on the atoms' device.

:class:`~nvdd.dynamics.MTKNPT` keeps its cell momentum, cell and step sums in
float64 tensors on the atoms' device. Two pieces of its step are a few dozen
operations on a few numbers per system; each is one Warp kernel here (one
thread per system), launched from a recorded command, so a step reads nothing
on the host and can be captured in a CUDA graph:

``cell_kick``
    The cell momentum over ``d`` under the pressure difference (MTK's
    ``G_epsilon``): isotropic, one number per system (element 0 of its row);
    full, a symmetric 3x3.
``propagators``
    ``E = exp(G)`` and ``Phi = (exp(G) - 1) / G`` of the symmetric strain
    matrix ``G`` of a kick (the friction of the cell on the velocities) or a
    drift (the affine growth of positions and cell), by a Taylor series of
    degree 16 after scaling ``G`` to a norm <= 1/2, then squaring back
    (``Phi(2G) = Phi(G) (E(G) + 1) / 2``). No eigendecomposition: a batched
    ``eigh`` on CUDA waits for the host (it checks its convergence there).
    Isotropic strain is ``x * 1``, for which the series gives ``exp(x)`` and
    ``expm1(x) / x`` on the diagonal and exact zeros elsewhere.

A particle update is then ``y E + c z Phi`` per atom, one more kernel
(``affine_rows``, one thread per atom, float64 arithmetic, written back in the
batch's dtype, in place): velocities ``(v, F / m)`` over a kick, positions
``(r, v)`` over a drift; the cell's rows grow as ``h E``. As torch operations
that update was 13 launches over the atoms per kick or drift.
"""

from __future__ import annotations

from typing import Any

import torch

from nvdd.core import RecordedKernel
from nvdd.dynamics._barostat_kernels import (
    affine_rows_kernel,
    cell_kick_kernel,
    propagators_kernel,
)

__all__ = [
    "RowKernel",
    "SystemKernel",
    "affine_rows_kernel",
    "cell_kick_kernel",
    "propagators_kernel",
]


class RowKernel:
    """``affine_rows_kernel`` over the atoms (``nvdd.core.RecordedKernel``: one
    recorded launch per dtype and role, whose changed arguments are set before
    it runs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._kernel = RecordedKernel(affine_rows_kernel, doubles=(6,), prepare=_declare_rows)

    def __call__(
        self,
        y: torch.Tensor,
        z: torch.Tensor,
        masses: torch.Tensor,
        system: torch.Tensor,
        e: torch.Tensor,
        phi: torch.Tensor,
        c: float,
        divide: bool,
        out: torch.Tensor,
    ) -> None:
        """``out = y E + c z Phi`` row by row (module notes); ``out`` may be ``y``."""
        args = (y, z, masses, system, e, phi, float(c), int(divide), int(e.shape[0] == 1), out)
        # one record per role (a kick divides by the masses, a drift not): each
        # keeps its own tensors, so alternating kicks and drifts resets nothing
        self._kernel(int(y.shape[0]), args, self.device, role=bool(divide))


def _declare_rows() -> None:
    """The float32 and float64 overloads of ``affine_rows_kernel``, declared
    before the module's first launch (else Warp compiles the module twice)."""
    RecordedKernel(affine_rows_kernel).declare_overloads()


class SystemKernel:
    """One of this module's kernels over the systems of one integrator, with its
    tensors fixed (``nvdd.core.RecordedKernel``: one recorded launch per set of
    scalars, so a call resets nothing)."""

    def __init__(self, kernel: Any, n_systems: int, device: torch.device) -> None:
        self.kernel, self.n_systems, self.device = kernel, int(n_systems), device
        self._launcher: RecordedKernel | None = None

    def __call__(self, *args: Any) -> None:
        """Launch with ``args`` (tensors, Python floats for ``float64``
        parameters, ints), the same tensors at every call."""
        if self._launcher is None:
            doubles = [k for k, a in enumerate(args) if isinstance(a, float)]
            self._launcher = RecordedKernel(self.kernel, doubles=doubles, prepare=_declare_rows)
        role = tuple(a for a in args if not isinstance(a, torch.Tensor))
        self._launcher(self.n_systems, args, self.device, role=role)
