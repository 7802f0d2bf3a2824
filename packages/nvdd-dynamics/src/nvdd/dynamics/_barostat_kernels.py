"""Warp kernels of the MTK barostat (see :mod:`nvdd.dynamics._barostat_device`).

Written in Warp's kernel language, which mypy cannot type; the codes disabled
below are the ones that language trips (the launchers in ``_barostat_device``
are checked as usual).
"""

# mypy: disable-error-code="valid-type,misc,no-untyped-def,untyped-decorator,arg-type,assignment,operator,index,no-any-return,name-defined,call-overload,attr-defined,return-value,call-arg,type-var"

from __future__ import annotations

from typing import Any

import warp as wp

__all__ = ["affine_rows_kernel", "cell_kick_kernel", "propagators_kernel"]

_F64 = wp.float64
_M33 = wp.mat33d
#: Terms of the Taylor series of ``Phi`` (``G**k / (k + 1)!`` up to this ``k``):
#: at a norm <= 1/2 the first term left out is below 1e-19 of the sum.
_DEGREE = 16
#: Most halvings of ``G`` (a norm of 2**60 is far past any physical strain rate;
#: the results are then not finite, which the integrator's flag reports).
_MAX_HALVINGS = 60


@wp.func
def _row(a: wp.array2d(dtype=_F64), s: int) -> wp.mat33d:
    return _M33(
        a[s, 0], a[s, 1], a[s, 2], a[s, 3], a[s, 4], a[s, 5], a[s, 6], a[s, 7], a[s, 8]
    )  # fmt: skip


@wp.func
def _store(a: wp.array2d(dtype=_F64), s: int, m: wp.mat33d) -> None:
    for i in range(3):
        for j in range(3):
            a[s, 3 * i + j] = m[i, j]


@wp.kernel
def cell_kick_kernel(
    kin: wp.array2d(dtype=_F64),
    stress: wp.array2d(dtype=_F64),
    cell: wp.array2d(dtype=_F64),
    counts: wp.array(dtype=_F64),
    p_ext: wp.array(dtype=_F64),
    d: _F64,
    iso: int,
    p_cell: wp.array2d(dtype=_F64),
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
    p_cell: wp.array2d(dtype=_F64),
    w: wp.array(dtype=_F64),
    counts: wp.array(dtype=_F64),
    d: _F64,
    kick: int,
    iso: int,
    e_out: wp.array2d(dtype=_F64),
    phi_out: wp.array2d(dtype=_F64),
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


@wp.kernel
def affine_rows_kernel(
    y: wp.array2d(dtype=Any),
    z: wp.array2d(dtype=Any),
    masses: wp.array(dtype=Any),
    system: wp.array(dtype=wp.int64),
    e: wp.array2d(dtype=_F64),
    phi: wp.array2d(dtype=_F64),
    c: _F64,
    divide: int,
    one_system: int,
    out: wp.array2d(dtype=Any),
) -> None:
    """Row ``i``: ``out = y E + c z' Phi`` of its system, ``z' = z / m`` when
    ``divide`` (float64 arithmetic; ``out`` may be ``y``: the row is read first)."""
    i = wp.tid()
    s = 0
    if one_system == 0:
        s = int(system[i])
    y0, y1, y2 = _F64(y[i, 0]), _F64(y[i, 1]), _F64(y[i, 2])
    z0, z1, z2 = _F64(z[i, 0]), _F64(z[i, 1]), _F64(z[i, 2])
    if divide != 0:
        m = _F64(masses[i])
        z0, z1, z2 = z0 / m, z1 / m, z2 / m
    for b in range(3):
        grown = y0 * e[s, b] + y1 * e[s, 3 + b] + y2 * e[s, 6 + b]
        moved = z0 * phi[s, b] + z1 * phi[s, 3 + b] + z2 * phi[s, 6 + b]
        out[i, b] = type(y[i, 0])(grown + c * moved)
