"""Cell geometry: domain cells, interplanar spacings, fractional coordinates, wrapping.

Every computation here is float64 on the device of its inputs, so an atom's owner
does not depend on the dtype its positions are stored in.
"""

from __future__ import annotations

import torch

from nvdd.core import ValidationError

__all__ = [
    "build_domain_cell",
    "face_tolerance",
    "fractional",
    "interplanar_spacings",
    "lattice_shifts",
    "owner_fractional",
    "wrap_fractional",
]

#: A kept open-axis vector must leave the Gram determinant of the kept vectors above
#: this fraction of the product of their squared norms (well conditioned, not just
#: non-singular).
_USABLE_REL_TOL = 1e-6
#: Smallest length (Angstrom) of a synthetic open-axis vector.
_MIN_SYNTHETIC_LENGTH = 1.0


def interplanar_spacings(cell: torch.Tensor) -> torch.Tensor:
    """Distance between neighbouring lattice planes along each cell axis.

    ``d_a = V / |b x c|`` (and cyclic), i.e. ``1 / |inv(cell)[:, a]|``: a distance
    ``x`` along the normal of the planes of axis ``a`` is ``x / d_a`` in fractional
    units, whatever the cell's angles.

    Parameters
    ----------
    cell:
        Shape ``(n_systems, 3, 3)``, rows are lattice vectors, non-singular.

    Returns
    -------
    torch.Tensor
        float64, shape ``(n_systems, 3)``.
    """
    inv = torch.linalg.inv(cell.to(torch.float64))
    spacing: torch.Tensor = 1.0 / torch.linalg.vector_norm(inv, dim=1)
    return spacing


def fractional(
    positions: torch.Tensor, system_index: torch.Tensor, inv_cell: torch.Tensor
) -> torch.Tensor:
    """Fractional coordinates ``positions @ inv(cell[system])`` in float64.

    Parameters
    ----------
    positions:
        Shape ``(n_atoms, 3)``.
    system_index:
        int64, shape ``(n_atoms,)``.
    inv_cell:
        float64, shape ``(n_systems, 3, 3)``: inverses of the domain cells.

    Returns
    -------
    torch.Tensor
        float64, shape ``(n_atoms, 3)``; no wrapping.
    """
    pos = positions.detach().to(torch.float64)
    inv = inv_cell.to(pos.device)
    if inv.shape[0] == 1:
        return pos @ inv[0]
    return torch.bmm(pos.unsqueeze(1), inv[system_index]).squeeze(1)


def wrap_fractional(frac: torch.Tensor, periodic: torch.Tensor) -> torch.Tensor:
    """Fractional coordinates wrapped into ``[0, 1)`` on periodic axes.

    Parameters
    ----------
    frac:
        float64, shape ``(n_atoms, 3)``.
    periodic:
        bool, shape ``(n_atoms, 3)`` (each atom's system's pbc) or ``(3,)``.

    Returns
    -------
    torch.Tensor
        Same shape; open axes unchanged. A value that rounds to exactly 1 after
        wrapping is mapped to 0, so the result is always in ``[0, 1)``.
    """
    wrapped = frac - torch.floor(frac)
    wrapped = torch.where(wrapped >= 1.0, torch.zeros_like(wrapped), wrapped)
    return torch.where(periodic, wrapped, frac)


def _orthogonal_unit(chosen: list[torch.Tensor], axis: int) -> torch.Tensor:
    """A unit vector orthogonal to every vector in ``chosen`` (at most two)."""
    if len(chosen) == 2:
        n = torch.linalg.cross(chosen[0], chosen[1])
        unit: torch.Tensor = n / torch.linalg.vector_norm(n)
        return unit
    # Gram-Schmidt of the Cartesian axes, starting with this axis's own.
    for k in (axis, (axis + 1) % 3, (axis + 2) % 3):
        v = torch.zeros(3, dtype=torch.float64)
        v[k] = 1.0
        for u in chosen:
            uu = u / torch.linalg.vector_norm(u)
            v = v - (v @ uu) * uu
        norm = float(torch.linalg.vector_norm(v))
        if norm > 0.5:
            return v / norm
    raise AssertionError("unreachable: a Cartesian axis is always far from one vector")


def _usable(chosen: list[torch.Tensor], v: torch.Tensor) -> bool:
    norm2 = float(v @ v)
    if norm2 == 0.0 or not bool(torch.isfinite(v).all()):
        return False
    vecs = torch.stack([*chosen, v])
    gram = float(torch.linalg.det(vecs @ vecs.T))
    scale = float(torch.prod((vecs * vecs).sum(dim=1)))
    return gram > _USABLE_REL_TOL * scale


def build_domain_cell(
    cell: torch.Tensor, pbc: torch.Tensor, positions: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The domain cell of one system: non-singular on all three axes.

    Periodic axes keep their lattice vectors. An open axis keeps its vector when
    it is non-zero and well conditioned against the vectors kept so far (a slab
    built with vacuum keeps its ``c``); otherwise it gets a synthetic vector along
    the normal of the kept vectors (for one kept vector, the Cartesian axis of the
    same index made orthogonal to it), of length the atoms' extent along that
    direction (at least 1 Angstrom; exactly 1 Angstrom without positions).

    Parameters
    ----------
    cell:
        float64, shape ``(3, 3)``, rows are lattice vectors.
    pbc:
        bool, shape ``(3,)``.
    positions:
        float64, shape ``(n_atoms, 3)`` of this system, or None.

    Returns
    -------
    domain_cell:
        float64, shape ``(3, 3)``.
    synthetic:
        bool, shape ``(3,)``: which open axes got a synthetic vector.

    Raises
    ------
    ValidationError
        If the periodic vectors are singular.
    """
    cell = cell.detach().to(device="cpu", dtype=torch.float64)
    periodic = [a for a in range(3) if bool(pbc[a])]
    chosen: list[torch.Tensor] = []
    for a in periodic:
        if not _usable(chosen, cell[a]):
            raise ValidationError(
                f"cell vectors of the periodic axes {periodic} are singular: {cell.tolist()}"
            )
        chosen.append(cell[a])
    rows: dict[int, torch.Tensor] = {a: cell[a] for a in periodic}
    synthetic = torch.zeros(3, dtype=torch.bool)
    pending: list[int] = []
    for a in range(3):
        if a in rows:
            continue
        if _usable(chosen, cell[a]):
            rows[a] = cell[a]
            chosen.append(cell[a])
        else:
            pending.append(a)
    pos = None if positions is None else positions.detach().to("cpu", torch.float64)
    for a in pending:
        u = _orthogonal_unit(chosen, a)
        length = _MIN_SYNTHETIC_LENGTH
        if pos is not None and pos.shape[0] > 0:
            proj = pos @ u
            length = max(float(proj.max() - proj.min()), _MIN_SYNTHETIC_LENGTH)
        rows[a] = u * length
        chosen.append(rows[a])
        synthetic[a] = True
    return torch.stack([rows[a] for a in range(3)]), synthetic


def face_tolerance(dtype: torch.dtype) -> float:
    """How far (fractional) a stored position may sit outside ``[0, 1)`` through
    rounding alone: ``16 eps(dtype)``, below the halo's rounding margin
    (``64 eps (1 + |frac|)``), so a position within it still finds its ghosts."""
    return 16.0 * torch.finfo(dtype).eps


def lattice_shifts(frac: torch.Tensor, periodic: torch.Tensor, tol: float) -> torch.Tensor:
    """The lattice vectors (fractional counts, float64) that wrap each position:
    ``floor(frac)`` on periodic axes, except 0 for ``-tol <= frac < 0``.

    A point below the lower face by no more than rounding stays where it is:
    moved up by a period it would round onto the upper face (``-1e-17 + L ==
    L``), which the next wrap moves back to 0, and until then its stored
    position and its owner's box would be a cell apart (a wrong force, not an
    error). A point on or above the upper face moves down (``L - L == 0``
    exactly). So wrapping is idempotent, and :func:`owner_fractional` of its
    result names the box that holds it.
    """
    shift = torch.floor(frac)
    near = (frac < 0.0) & (frac >= -tol)
    return torch.where(periodic & ~near, shift, torch.zeros_like(shift))


def owner_fractional(frac: torch.Tensor, periodic: torch.Tensor) -> torch.Tensor:
    """Fractional coordinates of *wrapped* positions as the owner lookup reads
    them: clamped into ``[0, 1)`` on periodic axes (a position within rounding
    outside a face belongs to the box on its own side, see :func:`lattice_shifts`);
    open axes unchanged."""
    below_one = 1.0 - torch.finfo(torch.float64).eps / 2.0
    return torch.where(periodic, frac.clamp(0.0, below_one), frac)
