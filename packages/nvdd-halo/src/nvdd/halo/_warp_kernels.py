"""The Warp kernels of the halo plan (device code only; host wrappers: ``_kernels``).

Warp's kernel language is Python syntax with Warp types in annotations, which
mypy cannot type; the codes disabled below are the ones that language trips.
"""

# mypy: disable-error-code="valid-type,misc,no-untyped-def,untyped-decorator,arg-type,assignment"

from __future__ import annotations

from typing import Any

import warp as wp

__all__ = [
    "MAX_IMAGE_SPAN",
    "compute_fractional_kernel",
    "count_images_kernel",
    "fill_images_kernel",
    "fold_rows_kernel",
]

#: Most images of one atom along one axis inside one expanded box (beyond: overflow).
MAX_IMAGE_SPAN = 1 << 16
#: Most ghost rows one (atom, rank) pair, or one rank in total, may produce.
COUNT_LIMIT = (1 << 31) - 1


@wp.func
def _image_range(f: Any, lo: Any, hi: Any, periodic: wp.int32):
    """Integer range ``[first, last]`` of shifts n with ``lo <= f + n < hi``."""
    one = type(f)(1.0)
    if periodic != 0:
        first = wp.ceil(lo - f)
        last = wp.ceil(hi - f) - one
        limit = type(f)(1 << 30)
        if wp.abs(first) > limit or wp.abs(last) > limit or last - first >= type(f)(MAX_IMAGE_SPAN):
            return 0, -2  # overflow marker: (first, last) = (0, -2)
        return wp.int32(first), wp.int32(last)
    if lo <= f and f < hi:
        return 0, 0
    return 0, -1


@wp.kernel(enable_backward=False)
def compute_fractional_kernel(
    positions: wp.array2d(dtype=Any),
    system: wp.array(dtype=wp.int64),
    inv_cell: wp.array3d(dtype=Any),
    frac: wp.array2d(dtype=Any),
    bad: wp.array(dtype=wp.int32),
):
    i = wp.tid()
    sl = system[i]
    if sl < wp.int64(0) or sl >= wp.int64(inv_cell.shape[0]):
        wp.atomic_max(bad, 0, 2)  # (checked here: the host reads the flag with its others)
        for a in range(3):
            frac[i, a] = positions[i, a] * type(positions[i, a])(0.0)
        return
    s = wp.int32(sl)
    for a in range(3):
        v = positions[i, 0] * inv_cell[s, 0, a]
        v = v + positions[i, 1] * inv_cell[s, 1, a]
        v = v + positions[i, 2] * inv_cell[s, 2, a]
        frac[i, a] = v
        if not wp.isfinite(positions[i, a]):
            wp.atomic_max(bad, 0, 1)


@wp.kernel(enable_backward=False)
def count_images_kernel(
    frac: wp.array2d(dtype=Any),
    system: wp.array(dtype=wp.int64),
    cand_rank: wp.array(dtype=wp.int32),
    cand_ok: wp.array2d(dtype=wp.int32),
    elo: wp.array3d(dtype=Any),
    ehi: wp.array3d(dtype=Any),
    periodic: wp.array2d(dtype=wp.int32),
    my_rank: wp.int32,
    counts: wp.array2d(dtype=wp.int32),
    overflow: wp.array(dtype=wp.int32),
):
    u, i = wp.tid()
    s = wp.int32(system[i])
    counts[u, i] = 0
    if cand_ok[s, u] == 0:
        return
    r = cand_rank[u]
    total = wp.int64(1)
    has_zero = wp.int32(1)
    for a in range(3):
        first, last = _image_range(frac[i, a], elo[s, r, a], ehi[s, r, a], periodic[s, a])
        if last == first - 2:
            wp.atomic_max(overflow, 0, 1)
        span = wp.max(last - first + 1, 0)
        total = total * wp.int64(span)
        if first > 0 or last < 0:
            has_zero = 0
    if r == my_rank and has_zero == 1 and total > wp.int64(0):
        total = total - wp.int64(1)  # the n = 0 image on its own rank is the owned row
    if total > wp.int64(COUNT_LIMIT):
        wp.atomic_max(overflow, 0, 1)
        total = wp.int64(0)
    counts[u, i] = wp.int32(total)


@wp.kernel(enable_backward=False)
def fill_images_kernel(
    frac: wp.array2d(dtype=Any),
    system: wp.array(dtype=wp.int64),
    atom_ids: wp.array(dtype=wp.int64),
    cand_rank: wp.array(dtype=wp.int32),
    cand_ok: wp.array2d(dtype=wp.int32),
    elo: wp.array3d(dtype=Any),
    ehi: wp.array3d(dtype=Any),
    periodic: wp.array2d(dtype=wp.int32),
    my_rank: wp.int32,
    offsets: wp.array2d(dtype=wp.int64),
    meta: wp.array2d(dtype=wp.int64),
    overflow: wp.array(dtype=wp.int32),
):
    u, i = wp.tid()
    s = wp.int32(system[i])
    if cand_ok[s, u] == 0:
        return
    r = cand_rank[u]
    f0, l0 = _image_range(frac[i, 0], elo[s, r, 0], ehi[s, r, 0], periodic[s, 0])
    f1, l1 = _image_range(frac[i, 1], elo[s, r, 1], ehi[s, r, 1], periodic[s, 1])
    f2, l2 = _image_range(frac[i, 2], elo[s, r, 2], ehi[s, r, 2], periodic[s, 2])
    capacity = meta.shape[0]
    pos = offsets[u, i]
    for n0 in range(f0, l0 + 1):
        for n1 in range(f1, l1 + 1):
            for n2 in range(f2, l2 + 1):
                if not (r == my_rank and n0 == 0 and n1 == 0 and n2 == 0):
                    if pos >= wp.int64(capacity):
                        wp.atomic_max(overflow, 0, 1)
                    else:
                        meta[pos, 0] = wp.int64(i)
                        meta[pos, 1] = wp.int64(n0)
                        meta[pos, 2] = wp.int64(n1)
                        meta[pos, 3] = wp.int64(n2)
                        meta[pos, 4] = atom_ids[i]
                        meta[pos, 5] = wp.int64(s)
                    pos = pos + wp.int64(1)


@wp.kernel(enable_backward=False)
def fold_rows_kernel(
    values: wp.array2d(dtype=Any),
    rows: wp.array(dtype=wp.int64),
    src: wp.array(dtype=wp.int64),
    out: wp.array2d(dtype=Any),
):
    # ``rows`` is sorted: the first entry of each run of equal rows sums the run
    # in order (no atomics: a fixed summation order); the others do nothing.
    k, c = wp.tid()
    r = rows[k]
    if k > 0:  # noqa: SIM102 - Warp's `and` evaluates both sides: rows[-1] at k = 0
        if rows[k - 1] == r:
            return
    acc = out[r, c]
    n = rows.shape[0]
    j = k
    while j < n:
        if rows[j] != r:
            break
        acc = acc + values[src[j], c]
        j = j + 1
    out[r, c] = acc
