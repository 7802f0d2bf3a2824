"""The Warp kernel of a step's local decision (launcher: ``_step.local_code``).

Written in Warp's kernel language, which mypy cannot type; the codes disabled
below are the ones that language trips.

One thread per owned row reads its position, reference position, velocity and
force once (4 x 3 values) and raises the rank's code with one atomic when the
row is not finite (``bad``) or moved more than the skin allows (``rebuild``):
about 48 bytes a row in float32, where the same test in torch operations reads
and writes about 300 (float64 copies, squares, sums, flags) in some fifteen
kernels.
"""

# mypy: disable-error-code="valid-type,misc,no-untyped-def,untyped-decorator,arg-type,assignment,operator,index,no-any-return,name-defined,call-overload,attr-defined,return-value,call-arg,type-var"

from __future__ import annotations

from typing import Any

import warp as wp

__all__ = ["decision_kernel"]


@wp.kernel
def decision_kernel(
    positions: wp.array2d(dtype=Any),
    reference: wp.array2d(dtype=Any),
    velocities: wp.array2d(dtype=Any),
    forces: wp.array2d(dtype=Any),
    n_reference: int,
    limit2: wp.float64,
    max_coordinate: wp.float64,
    use_moved: int,
    moved: wp.array(dtype=wp.int32),
    rebuild: wp.int32,
    bad: wp.int32,
    code: wp.array(dtype=wp.int32),
) -> None:
    """Row ``i``: ``code[0] = max(code[0], c)`` where ``c`` is ``bad`` when a
    position is not finite or beyond ``max_coordinate`` in absolute value, or a
    velocity or force is not finite; else ``rebuild`` when ``i < n_reference``
    and ``|positions[i] - reference[i]|**2 > limit2`` (float64 differences, the
    squares summed x, y, z), or for row 0 when ``use_moved`` and ``moved[0]``
    is nonzero (``moved`` is not read otherwise); else nothing. ``code`` starts
    at zero and ends at the largest ``c`` of any row (the step's codes rank a
    non-finite value above a rebuild: ``bad > rebuild > 0`` there)."""
    i = wp.tid()
    c = wp.int32(0)
    for k in range(3):
        x = wp.float64(positions[i, k])
        if not (wp.abs(x) < max_coordinate):  # (NaN compares false: not finite)
            c = bad
        if not wp.isfinite(velocities[i, k]):
            c = bad
        if not wp.isfinite(forces[i, k]):
            c = bad
    if c == 0 and i < n_reference:
        d2 = wp.float64(0.0)
        for k in range(3):
            u = wp.float64(positions[i, k]) - wp.float64(reference[i, k])
            d2 = d2 + u * u
        if d2 > limit2:
            c = rebuild
    if c == 0 and i == 0 and use_moved != 0 and moved[0] != 0:  # (moved: valid memory)
        c = rebuild
    if c != 0 and code[0] < c:  # (read first: few atomics when many rows move)
        wp.atomic_max(code, 0, c)
