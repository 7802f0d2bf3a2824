"""Warp kernels that compact a neighbour matrix into COO edges within a cutoff
(device code only; host: ``_device_edges``).

Two passes over the rows of a :class:`~nvdd.models._device_neighbors.NeighborMatrix`:
:func:`count_edges_kernel` counts each row's entries inside the cutoff at the
current positions (and flags rows whose candidates did not fit the matrix);
after a prefix sum of the counts (torch), :func:`write_edges_kernel` writes each
row's edges from its offset on, up to the edge capacity. Both passes compute
the same distances in the same arithmetic, so they agree on every entry.
"""

# mypy: disable-error-code="valid-type,misc,no-untyped-def,untyped-decorator,arg-type,assignment,operator,index,no-any-return,name-defined,call-overload,attr-defined,return-value,call-arg,type-var"

from __future__ import annotations

from typing import Any

import warp as wp

__all__ = ["count_edges_kernel", "entry_r2", "write_edges_kernel"]


@wp.func
def code_shift(code: wp.int32, axis: wp.int32) -> wp.int32:
    """One axis of a packed image shift (10 bits per axis, biased by 512)."""
    return ((code >> (10 * axis)) & 1023) - 512


@wp.func
def entry_r2(
    positions: wp.array2d(dtype=Any),
    cell: wp.array3d(dtype=Any),
    s: wp.int32,
    i: wp.int32,
    j: wp.int32,
    code: wp.int32,
    periodic: wp.int32,
):
    """``|x_j - x_i + S @ cell[s]|**2`` of one matrix entry (``S`` from ``code``
    when ``periodic``), in the positions' dtype: both passes call this, so they
    agree on every entry."""
    r2 = positions[i, 0] - positions[i, 0]
    for k in range(3):
        r = positions[j, k] - positions[i, k]
        if periodic != 0:
            for a in range(3):
                r = r + type(r)(code_shift(code, a)) * cell[s, a, k]
        r2 = r2 + r * r
    return r2


@wp.kernel(enable_backward=False)
def count_edges_kernel(
    positions: wp.array2d(dtype=Any),
    cell: wp.array3d(dtype=Any),
    system_index: wp.array(dtype=wp.int64),
    neighbors: wp.array2d(dtype=wp.int32),
    codes: wp.array2d(dtype=wp.int32),
    counts: wp.array(dtype=wp.int32),
    periodic: wp.int32,
    cutoff2: Any,
    within: wp.array(dtype=wp.int64),
    word: wp.array(dtype=wp.int64),
):
    """``within[i]``: row ``i``'s entries with ``|r_ij| < cutoff``; ``word[0]``
    counts rows whose candidates did not fit (a count past the capacity, or -1)."""
    i = wp.tid()
    capacity = neighbors.shape[0]
    count = counts[i]
    if count < 0 or count > capacity:
        wp.atomic_add(word, 0, wp.int64(1))
    n = wp.min(wp.max(count, 0), capacity)
    s = wp.int32(system_index[i])
    kept = wp.int64(0)
    for c in range(n):
        code = wp.int32(0)
        if periodic != 0:
            code = codes[c, i]
        if entry_r2(positions, cell, s, i, neighbors[c, i], code, periodic) < cutoff2:
            kept = kept + wp.int64(1)
    within[i] = kept


@wp.kernel(enable_backward=False)
def write_edges_kernel(
    positions: wp.array2d(dtype=Any),
    cell: wp.array3d(dtype=Any),
    system_index: wp.array(dtype=wp.int64),
    neighbors: wp.array2d(dtype=wp.int32),
    codes: wp.array2d(dtype=wp.int32),
    counts: wp.array(dtype=wp.int32),
    periodic: wp.int32,
    cutoff2: Any,
    ends: wp.array(dtype=wp.int64),
    receivers: wp.array(dtype=wp.int64),
    senders: wp.array(dtype=wp.int64),
    shifts: wp.array2d(dtype=wp.int64),
):
    """Row ``i``'s edges inside the cutoff at ``ends[i] - within[i]`` onwards
    (``ends``: the inclusive prefix sum of the counts), those below the
    capacity ``receivers.shape[0]``."""
    i = wp.tid()
    capacity = neighbors.shape[0]
    n = wp.min(wp.max(counts[i], 0), capacity)
    s = wp.int32(system_index[i])
    slot = wp.int64(0)
    if i > 0:
        slot = ends[i - 1]
    edge_cap = wp.int64(receivers.shape[0])
    for c in range(n):
        j = neighbors[c, i]
        code = wp.int32(0)
        if periodic != 0:
            code = codes[c, i]
        if entry_r2(positions, cell, s, i, j, code, periodic) < cutoff2:
            if slot < edge_cap:
                receivers[slot] = wp.int64(i)
                senders[slot] = wp.int64(j)
                for a in range(3):
                    if periodic != 0:
                        shifts[slot, a] = wp.int64(code_shift(code, a))
                    else:
                        shifts[slot, a] = wp.int64(0)
            slot = slot + wp.int64(1)
