"""Warp kernels of the device neighbour search (device code only; host: ``_device_neighbors``).

Warp's kernel language is Python syntax with Warp types in annotations, which
mypy cannot type; the codes disabled below are the ones that language trips.

The search is a cell list whose cells live in a hash table (open addressing),
so that open axes need no bounding box (no reduction over the atoms) and far
outliers cost nothing. Per system ``s`` a *frame* ``M`` (rows: the periodic
lattice vectors, completed on open axes by unit vectors orthogonal to them)
gives coordinates ``f = x @ inv(M)``: fractional on periodic axes, Angstrom on
open ones. A cell is ``(s, c0, c1, c2)``; periodic axes have ``nb`` cells of
height ``>= cutoff / cells_per_cutoff`` (wrapped), open axes cells of width
``bin_width`` (unbounded, keyed).

Every kernel of a rebuild reads the rebuild flag and returns at once when it is
not set, so the host can launch the whole chain on every call without knowing
(no device-to-host synchronisation): ``flags[F_REBUILD] == call`` (written by
:func:`check_kernel`) or ``force != 0`` (a rebuild the host asked for).
"""

# mypy: disable-error-code="valid-type,misc,no-untyped-def,untyped-decorator,arg-type,assignment,operator,index,no-any-return,name-defined,call-overload,attr-defined,return-value,call-arg,type-var"

from __future__ import annotations

from typing import Any

import warp as wp

__all__ = [
    "CODE_ZERO",
    "ERR_CELL",
    "ERR_IMAGES",
    "ERR_NONFINITE",
    "ERR_RANGE",
    "F_BUILDS",
    "F_CELLS",
    "F_ERROR",
    "F_FALLBACK",
    "F_MAX_COUNT",
    "F_REBUILD",
    "MAX_SPAN",
    "MAX_SYSTEMS",
    "N_FLAGS",
    "assign_kernel",
    "build_kernel",
    "check_kernel",
    "frame_kernel",
    "scatter_kernel",
]

# ----------------------------------------------------------------- flags
#: The call number whose check asked for a rebuild.
F_REBUILD = 0
#: Sticky error bits (``ERR_*``); cleared only by the host.
F_ERROR = 1
#: Largest neighbour count of the current list (may exceed the capacity).
F_MAX_COUNT = 2
#: Number of builds so far.
F_BUILDS = 3
#: Rows of the current list that overflowed (count > capacity, or a shift out of range).
F_FALLBACK = 4
#: Occupied cells of the current list.
F_CELLS = 5
N_FLAGS = 8

#: A position is NaN or infinite.
ERR_NONFINITE = 1
#: A periodic cell is singular or not finite.
ERR_CELL = 2
#: Positions span more cells than a cell key holds (|cell index| > KEY_LIMIT).
ERR_RANGE = 4
#: A periodic cell is so thin that more than MAX_SPAN images per axis are needed.
ERR_IMAGES = 8

#: Largest |cell index| on an axis, and the bias that makes it non-negative in a key.
KEY_LIMIT = (1 << 16) - 1
KEY_BIAS = 1 << 16
KEY_EMPTY = -1
#: Systems a key holds (12 bits keep keys non-negative).
MAX_SYSTEMS = 1 << 12
#: Largest cell search half-range per axis (images of a tiny periodic cell).
MAX_SPAN = 32
#: Image shifts are packed 10 bits per axis, biased by 512.
CODE_BIAS = 512
CODE_LIMIT = 511
CODE_ZERO = CODE_BIAS | (CODE_BIAS << 10) | (CODE_BIAS << 20)
#: Largest |image index| of an atom (a position this many cells away is an error).
IMAGE_LIMIT = 1 << 24


# ------------------------------------------------------------ functions
@wp.func
def rebuilding(flags: wp.array(dtype=wp.int32), call: wp.int32, force: wp.int32) -> wp.bool:
    """Whether this call rebuilds the list."""
    return force != 0 or flags[F_REBUILD] == call


@wp.func
def pack_key(s: wp.int32, c0: wp.int32, c1: wp.int32, c2: wp.int32) -> wp.int64:
    """One cell as a non-negative int64: 12 bits of system, 17 bits per axis."""
    k = wp.int64(s) << wp.int64(51)
    k = k | (wp.int64(c0 + KEY_BIAS) << wp.int64(34))
    k = k | (wp.int64(c1 + KEY_BIAS) << wp.int64(17))
    return k | wp.int64(c2 + KEY_BIAS)


@wp.func
def key_axis(key: wp.int64, axis: wp.int32) -> wp.int32:
    """Cell index of ``key`` on ``axis`` (0, 1, 2)."""
    shift = wp.int64(34 - 17 * axis)
    return wp.int32((key >> shift) & wp.int64(0x1FFFF)) - KEY_BIAS


@wp.func
def key_system(key: wp.int64) -> wp.int32:
    """System of ``key``."""
    return wp.int32(key >> wp.int64(51))


@wp.func
def hash_slot(key: wp.int64, mask: wp.int32) -> wp.int32:
    """Home slot of ``key`` in a table of ``mask + 1`` (a power of two) slots."""
    u = wp.uint64(key)
    u = u ^ (u >> wp.uint64(31))
    u = u * wp.uint64(0x7FB5D329728EA185)
    u = u ^ (u >> wp.uint64(27))
    u = u * wp.uint64(0x51AFD7ED558CCD)
    u = u ^ (u >> wp.uint64(33))
    return wp.int32(u & wp.uint64(mask))


@wp.func
def find_slot(slot_key: wp.array(dtype=wp.int64), key: wp.int64) -> wp.int32:
    """Slot holding ``key``, or -1 (linear probing; the table is never full)."""
    mask = slot_key.shape[0] - 1
    h = hash_slot(key, mask)
    for _probe in range(slot_key.shape[0]):
        k = slot_key[h]
        if k == key:
            return h
        if k == wp.int64(KEY_EMPTY):
            return -1
        h = (h + 1) & mask
    return -1


@wp.func
def insert_slot(
    slot_key: wp.array(dtype=wp.int64), key: wp.int64, flags: wp.array(dtype=wp.int32)
) -> wp.int32:
    """Slot of ``key``, claiming an empty one if it is new (counts new cells in flags)."""
    mask = slot_key.shape[0] - 1
    h = hash_slot(key, mask)
    for _probe in range(slot_key.shape[0]):
        old = wp.atomic_cas(slot_key, h, wp.int64(KEY_EMPTY), key)
        if old == wp.int64(KEY_EMPTY):
            wp.atomic_add(flags, F_CELLS, 1)
            return h
        if old == key:
            return h
        h = (h + 1) & mask
    return -1


@wp.func
def neighbor_cell(c: wp.int32, d: wp.int32, nb: wp.int32, periodic: wp.int32):
    """Cell index and image shift of the cell ``d`` steps from ``c`` on one axis.

    Returns ``(index, shift, ok)``; ``ok`` is 0 for an open-axis cell outside the
    key range.
    """
    if periodic != 0:
        v = c + d
        t = v // nb  # Warp's integer // rounds towards minus infinity
        return v - t * nb, t, 1
    v = c + d
    if v > KEY_LIMIT or v < -KEY_LIMIT:
        return 0, 0, 0
    return v, 0, 1


@wp.func
def shift_code(s0: wp.int32, s1: wp.int32, s2: wp.int32) -> wp.int32:
    """Image shift packed 10 bits per axis, or -1 when out of range."""
    if wp.abs(s0) > CODE_LIMIT or wp.abs(s1) > CODE_LIMIT or wp.abs(s2) > CODE_LIMIT:
        return -1
    return (s0 + CODE_BIAS) | ((s1 + CODE_BIAS) << 10) | ((s2 + CODE_BIAS) << 20)


@wp.func
def keep_pair(
    i: wp.int32,
    j: wp.int32,
    s0: wp.int32,
    s1: wp.int32,
    s2: wp.int32,
    n_recv: wp.int32,
    half: wp.int32,
) -> wp.bool:
    """Whether the list of row ``i`` holds the pair ``(i, j, S)`` (``S != 0`` when ``i == j``;
    ``S`` is read only then).

    Rows ``< n_recv`` are *owned*; a pair with no owned end is never kept.
    Full list: every pair with an owned end, in both directions. Half list:
    one direction per pair: the owned end when only one end is owned;
    otherwise ``i < j`` when ``i + j`` is even and ``i > j`` when it is odd
    (each row gets about half its neighbours whatever the row order), and the
    lexicographically positive shift of an atom's own images.
    """
    oi = i < n_recv
    oj = j < n_recv
    if not oi and not oj:
        return False
    if half == 0:
        return True
    if i == j:
        if s0 != 0:
            return s0 > 0
        if s1 != 0:
            return s1 > 0
        return s2 > 0
    if oi and oj:
        if ((i + j) & 1) == 0:
            return i < j
        return i > j
    return oi


# --------------------------------------------------------------- kernels
@wp.func
def _cell_row(c: wp.array(dtype=Any), s: int, r: int) -> wp.vec3d:
    """Row ``r`` of system ``s``'s cell in a flat ``(n_systems * 9,)`` array, float64."""
    b = s * 9 + r * 3
    return wp.vec3d(wp.float64(c[b]), wp.float64(c[b + 1]), wp.float64(c[b + 2]))


@wp.func
def _strain_keeps(
    cell: wp.array(dtype=Any),
    ref_cell: wp.array(dtype=Any),
    s: int,
    x: wp.vec3d,
    x0: wp.vec3d,
    skin: wp.float64,
    cutoff: wp.float64,
) -> int:
    """1 when a list built at ``(x0, ref_cell)`` still holds every pair within
    ``cutoff`` at ``(x, cell)`` as far as this atom is concerned, else 0
    (``nvdd.core._strain``): with ``G = inv(cell) @ ref_cell`` (the inverse
    deformation gradient) and ``u = x @ G - x0``, ``2 |u| <= skin - cutoff
    (||G||_2 - 1)``, with ``||G||_2 <= 1 + ||G - I||_F`` (a bound that can only
    ask for more rebuilds). A singular cell (an open axis) always rebuilds."""
    a0 = _cell_row(cell, s, 0)
    a1 = _cell_row(cell, s, 1)
    a2 = _cell_row(cell, s, 2)
    b0 = _cell_row(ref_cell, s, 0)
    b1 = _cell_row(ref_cell, s, 1)
    b2 = _cell_row(ref_cell, s, 2)
    h = wp.mat33d(a0[0], a0[1], a0[2], a1[0], a1[1], a1[2], a2[0], a2[1], a2[2])
    h0 = wp.mat33d(b0[0], b0[1], b0[2], b1[0], b1[1], b1[2], b2[0], b2[1], b2[2])
    tiny = wp.float64(1.0e-12)
    scale = wp.length(a0) * wp.length(a1) * wp.length(a2)
    scale0 = wp.length(b0) * wp.length(b1) * wp.length(b2)
    keeps = wp.int32(0)
    if wp.abs(wp.determinant(h)) > tiny * scale:  # noqa: SIM102
        if wp.abs(wp.determinant(h0)) > tiny * scale0:
            g = wp.mul(wp.inverse(h), h0)
            frob2 = wp.float64(0.0)
            for r in range(3):
                for c in range(3):
                    e = g[r, c]
                    if r == c:
                        e = e - wp.float64(1.0)
                    frob2 = frob2 + e * e
            eff = skin - cutoff * wp.sqrt(frob2)
            u = wp.mul(wp.transpose(g), x) - x0  # (the row vector x @ g)
            if eff > wp.float64(0.0):  # noqa: SIM102
                if wp.float64(4.0) * wp.dot(u, u) <= eff * eff * wp.float64(1.0 - 1.0e-6):
                    keeps = wp.int32(1)
    return keeps


@wp.kernel(enable_backward=False)
def check_kernel(
    positions: wp.array2d(dtype=Any),
    ref_positions: wp.array2d(dtype=Any),
    system: wp.array(dtype=wp.int64),
    ref_system: wp.array(dtype=wp.int64),
    track_system: wp.int32,
    cell: wp.array(dtype=Any),
    ref_cell: wp.array(dtype=Any),
    threshold2: Any,
    skin: wp.float64,
    cutoff: wp.float64,
    call: wp.int32,
    flags: wp.array(dtype=wp.int32),
):
    """Ask for a rebuild (``flags[F_REBUILD] = call``) when an atom moved more than
    ``sqrt(threshold2)`` (or is not finite: the test is ``not d2 <= threshold2``),
    or (``track_system``) a system index changed. Under a changed cell the
    displacement is measured in the frame that follows the cell and the strain
    eats into the skin (:func:`_strain_keeps`), so a barostat that scales
    positions with the cell rebuilds only when the thermal motion or the strain
    used up the skin, not at every step."""
    t = wp.tid()
    if t >= positions.shape[0]:
        return
    x0 = positions[t, 0]
    x1 = positions[t, 1]
    x2 = positions[t, 2]
    if not (wp.isfinite(x0) and wp.isfinite(x1) and wp.isfinite(x2)):
        wp.atomic_or(flags, F_ERROR, ERR_NONFINITE)
    s = int(system[t])
    changed = wp.int32(0)
    for k in range(9):
        if cell[s * 9 + k] != ref_cell[s * 9 + k]:
            changed = wp.int32(1)
    if changed == 0:
        d0 = x0 - ref_positions[t, 0]
        d1 = x1 - ref_positions[t, 1]
        d2 = x2 - ref_positions[t, 2]
        moved2 = d0 * d0 + d1 * d1 + d2 * d2
        if not (moved2 <= threshold2):
            flags[F_REBUILD] = call
    else:
        x = wp.vec3d(wp.float64(x0), wp.float64(x1), wp.float64(x2))
        r0 = wp.vec3d(
            wp.float64(ref_positions[t, 0]),
            wp.float64(ref_positions[t, 1]),
            wp.float64(ref_positions[t, 2]),
        )
        # (a NaN position fails the test: 4 |u|**2 <= ... is false)
        if _strain_keeps(cell, ref_cell, s, x, r0, skin, cutoff) == 0:
            flags[F_REBUILD] = call
    if track_system != 0:  # noqa: SIM102
        if system[t] != ref_system[t]:
            flags[F_REBUILD] = call


@wp.func
def _unit(v: wp.vec3d):
    n = wp.length(v)
    if n > wp.float64(0.0):
        return v / n
    return v


@wp.func
def _row(cell: wp.array3d(dtype=Any), s: wp.int32, a: wp.int32):
    return wp.vec3d(wp.float64(cell[s, a, 0]), wp.float64(cell[s, a, 1]), wp.float64(cell[s, a, 2]))


@wp.kernel(enable_backward=False)
def frame_kernel(
    cell: wp.array3d(dtype=Any),
    pbc: wp.array2d(dtype=wp.int32),
    search_radius: wp.float64,
    cell_height: wp.float64,
    frame: wp.array2d(dtype=wp.float64),
    grid: wp.array2d(dtype=wp.int32),
    slot_key: wp.array(dtype=wp.int64),
    slot_count: wp.array(dtype=wp.int32),
    call: wp.int32,
    force: wp.int32,
    flags: wp.array(dtype=wp.int32),
):
    """Per system: the frame ``inv(M)`` and the grid (cells, search half-range,
    periodicity per axis); per slot: an empty table. Thread 0 resets the list's
    counters. ``cell_height``: the smallest cell height (``>= search_radius``
    over cells per cutoff, with a rounding margin). Float64 whatever the
    positions' dtype: cell indices of float32 positions then err by a few ulps of
    the positions only, far inside the margin."""
    t = wp.tid()
    if not rebuilding(flags, call, force):
        return
    if t == 0:
        flags[F_MAX_COUNT] = 0
        flags[F_FALLBACK] = 0
        flags[F_CELLS] = 0
        flags[F_BUILDS] = flags[F_BUILDS] + 1
    if t < slot_key.shape[0]:
        slot_key[t] = wp.int64(KEY_EMPTY)
        slot_count[t] = 0
    if t >= cell.shape[0]:
        return
    s = t
    zero = wp.float64(0.0)
    one = wp.float64(1.0)
    a0 = _row(cell, s, 0)
    a1 = _row(cell, s, 1)
    a2 = _row(cell, s, 2)
    p0 = pbc[s, 0]
    p1 = pbc[s, 1]
    p2 = pbc[s, 2]
    n_per = p0 + p1 + p2
    e0 = wp.vec3d(one, zero, zero)
    e1 = wp.vec3d(zero, one, zero)
    e2 = wp.vec3d(zero, zero, one)
    if n_per == 0:
        a0 = e0
        a1 = e1
        a2 = e2
    elif n_per == 1:
        u = a0
        if p1 != 0:
            u = a1
        if p2 != 0:
            u = a2
        u = _unit(u)
        # the coordinate axis least aligned with u, then two unit vectors orthogonal to u
        e = e0
        if wp.abs(u[1]) < wp.abs(u[0]) and wp.abs(u[1]) <= wp.abs(u[2]):
            e = e1
        elif wp.abs(u[2]) < wp.abs(u[0]) and wp.abs(u[2]) < wp.abs(u[1]):
            e = e2
        v1 = _unit(wp.cross(u, e))
        v2 = wp.cross(u, v1)
        if p0 != 0:
            a1 = v1
            a2 = v2
        elif p1 != 0:
            a0 = v1
            a2 = v2
        else:
            a0 = v1
            a1 = v2
    elif n_per == 2:
        if p0 == 0:
            a0 = _unit(wp.cross(a1, a2))
        elif p1 == 0:
            a1 = _unit(wp.cross(a2, a0))
        else:
            a2 = _unit(wp.cross(a0, a1))
    m = wp.matrix_from_rows(a0, a1, a2)
    det = wp.determinant(m)
    if not (wp.isfinite(det) and wp.abs(det) > zero):
        wp.atomic_or(flags, F_ERROR, ERR_CELL)
        for k in range(9):
            frame[s, k] = zero
        for k in range(3):
            grid[s, k] = 1
            grid[s, 3 + k] = 0
            grid[s, 6 + k] = 0
        return
    inv = wp.inverse(m)
    for a in range(3):
        for k in range(3):
            frame[s, 3 * a + k] = inv[a, k]
    vol = wp.abs(det)
    heights = wp.vec3d(
        vol / wp.length(wp.cross(a1, a2)),
        vol / wp.length(wp.cross(a2, a0)),
        vol / wp.length(wp.cross(a0, a1)),
    )
    periodic = wp.vec3i(p0, p1, p2)
    for k in range(3):
        if periodic[k] != 0:
            nb = wp.int32(wp.min(wp.floor(heights[k] / cell_height), wp.float64(KEY_LIMIT)))
            nb = wp.max(nb, 1)
            width = heights[k] / wp.float64(nb)
            span = wp.int32(wp.ceil(search_radius / width))
            if span > MAX_SPAN:
                wp.atomic_or(flags, F_ERROR, ERR_IMAGES)
                span = MAX_SPAN
            grid[s, k] = nb
            grid[s, 3 + k] = span
            grid[s, 6 + k] = 1
        else:
            grid[s, k] = 0
            grid[s, 3 + k] = wp.int32(wp.ceil(search_radius / cell_height))
            grid[s, 6 + k] = 0


@wp.kernel(enable_backward=False)
def assign_kernel(
    positions: wp.array2d(dtype=Any),
    system: wp.array(dtype=wp.int64),
    frame: wp.array2d(dtype=wp.float64),
    grid: wp.array2d(dtype=wp.int32),
    cell_height: wp.float64,
    cell: wp.array(dtype=Any),
    ref_positions: wp.array2d(dtype=Any),
    ref_system: wp.array(dtype=wp.int64),
    track_system: wp.int32,
    ref_cell: wp.array(dtype=Any),
    slot_key: wp.array(dtype=wp.int64),
    slot_count: wp.array(dtype=wp.int32),
    row_key: wp.array(dtype=wp.int64),
    row_image: wp.array2d(dtype=wp.int32),
    row_slot: wp.array(dtype=wp.int32),
    row_rank: wp.array(dtype=wp.int32),
    call: wp.int32,
    force: wp.int32,
    flags: wp.array(dtype=wp.int32),
):
    """Put every atom in its cell (hash slot and rank within the slot) and record
    the reference state (positions, cell, system indices) of the new list."""
    t = wp.tid()
    if not rebuilding(flags, call, force):
        return
    if t < cell.shape[0]:
        ref_cell[t] = cell[t]
    if t >= positions.shape[0]:
        return
    i = t
    s = wp.int32(system[i])
    x = wp.vector(positions[i, 0], positions[i, 1], positions[i, 2])
    ref_positions[i, 0] = x[0]
    ref_positions[i, 1] = x[1]
    ref_positions[i, 2] = x[2]
    if track_system != 0:
        ref_system[i] = system[i]
    finite = wp.isfinite(x[0]) and wp.isfinite(x[1]) and wp.isfinite(x[2])
    if not finite:
        wp.atomic_or(flags, F_ERROR, ERR_NONFINITE)
    c = wp.vector(0, 0, 0)
    n = wp.vector(0, 0, 0)
    xd = wp.vec3d(wp.float64(x[0]), wp.float64(x[1]), wp.float64(x[2]))
    for k in range(3):
        f = xd[0] * frame[s, k] + xd[1] * frame[s, 3 + k] + xd[2] * frame[s, 6 + k]
        if finite:
            if grid[s, 6 + k] != 0:
                whole = wp.floor(f)
                if wp.abs(whole) > wp.float64(IMAGE_LIMIT):
                    wp.atomic_or(flags, F_ERROR, ERR_RANGE)
                else:
                    nb = grid[s, k]
                    ck = wp.int32((f - whole) * wp.float64(nb))
                    c[k] = wp.min(wp.max(ck, 0), nb - 1)
                    n[k] = wp.int32(whole)
            else:
                q = wp.floor(f / cell_height)
                if wp.abs(q) > wp.float64(KEY_LIMIT - MAX_SPAN):
                    wp.atomic_or(flags, F_ERROR, ERR_RANGE)
                else:
                    c[k] = wp.int32(q)
    key = pack_key(s, c[0], c[1], c[2])
    slot = insert_slot(slot_key, key, flags)
    row_key[i] = key
    row_slot[i] = slot
    row_rank[i] = wp.atomic_add(slot_count, slot, 1)
    for k in range(3):
        row_image[i, k] = n[k]


@wp.kernel(enable_backward=False)
def scatter_kernel(
    positions: wp.array2d(dtype=Any),
    system: wp.array(dtype=wp.int64),
    cell: wp.array3d(dtype=Any),
    row_image: wp.array2d(dtype=wp.int32),
    row_slot: wp.array(dtype=wp.int32),
    row_rank: wp.array(dtype=wp.int32),
    slot_count: wp.array(dtype=wp.int32),
    slot_end: wp.array(dtype=wp.int32),
    sorted_row: wp.array(dtype=wp.int32),
    sorted_pos: wp.array2d(dtype=Any),
    sorted_image: wp.array2d(dtype=wp.int32),
    call: wp.int32,
    force: wp.int32,
    flags: wp.array(dtype=wp.int32),
):
    """Counting sort by cell: rows, wrapped positions ``x - n @ cell`` and images
    ``n`` in cell order (``slot_end``: inclusive prefix sum of ``slot_count``)."""
    i = wp.tid()
    if not rebuilding(flags, call, force):
        return
    slot = row_slot[i]
    p = slot_end[slot] - slot_count[slot] + row_rank[i]
    s = wp.int32(system[i])
    sorted_row[p] = i
    for k in range(3):
        w = positions[i, k]
        for a in range(3):
            w = w - type(w)(row_image[i, a]) * cell[s, a, k]
        sorted_pos[p, k] = w
        sorted_image[p, k] = row_image[i, k]


@wp.kernel(enable_backward=False)
def build_kernel(
    sorted_row: wp.array(dtype=wp.int32),
    sorted_pos: wp.array2d(dtype=Any),
    sorted_image: wp.array2d(dtype=wp.int32),
    row_key: wp.array(dtype=wp.int64),
    cell: wp.array3d(dtype=Any),
    grid: wp.array2d(dtype=wp.int32),
    slot_key: wp.array(dtype=wp.int64),
    slot_count: wp.array(dtype=wp.int32),
    slot_end: wp.array(dtype=wp.int32),
    radius2: Any,
    n_rows: wp.int32,
    n_recv: wp.int32,
    half: wp.int32,
    with_codes: wp.int32,
    neighbors: wp.array2d(dtype=wp.int32),
    codes: wp.array2d(dtype=wp.int32),
    counts: wp.array(dtype=wp.int32),
    call: wp.int32,
    force: wp.int32,
    flags: wp.array(dtype=wp.int32),
    row_slot: wp.array(dtype=wp.int32),
    row_rank: wp.array(dtype=wp.int32),
    row_order: wp.int32,
):
    """The neighbour matrix: one thread per atom, rows ``< n_rows``; threads in
    cell order, or in row order (``row_order``: thread ``i`` builds row ``i``, so
    neighbouring threads write neighbouring words of ``neighbors``). Each row is
    built alike either way (the same cells, candidates and order).

    ``neighbors[c, i]`` (slot-major, so that neighbouring threads touch
    neighbouring words) is the ``c``-th kept neighbour of row ``i`` with
    ``|x_j - x_i + S @ cell| < sqrt(radius2)``; ``codes[c, i]`` its packed shift
    ``S`` (``with_codes``). ``counts[i]`` is the true count, even past the
    capacity, or -1 when a shift did not fit its code; either marks the row for
    the force kernel's cell walk (no neighbour is ever silently dropped).
    """
    t = wp.tid()
    if not rebuilding(flags, call, force):
        return
    p = t
    i = t
    if row_order != 0:
        if i >= n_rows:
            return
        p = slot_end[row_slot[i]] - slot_count[row_slot[i]] + row_rank[i]
    else:
        i = sorted_row[p]
        if i >= n_rows:
            return
    capacity = neighbors.shape[0]
    key_i = row_key[i]
    s = key_system(key_i)
    wi = wp.vector(sorted_pos[p, 0], sorted_pos[p, 1], sorted_pos[p, 2])
    count = wp.int32(0)
    bad_code = wp.int32(0)
    for d0 in range(-grid[s, 3], grid[s, 3] + 1):
        c0, t0, ok0 = neighbor_cell(key_axis(key_i, 0), d0, grid[s, 0], grid[s, 6])
        for d1 in range(-grid[s, 4], grid[s, 4] + 1):
            c1, t1, ok1 = neighbor_cell(key_axis(key_i, 1), d1, grid[s, 1], grid[s, 7])
            for d2 in range(-grid[s, 5], grid[s, 5] + 1):
                c2, t2, ok2 = neighbor_cell(key_axis(key_i, 2), d2, grid[s, 2], grid[s, 8])
                slot = wp.int32(-1)
                if ok0 * ok1 * ok2 != 0:
                    slot = find_slot(slot_key, pack_key(s, c0, c1, c2))
                if slot >= 0:
                    tc = wp.vector(wi[0] - wi[0], wi[0] - wi[0], wi[0] - wi[0])
                    if t0 != 0 or t1 != 0 or t2 != 0:
                        for k in range(3):
                            tc[k] = (
                                type(wi[0])(t0) * cell[s, 0, k]
                                + type(wi[0])(t1) * cell[s, 1, k]
                                + type(wi[0])(t2) * cell[s, 2, k]
                            )
                    for q in range(slot_end[slot] - slot_count[slot], slot_end[slot]):
                        j = sorted_row[q]
                        # S = t + n_i - n_j; for j == i (the only case the rule
                        # reads S) that is t, so images are loaded only for kept pairs
                        if j == i and t0 == 0 and t1 == 0 and t2 == 0:
                            continue
                        if not keep_pair(i, j, t0, t1, t2, n_recv, half):
                            continue
                        r0 = sorted_pos[q, 0] + tc[0] - wi[0]
                        r1 = sorted_pos[q, 1] + tc[1] - wi[1]
                        r2 = sorted_pos[q, 2] + tc[2] - wi[2]
                        if r0 * r0 + r1 * r1 + r2 * r2 < radius2:
                            if count < capacity:
                                neighbors[count, i] = j
                                if with_codes != 0:
                                    code = shift_code(
                                        t0 + sorted_image[p, 0] - sorted_image[q, 0],
                                        t1 + sorted_image[p, 1] - sorted_image[q, 1],
                                        t2 + sorted_image[p, 2] - sorted_image[q, 2],
                                    )
                                    if code < 0:
                                        bad_code = 1
                                    codes[count, i] = code
                            count = count + 1
    # a plain read first: most rows find the running maximum already there, and a
    # million atomics on one word serialise (a stale read only costs an atomic)
    if count > flags[F_MAX_COUNT]:
        wp.atomic_max(flags, F_MAX_COUNT, count)
    if bad_code != 0 or count > capacity:
        wp.atomic_add(flags, F_FALLBACK, 1)
    if bad_code != 0:
        counts[i] = -1
    else:
        counts[i] = count
