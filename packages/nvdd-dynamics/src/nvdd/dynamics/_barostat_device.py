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

A particle update is then ``y E + c z Phi`` per atom (torch, in the batch's
dtype): velocities ``(v, F / m)`` over a kick, positions ``(r, v)`` over a
drift; the cell's rows grow as ``h E``.
"""

from __future__ import annotations

from typing import Any

import torch
import warp as wp

from nvdd.core import capturing, record_launch, warp_stream
from nvdd.dynamics._chain_device import warp_ready

__all__ = ["SystemKernel", "cell_kick_kernel", "propagators_kernel"]

#: Warp's Python API, untyped for mypy (its stubs type the kernel language, not this use).
_wp: Any = wp
_F64 = wp.float64
_M33 = wp.mat33d
#: Terms of the Taylor series of ``Phi`` (``G**k / (k + 1)!`` up to this ``k``):
#: at a norm <= 1/2 the first term left out is below 1e-19 of the sum.
_DEGREE = 16
#: Most halvings of ``G`` (a norm of 2**60 is far past any physical strain rate;
#: the results are then not finite, which the integrator's flag reports).
_MAX_HALVINGS = 60


@wp.func
def _row(a: wp.array2d(dtype=_F64), s: int) -> wp.mat33d:  # type: ignore[valid-type]
    return _M33(
        a[s, 0], a[s, 1], a[s, 2], a[s, 3], a[s, 4], a[s, 5], a[s, 6], a[s, 7], a[s, 8]
    )  # fmt: skip


@wp.func
def _store(a: wp.array2d(dtype=_F64), s: int, m: wp.mat33d) -> None:  # type: ignore[valid-type]
    for i in range(3):
        for j in range(3):
            a[s, 3 * i + j] = m[i, j]


@wp.kernel
def cell_kick_kernel(
    kin: wp.array2d(dtype=_F64),  # type: ignore[valid-type]
    stress: wp.array2d(dtype=_F64),  # type: ignore[valid-type]
    cell: wp.array2d(dtype=_F64),  # type: ignore[valid-type]
    counts: wp.array(dtype=_F64),  # type: ignore[valid-type]
    p_ext: wp.array(dtype=_F64),  # type: ignore[valid-type]
    d: _F64,
    iso: int,
    p_cell: wp.array2d(dtype=_F64),  # type: ignore[valid-type]
) -> None:
    """System ``s``'s cell momentum over ``d`` (rows of 9, row-major):
    isotropic ``k2 - V tr(sigma) - 3 V P + k2 / N`` on element 0; full the
    symmetric part of ``K - V sigma + (k2 / 3N - V P) 1``."""
    s = wp.tid()
    k = _row(kin, s)
    sigma = _row(stress, s)
    vol = wp.abs(wp.determinant(_row(cell, s)))
    n = counts[s]
    p = p_ext[0]
    k2 = k[0, 0] + k[1, 1] + k[2, 2]
    if iso != 0:
        trace = sigma[0, 0] + sigma[1, 1] + sigma[2, 2]
        force = k2 - vol * trace - _F64(3.0) * vol * p + k2 / n
        p_cell[s, 0] = p_cell[s, 0] + d * force
    else:
        eye = wp.identity(n=3, dtype=_F64)
        f = k - vol * sigma + (k2 / (_F64(3.0) * n) - vol * p) * eye
        f = _F64(0.5) * (f + wp.transpose(f))
        _store(p_cell, s, _row(p_cell, s) + d * f)


@wp.kernel
def propagators_kernel(
    p_cell: wp.array2d(dtype=_F64),  # type: ignore[valid-type]
    w: wp.array(dtype=_F64),  # type: ignore[valid-type]
    counts: wp.array(dtype=_F64),  # type: ignore[valid-type]
    d: _F64,
    kick: int,
    iso: int,
    e_out: wp.array2d(dtype=_F64),  # type: ignore[valid-type]
    phi_out: wp.array2d(dtype=_F64),  # type: ignore[valid-type]
) -> None:
    """``exp(G)`` and ``(exp(G) - 1) / G`` of system ``s`` (module notes):
    ``G = R d`` for a drift, ``-(R + tr(R) / 3N) d`` for a kick, where
    ``R = p_cell / W`` is the strain rate."""
    s = wp.tid()
    eye = wp.identity(n=3, dtype=_F64)
    rate = _row(p_cell, s) / w[s]
    if iso != 0:
        rate = (p_cell[s, 0] / w[s]) * eye
    g = rate * d
    if kick != 0:
        trace = (rate[0, 0] + rate[1, 1] + rate[2, 2]) / (_F64(3.0) * counts[s])
        g = -(rate + trace * eye) * d
    norm = _F64(0.0)
    for i in range(3):
        norm = wp.max(norm, wp.abs(g[i, 0]) + wp.abs(g[i, 1]) + wp.abs(g[i, 2]))
    halvings = int(0)  # noqa: UP018, RUF046 (a Warp variable the loop may change)
    while norm > _F64(0.5) and halvings < _MAX_HALVINGS:
        norm = norm * _F64(0.5)
        g = g * _F64(0.5)
        halvings += 1
    # Phi = 1 + G/2! + G^2/3! + ... = 1 + G/2 (1 + G/3 (1 + ... (1 + G/(K+1))))
    phi = eye
    for j in range(_DEGREE):
        phi = eye + (g * phi) / _F64(_DEGREE + 1 - j)
    e = eye + g * phi
    for _ in range(halvings):
        phi = _F64(0.5) * (phi * (e + eye))
        e = e * e
    _store(e_out, s, e)
    _store(phi_out, s, phi)


class SystemKernel:
    """One of this module's kernels over the systems of one integrator, with its
    tensors fixed: launched from a recorded command per set of scalars (a few
    microseconds of Python), on torch's current stream on CUDA; registered with
    an emulated capture; a plain launch on a test's fake device."""

    def __init__(self, kernel: Any, n_systems: int, device: torch.device) -> None:
        self.kernel, self.n_systems, self.device = kernel, int(n_systems), device
        self._records: dict[tuple[Any, ...], Any] = {}

    def __call__(self, *args: Any) -> None:
        """Launch with ``args`` (tensors, Python floats for ``float64``
        parameters, ints), the same tensors at every call."""
        key = tuple(a for a in args if not isinstance(a, torch.Tensor))
        launch = self._records.get(key)
        if launch is None and self.device.type in ("cpu", "cuda"):
            warp_ready()
            launch = self._records[key] = _wp.launch(
                self.kernel, dim=self.n_systems, inputs=self._inputs(args),
                device=_wp.device_from_torch(self.device), record_cmd=True,
            )  # fmt: skip
        self._run(launch, args)
        if capturing():  # an emulated capture replays the launch (a CUDA one records it)
            record_launch(lambda: self._run(launch, args))

    def _inputs(self, args: tuple[Any, ...]) -> list[Any]:
        return [
            _wp.from_torch(a, requires_grad=False) if isinstance(a, torch.Tensor)
            else _F64(a) if isinstance(a, float) else a
            for a in args
        ]  # fmt: skip

    def _run(self, launch: Any, args: tuple[Any, ...]) -> None:
        if self.device.type == "cuda":
            launch.launch(stream=warp_stream(torch.cuda.current_stream(self.device)))
        elif launch is not None:
            launch.launch()
        else:  # a test's fake device: a plain launch, which its checks see
            warp_ready()
            _wp.launch(self.kernel, dim=self.n_systems, inputs=self._inputs(args),
                       device=_wp.device_from_torch(self.device))  # fmt: skip
