"""The Warp Lennard-Jones kernel (device code only; host wrapper: ``_lj.WarpLJ``).

Warp's kernel language is Python syntax with Warp types in annotations, which
mypy cannot type; the codes disabled below are the ones that language trips.

One thread per list row ``i``. A pair ``{i, j}`` with weight
``w = (owned(i) + owned(j)) / 2`` (rows ``< n_recv`` are owned; ``w = 1``
outside domain decomposition) contributes ``w phi(r)`` to the energy, which
is exactly what the torch reference counts with its owned-receiver rule (each
directed edge gives ``phi / 2`` to its receiver); hence

- atom energies: ``phi / 2`` to each *owned* end;
- forces: ``-w dphi/dx`` on both ends (``forces = -dE_local/dx`` on every row,
  ghost rows included; the runtime folds those into their owners), or with
  ``ghost_forces = 0`` the whole pair force on each owned end and nothing on
  ghost rows (each rank computes its owned-ghost pairs anyway, so the owned
  rows are then complete and the fold can be skipped);
- virial: ``w g r (x) r`` with ``g = -phi'(r) / r``.

A *half* list holds each pair once: row ``i`` accumulates its own terms in
registers and adds ``j``'s with atomics. A *full* list holds both directions:
row ``i`` gathers its own terms only (no atomics; each visit carries half the
pair's virial). A row whose neighbour count overflowed the matrix walks the
cells of the search instead (exact, slower), and a sticky error of the search
(NaN positions, a singular cell) makes every output NaN.

Two kernels come from one body (:func:`_make_lj_kernel`): ``lj_kernel``, the
default, and ``lj_atom_virial_kernel``, whose ``virial`` output is per *atom*
(``(n_atoms, 6)``, zeroed by the caller): each pair gives ``g r (x) r / 2`` to
each of its owned ends (atomics onto ``j`` in a half list), so owned rows are
exact and ghost rows stay zero, and the rows sum to the per-row virial above.
The choice is made at code generation (``wp.static``): the default kernel's
code is the same as before the variant existed, and the variant lives in a
Warp module of its own, compiled only when a model asks for per-atom virials.
"""

# mypy: disable-error-code="no-untyped-call,valid-type,misc,no-untyped-def,untyped-decorator,arg-type,assignment,operator,index,no-any-return,name-defined,call-overload,attr-defined,return-value,call-arg,type-var"

from __future__ import annotations

from typing import Any

import warp as wp

from nvdd.models._cell_kernels import (
    CODE_BIAS,
    CODE_ZERO,
    F_ERROR,
    find_slot,
    keep_pair,
    key_axis,
    key_system,
    neighbor_cell,
    pack_key,
)

__all__ = ["lj_atom_virial_kernel", "lj_kernel"]


@wp.func
def lj_pair(r2: Any, eps: Any, sig2: Any, shift: Any):
    """``(phi, g)`` of one pair at squared distance ``r2``, ``g = -phi'(r) / r``
    (the operations of the torch reference, in the same order)."""
    s2 = sig2 / r2
    s6 = s2 * s2 * s2
    s12 = s6 * s6
    phi = type(r2)(4.0) * eps * (s12 - s6) - shift
    g = type(r2)(24.0) * eps * (type(r2)(2.0) * s12 - s6) / r2
    return phi, g


@wp.func
def pair_update(
    j: wp.int32,
    r: Any,
    type_i: wp.int32,
    types: wp.array(dtype=wp.int32),
    n_types: wp.int32,
    epsilon: wp.array(dtype=Any),
    sigma2: wp.array(dtype=Any),
    shift: wp.array(dtype=Any),
    own_i: Any,
    n_recv: wp.int32,
    half: wp.int32,
    with_virial: wp.int32,
    ghost_forces: wp.int32,
    forces: wp.array2d(dtype=Any),
    energies: wp.array(dtype=Any),
    f: Any,
    e: Any,
    vir: Any,
):
    """Add the pair ``(i, j)`` at vector ``r = x_j - x_i + S @ cell`` (inside the
    cutoff) to row ``i``'s accumulators; in a half list, ``j``'s share by atomics.

    ``ghost_forces``: forces ``-w dphi/dx`` on both ends (``-dE_local/dx``),
    else the whole pair force on each owned end and none on a ghost end."""
    zero = e - e
    one = zero + type(e)(1.0)
    halfw = type(e)(0.5)
    r2 = wp.dot(r, r)
    type_j = type_i
    if n_types > 1:
        type_j = types[j]
    flat = type_i * n_types + type_j
    phi, g = lj_pair(r2, epsilon[flat], sigma2[flat], shift[flat])
    own_j = zero
    if j < n_recv:
        own_j = one
    wg = halfw * (own_i + own_j) * g
    gi = wg
    gj = wg
    if ghost_forces == 0:
        gi = own_i * g
        gj = own_j * g
    f = f - gi * r  # the force on j is +gj * r
    e = e + halfw * phi * own_i
    if half != 0:
        if gj != zero:
            fj = gj * r
            wp.atomic_add(forces, j, 0, fj[0])
            wp.atomic_add(forces, j, 1, fj[1])
            wp.atomic_add(forces, j, 2, fj[2])
        if j < n_recv:
            wp.atomic_add(energies, j, halfw * phi)
        if with_virial != 0:
            vir = vir + wg * wp.outer(r, r)
    elif with_virial != 0:
        vir = vir + (halfw * wg) * wp.outer(r, r)
    return f, e, vir


@wp.func
def add_voigt(virial: wp.array2d(dtype=Any), row: wp.int32, m: Any):
    """Atomically add the symmetric 3x3 ``m`` to ``virial[row]`` in Voigt order
    ``(xx, yy, zz, yz, xz, xy)``."""
    wp.atomic_add(virial, row, 0, m[0, 0])
    wp.atomic_add(virial, row, 1, m[1, 1])
    wp.atomic_add(virial, row, 2, m[2, 2])
    wp.atomic_add(virial, row, 3, m[1, 2])
    wp.atomic_add(virial, row, 4, m[0, 2])
    wp.atomic_add(virial, row, 5, m[0, 1])


@wp.func
def pair_update_atom(
    j: wp.int32,
    r: Any,
    type_i: wp.int32,
    types: wp.array(dtype=wp.int32),
    n_types: wp.int32,
    epsilon: wp.array(dtype=Any),
    sigma2: wp.array(dtype=Any),
    shift: wp.array(dtype=Any),
    own_i: Any,
    n_recv: wp.int32,
    half: wp.int32,
    ghost_forces: wp.int32,
    forces: wp.array2d(dtype=Any),
    energies: wp.array(dtype=Any),
    virial: wp.array2d(dtype=Any),
    f: Any,
    e: Any,
    vir: Any,
):
    """:func:`pair_update`'s forces and energies, and the pair virial split half and
    half between the two ends, each share kept only on an owned end: row ``i``'s in
    ``vir``, ``j``'s (half list) added to ``virial[j]`` (Voigt ``xx yy zz yz xz xy``)."""
    f, e, vir = pair_update(
        j, r, type_i, types, n_types, epsilon, sigma2, shift, own_i, n_recv, half,
        wp.int32(0), ghost_forces, forces, energies, f, e, vir,
    )  # fmt: skip
    type_j = type_i
    if n_types > 1:
        type_j = types[j]
    flat = type_i * n_types + type_j
    _phi, g = lj_pair(wp.dot(r, r), epsilon[flat], sigma2[flat], shift[flat])
    share = (type(e)(0.5) * g) * wp.outer(r, r)
    vir = vir + own_i * share
    if half != 0 and j < n_recv:
        add_voigt(virial, j, share)
    return f, e, vir


def _make_lj_kernel(atom_virials: bool):
    """The LJ kernel; ``atom_virials``: the per-atom virial variant (module notes)."""

    @wp.kernel(enable_backward=False, module="unique" if atom_virials else None)
    def lj_kernel(
        positions: wp.array2d(dtype=Any),
        system: wp.array(dtype=wp.int64),
        cell: wp.array3d(dtype=Any),
        types: wp.array(dtype=wp.int32),
        n_types: wp.int32,
        epsilon: wp.array(dtype=Any),
        sigma2: wp.array(dtype=Any),
        shift: wp.array(dtype=Any),
        cutoff2: Any,
        neighbors: wp.array2d(dtype=wp.int32),
        codes: wp.array2d(dtype=wp.int32),
        counts: wp.array(dtype=wp.int32),
        with_codes: wp.int32,
        n_recv: wp.int32,
        half: wp.int32,
        with_virial: wp.int32,
        ghost_forces: wp.int32,
        row_key: wp.array(dtype=wp.int64),
        row_image: wp.array2d(dtype=wp.int32),
        grid: wp.array2d(dtype=wp.int32),
        slot_key: wp.array(dtype=wp.int64),
        slot_count: wp.array(dtype=wp.int32),
        slot_end: wp.array(dtype=wp.int32),
        sorted_row: wp.array(dtype=wp.int32),
        sorted_image: wp.array2d(dtype=wp.int32),
        flags: wp.array(dtype=wp.int32),
        forces: wp.array2d(dtype=Any),
        energies: wp.array(dtype=Any),
        virial: wp.array2d(dtype=Any),
    ):
        """Energies, forces and (``with_virial``) the per-row virial ``(xx, yy, zz, yz,
        xz, xy)`` of list row ``i`` (the per-atom variant: row ``i``'s share, added to
        in a half list). Half list: ``forces`` and ``energies`` start at
        zero and are added to; full list: row ``i`` is written. ``ghost_forces`` 0:
        owned rows get their complete forces and ghost rows none (no fold needed)."""
        i = wp.tid()
        x_i = wp.vector(positions[i, 0], positions[i, 1], positions[i, 2])
        zero = x_i[0] - x_i[0]
        if flags[F_ERROR] != 0:
            nan = zero + type(zero)(wp.nan)
            for k in range(3):
                forces[i, k] = nan
            energies[i] = nan
            if with_virial != 0:
                for k in range(6):
                    virial[i, k] = nan
            return
        s = wp.int32(system[i])
        type_i = types[i]
        own_i = zero
        if i < n_recv:
            own_i = zero + type(zero)(1.0)
        f = wp.vector(zero, zero, zero)
        e = zero
        vir = wp.outer(f, f)
        count = counts[i]
        if count >= 0 and count <= neighbors.shape[0]:
            for c in range(count):
                j = neighbors[c, i]
                r = wp.vector(positions[j, 0], positions[j, 1], positions[j, 2]) - x_i
                if with_codes != 0:
                    code = codes[c, i]
                    if code != CODE_ZERO:
                        for a in range(3):
                            sa = type(zero)(((code >> (10 * a)) & 1023) - CODE_BIAS)
                            r = r + sa * wp.vector(cell[s, a, 0], cell[s, a, 1], cell[s, a, 2])
                if wp.dot(r, r) < cutoff2:
                    if wp.static(atom_virials):
                        f, e, vir = pair_update_atom(
                            j, r, type_i, types, n_types, epsilon, sigma2, shift, own_i,
                            n_recv, half, ghost_forces, forces, energies, virial, f, e, vir,
                        )  # fmt: skip
                    else:
                        f, e, vir = pair_update(
                            j, r, type_i, types, n_types, epsilon, sigma2, shift, own_i,
                            n_recv, half, with_virial, ghost_forces, forces, energies, f, e, vir,
                        )  # fmt: skip
        else:
            # the list of this row overflowed: walk the cells of the search instead
            key_i = row_key[i]
            ks = key_system(key_i)
            for d0 in range(-grid[ks, 3], grid[ks, 3] + 1):
                c0, t0, ok0 = neighbor_cell(key_axis(key_i, 0), d0, grid[ks, 0], grid[ks, 6])
                for d1 in range(-grid[ks, 4], grid[ks, 4] + 1):
                    c1, t1, ok1 = neighbor_cell(key_axis(key_i, 1), d1, grid[ks, 1], grid[ks, 7])
                    for d2 in range(-grid[ks, 5], grid[ks, 5] + 1):
                        c2, t2, ok2 = neighbor_cell(
                            key_axis(key_i, 2), d2, grid[ks, 2], grid[ks, 8]
                        )
                        slot = wp.int32(-1)
                        if ok0 * ok1 * ok2 != 0:
                            slot = find_slot(slot_key, pack_key(ks, c0, c1, c2))
                        if slot >= 0:
                            for q in range(slot_end[slot] - slot_count[slot], slot_end[slot]):
                                j = sorted_row[q]
                                if j == i and t0 == 0 and t1 == 0 and t2 == 0:
                                    continue
                                if not keep_pair(i, j, t0, t1, t2, n_recv, half):
                                    continue
                                s0 = t0 + row_image[i, 0] - sorted_image[q, 0]
                                s1 = t1 + row_image[i, 1] - sorted_image[q, 1]
                                s2 = t2 + row_image[i, 2] - sorted_image[q, 2]
                                r = (
                                    wp.vector(positions[j, 0], positions[j, 1], positions[j, 2])
                                    - x_i
                                )
                                if s0 != 0 or s1 != 0 or s2 != 0:
                                    for k in range(3):
                                        r[k] = r[k] + (
                                            type(zero)(s0) * cell[s, 0, k]
                                            + type(zero)(s1) * cell[s, 1, k]
                                            + type(zero)(s2) * cell[s, 2, k]
                                        )
                                if wp.dot(r, r) < cutoff2:
                                    if wp.static(atom_virials):
                                        f, e, vir = pair_update_atom(
                                            j, r, type_i, types, n_types, epsilon, sigma2,
                                            shift, own_i, n_recv, half, ghost_forces, forces,
                                            energies, virial, f, e, vir,
                                        )  # fmt: skip
                                    else:
                                        f, e, vir = pair_update(
                                            j, r, type_i, types, n_types, epsilon, sigma2,
                                            shift, own_i, n_recv, half, with_virial,
                                            ghost_forces, forces, energies, f, e, vir,
                                        )  # fmt: skip
        if half != 0:
            wp.atomic_add(forces, i, 0, f[0])
            wp.atomic_add(forces, i, 1, f[1])
            wp.atomic_add(forces, i, 2, f[2])
            wp.atomic_add(energies, i, e)
        else:
            forces[i, 0] = f[0]
            forces[i, 1] = f[1]
            forces[i, 2] = f[2]
            energies[i] = e
        # (nested: wp.static is resolved at code generation, `half` at run time)
        if wp.static(atom_virials):  # noqa: SIM102
            if half != 0:  # other rows add their shares to row i too
                add_voigt(virial, wp.int32(i), vir)
                return
        if with_virial != 0:  # (always in the variant: its caller asks for the virial)
            virial[i, 0] = vir[0, 0]
            virial[i, 1] = vir[1, 1]
            virial[i, 2] = vir[2, 2]
            virial[i, 3] = vir[1, 2]
            virial[i, 4] = vir[0, 2]
            virial[i, 5] = vir[0, 1]

    return lj_kernel


#: The default kernel (per-row virial).
lj_kernel = _make_lj_kernel(False)
#: The per-atom virial variant (its own Warp module, compiled on first use).
lj_atom_virial_kernel = _make_lj_kernel(True)
