"""Verlet reuse under a changing cell: how much of the skin a cell deformation eats.

A neighbour list (or a halo) built at reference positions ``x0`` and cell ``h0``
with candidates up to ``cutoff + skin`` stays complete at positions ``x`` and
cell ``h`` as long as no pair within ``cutoff`` now was beyond ``cutoff + skin``
then. Write the cell change as a deformation gradient ``F`` (rows are lattice
vectors, ``h = h0 @ F``) and every atom's displacement in the frame that follows
the cell, ``u = x @ inv(F) - x0`` (its *non-affine* displacement). For any pair,
with any periodic image ``n``,

    r(t) = x_j - x_i + n @ h = (r0 + u_j - u_i) @ F,

so ``|r0| <= |r(t)| * ||inv(F)||_2 + |u_i| + |u_j|``. A pair inside ``cutoff``
now was inside ``cutoff + skin`` then whenever

    2 * max |u| <= skin - cutoff * (||inv(F)||_2 - 1)      (the effective skin).

A compression eats into the skin (``||inv(F)||_2 > 1``), an expansion gives some
back, and a barostat's affine scaling of the positions costs nothing beyond that
term: ``u`` is only the thermal motion. With ``F = I`` this is the usual
"moved more than ``skin / 2``" test. The same bound holds for a halo plan built
from fractional boxes of the reference cell (ghost positions are owner
positions plus ``n @ h`` at the current cell), with ``cutoff`` the range the
halo must cover.

Everything is float64 and free of host synchronisation (a device-side flag):
no ``torch.linalg`` call that checks its result on the host (``solve``,
``inv`` and ``svdvals`` do on CUDA; ``solve_ex`` and ``inv_ex`` do not, and the
smallest singular value of a 3x3 comes from a closed form), so a step that
runs this test can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch

from nvdd.core._capture import capturing
from nvdd.core._errors import ValidationError

__all__ = [
    "deformation_gradient",
    "effective_skin",
    "nonaffine_displacements",
    "skin_exceeded",
]

#: A cell whose |det| is below this fraction of the product of its row norms is
#: singular (open boundaries with zero rows): no deformation gradient exists.
_SINGULAR_REL = 1e-12
#: The closed-form smallest singular value is rounded down by this relative
#: amount (``||inv(F)||_2`` up): its rounding (about 1e-8 of the eigenvalues'
#: spread where two coincide, from the ``acos`` near +-1) can then only make
#: the effective skin smaller.
_NORM_MARGIN = 1e-7


def _cells(ref_cell: torch.Tensor, cell: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ref = ref_cell.detach().to(torch.float64)
    cur = cell.detach().to(device=ref.device, dtype=torch.float64)
    ref = ref.unsqueeze(0) if ref.ndim == 2 else ref
    cur = cur.unsqueeze(0) if cur.ndim == 2 else cur
    if ref.shape != cur.shape or ref.shape[-2:] != (3, 3):
        raise ValidationError(
            f"ref_cell has shape {tuple(ref_cell.shape)} and cell {tuple(cell.shape)}; "
            "expected two (n_systems, 3, 3) (or (3, 3)) tensors of one shape"
        )
    return ref, cur


def _regular(c: torch.Tensor) -> torch.Tensor:
    scale = torch.linalg.vector_norm(c, dim=-1).prod(dim=-1)
    regular: torch.Tensor = torch.linalg.det(c).abs() > _SINGULAR_REL * scale
    return regular


def deformation_gradient(
    ref_cell: torch.Tensor, cell: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The deformation gradient ``F`` with ``cell = ref_cell @ F``, per system.

    Parameters
    ----------
    ref_cell, cell:
        Shape ``(n_systems, 3, 3)`` or ``(3, 3)``, rows are lattice vectors.

    Returns
    -------
    F:
        float64, shape ``(n_systems, 3, 3)``; exactly the identity where the two
        cells are equal (bit for bit) or where either is singular.
    defined:
        bool, shape ``(n_systems,)``: False where a singular cell changed (no
        deformation gradient maps one onto the other; treat as "rebuild").
    """
    ref, cur = _cells(ref_cell, cell)
    same = (ref == cur).all(dim=-1).all(dim=-1)
    regular = _regular(ref) & _regular(cur)
    eye = torch.eye(3, dtype=torch.float64, device=ref.device).expand_as(ref)
    safe_ref = torch.where(regular[:, None, None], ref, eye)
    safe_cur = torch.where(regular[:, None, None], cur, eye)
    grad = torch.linalg.solve_ex(safe_ref, safe_cur).result  # (regular: no error to check)
    use = (regular & ~same)[:, None, None]
    return torch.where(use, grad, eye), same | regular


def effective_skin(
    ref_cell: torch.Tensor, cell: torch.Tensor, *, cutoff: float, skin: float
) -> torch.Tensor:
    """The skin left after the cell changed from ``ref_cell`` to ``cell``.

    ``skin - cutoff * (||inv(F)||_2 - 1)``: atoms may move (non-affinely) by up
    to half of it before a list built at ``cutoff + skin`` can miss a pair.

    Returns
    -------
    torch.Tensor
        float64, shape ``(n_systems,)``; ``skin`` exactly where the cells are
        equal, larger under expansion, ``-inf`` where a singular cell changed.
    """
    return _effective(*deformation_gradient(ref_cell, cell), cutoff, skin)


def _effective(
    grad: torch.Tensor, defined: torch.Tensor, cutoff: float, skin: float
) -> torch.Tensor:
    inv_norm = 1.0 / _smallest_singular_value(grad)
    out = skin - cutoff * (inv_norm - 1.0)
    return torch.where(defined, out, torch.full_like(out, float("-inf")))


def _smallest_singular_value(f: torch.Tensor) -> torch.Tensor:
    """The smallest singular value of each 3x3 ``f`` ``(..., 3, 3)``, from the
    trigonometric closed form of the eigenvalues of the symmetric ``f^T f``
    (``torch.linalg.svdvals`` waits for the host on CUDA). Absolute error about
    1e-16 times the eigenvalues' scale, 1e-8 relative to their spread where two
    coincide, before it is rounded down by ``_NORM_MARGIN``; a multiple of the
    identity is not rounded down."""
    m = f.transpose(-1, -2) @ f
    q = (m[..., 0, 0] + m[..., 1, 1] + m[..., 2, 2]) / 3.0
    eye = torch.eye(3, dtype=f.dtype, device=f.device)
    a = m - q[..., None, None] * eye
    p = torch.sqrt((a * a).sum(dim=(-2, -1)) / 6.0)
    b = a / torch.where(p > 0, p, torch.ones_like(p))[..., None, None]
    det = (
        b[..., 0, 0] * (b[..., 1, 1] * b[..., 2, 2] - b[..., 1, 2] * b[..., 2, 1])
        - b[..., 0, 1] * (b[..., 1, 0] * b[..., 2, 2] - b[..., 1, 2] * b[..., 2, 0])
        + b[..., 0, 2] * (b[..., 1, 0] * b[..., 2, 1] - b[..., 1, 1] * b[..., 2, 0])
    )
    phi = torch.acos((0.5 * det).clamp(-1.0, 1.0)) / 3.0
    lowest = q + 2.0 * p * torch.cos(phi + 2.0 * math.pi / 3.0)
    # rounded down where the closed form rounds (never for a multiple of 1)
    lowest = torch.where(p > 0, lowest * (1.0 - 2.0 * _NORM_MARGIN), q)
    return torch.sqrt(lowest.clamp(min=0.0))


def nonaffine_displacements(
    positions: torch.Tensor,
    ref_positions: torch.Tensor,
    system_index: torch.Tensor,
    ref_cell: torch.Tensor,
    cell: torch.Tensor,
) -> torch.Tensor:
    """Displacements in the frame that follows the cell: ``x @ inv(F) - x0``.

    Parameters
    ----------
    positions, ref_positions:
        Shape ``(n_atoms, 3)``: now and at the reference (same rows).
    system_index:
        int64, shape ``(n_atoms,)``.
    ref_cell, cell:
        Shape ``(n_systems, 3, 3)`` (or ``(3, 3)``).

    Returns
    -------
    torch.Tensor
        float64, shape ``(n_atoms, 3)``; exactly ``x - x0`` (in float64) on
        systems whose cell did not change.
    """
    grad, _ = deformation_gradient(ref_cell, cell)
    return _nonaffine(positions, ref_positions, system_index, grad)


def _nonaffine(
    positions: torch.Tensor,
    ref_positions: torch.Tensor,
    system_index: torch.Tensor,
    grad: torch.Tensor,
) -> torch.Tensor:
    x = positions.detach().to(torch.float64)
    x0 = ref_positions.detach().to(device=x.device, dtype=torch.float64)
    if x.shape != x0.shape:
        raise ValidationError(
            f"positions have shape {tuple(x.shape)} but ref_positions {tuple(x0.shape)}"
        )
    grad = grad.to(x.device)
    eye = torch.eye(3, dtype=torch.float64, device=x.device)
    unchanged = (grad == eye).all(dim=-1).all(dim=-1)
    inv = torch.linalg.inv_ex(grad).inverse  # (F is regular: no error to check)
    if inv.shape[0] == 1:
        mapped = x @ inv[0]
        keep = unchanged[0]
    else:
        si = system_index.to(x.device)
        mapped = torch.bmm(x.unsqueeze(1), inv[si]).squeeze(1)
        keep = unchanged[si][:, None]
    mapped = torch.where(keep, x, mapped)
    return mapped - x0


def skin_exceeded(
    positions: torch.Tensor,
    ref_positions: torch.Tensor,
    system_index: torch.Tensor,
    ref_cell: torch.Tensor,
    cell: torch.Tensor,
    *,
    cutoff: float,
    skin: float,
    same_cell: bool = False,
) -> torch.Tensor:
    """Whether a list built at ``(ref_positions, ref_cell)`` with candidates up to
    ``cutoff + skin`` may now miss a pair within ``cutoff``.

    True when some atom's non-affine displacement exceeds half the
    :func:`effective_skin` of its system (always, where that is negative).
    With an unchanged cell this is exactly "some atom moved more than
    ``skin / 2``". Local: no communication (combine ranks' flags yourself).

    Parameters
    ----------
    positions, ref_positions:
        Shape ``(n_atoms, 3)``.
    system_index:
        int64, shape ``(n_atoms,)``.
    ref_cell, cell:
        Shape ``(n_systems, 3, 3)`` (or ``(3, 3)``).
    cutoff:
        The range the list must cover (Angstrom).
    skin:
        Its skin (Angstrom).
    same_cell:
        The caller knows that ``cell`` holds exactly ``ref_cell``'s values (e.g.
        the same tensor, unmodified since the build): the plain displacement
        test is then taken without the cell algebra (about ten small linear
        algebra launches on a GPU). A wrong promise gives a wrong answer.

    Returns
    -------
    torch.Tensor
        bool scalar on the device of ``positions``, False without atoms. No
        host synchronisation on accelerators; on the CPU an unchanged cell
        takes the plain displacement test (the same result, without the cell
        algebra).
    """
    ref, cur = _cells(ref_cell, cell)
    if same_cell or (ref.device.type == "cpu" and not capturing() and torch.equal(ref, cur)):
        if positions.shape != ref_positions.shape:
            raise ValidationError(
                f"positions have shape {tuple(positions.shape)} but ref_positions "
                f"{tuple(ref_positions.shape)}"
            )
        x = positions.detach().to(torch.float64)
        u = x - ref_positions.detach().to(device=x.device, dtype=torch.float64)
        if u.shape[0] == 0:
            return torch.zeros((), dtype=torch.bool, device=u.device)
        return ((u * u).sum(dim=1) > (0.5 * skin) ** 2).any()
    grad, defined = deformation_gradient(ref, cur)
    u = _nonaffine(positions, ref_positions, system_index, grad)
    half = 0.5 * _effective(grad, defined, cutoff, skin).to(u.device)
    if u.shape[0] == 0:
        return torch.zeros((), dtype=torch.bool, device=u.device)
    limit = half[0] if half.shape[0] == 1 else half[system_index.to(u.device)]
    d2 = (u * u).sum(dim=1)
    over = (limit < 0) | (d2 > limit * limit)
    return over.any()
