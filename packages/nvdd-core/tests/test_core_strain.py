"""Verlet reuse under a changing cell: the effective skin and the rebuild test.

The central property is checked against a brute-force pair search with explicit
periodic images: whenever ``skin_exceeded`` says "reuse", every pair within the
cutoff at the deformed cell was a candidate at the reference.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from nvdd.core import (
    ValidationError,
    deformation_gradient,
    effective_skin,
    nonaffine_displacements,
    skin_exceeded,
)
from nvdd.core._strain import _smallest_singular_value

F64 = torch.float64


def _triclinic(scale: float = 1.0) -> torch.Tensor:
    return scale * torch.tensor([[6.0, 0.0, 0.0], [1.2, 5.5, 0.0], [-0.8, 0.9, 6.3]], dtype=F64)


def _pairs(x: torch.Tensor, cell: torch.Tensor, rc: float) -> set[tuple[int, int, int, int, int]]:
    """Every (i, j, n) with 0 < |x_j + n @ cell - x_i| < rc (brute force)."""
    inv = torch.linalg.inv(cell)
    spacing = 1.0 / torch.linalg.vector_norm(inv, dim=0)
    reach = [math.ceil(rc / float(d)) + 1 for d in spacing]
    out = set()
    for n in itertools.product(*[range(-k, k + 1) for k in reach]):
        shift = torch.tensor(n, dtype=F64) @ cell
        d = (x[None, :, :] + shift - x[:, None, :]).norm(dim=-1)
        for i, j in (d < rc).nonzero().tolist():
            if i != j or any(n):
                out.add((i, j, *n))
    return out


def test_deformation_gradient_maps_the_reference_cell_onto_the_current_one() -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.stack([_triclinic(), _triclinic(1.1)])
    strain = 0.03 * torch.randn(2, 3, 3, generator=g, dtype=F64)
    cur = ref @ (torch.eye(3, dtype=F64) + strain)
    grad, defined = deformation_gradient(ref, cur)
    assert bool(defined.all())
    torch.testing.assert_close(ref @ grad, cur, rtol=0, atol=1e-12)
    same, ok = deformation_gradient(ref, ref.clone())
    assert torch.equal(same, torch.eye(3, dtype=F64).expand(2, 3, 3)) and bool(ok.all())


def test_singular_cells_are_identity_when_unchanged_and_undefined_when_changed() -> None:
    zero = torch.zeros(3, 3, dtype=F64)
    grad, defined = deformation_gradient(zero, zero)
    assert torch.equal(grad[0], torch.eye(3, dtype=F64)) and bool(defined[0])
    slab = torch.diag(torch.tensor([5.0, 5.0, 0.0], dtype=F64))
    _, defined = deformation_gradient(slab, slab * 1.01)
    assert not bool(defined[0])
    assert float(effective_skin(slab, slab * 1.01, cutoff=3.0, skin=1.0)[0]) == float("-inf")
    x = torch.zeros(2, 3, dtype=F64)
    si = torch.zeros(2, dtype=torch.int64)
    assert bool(skin_exceeded(x, x, si, slab, slab * 1.01, cutoff=3.0, skin=1.0))
    assert not bool(skin_exceeded(x, x, si, slab, slab.clone(), cutoff=3.0, skin=1.0))


def test_effective_skin_of_isotropic_strain_is_closed_form() -> None:
    ref = _triclinic()
    rc, skin = 6.0, 1.0
    for e in (-0.02, 0.0, 0.01, 0.05):
        got = float(effective_skin(ref, ref * (1.0 + e), cutoff=rc, skin=skin)[0])
        want = skin - rc * (1.0 / (1.0 + e) - 1.0)
        # the closed-form singular value is rounded down (conservative) by 1e-7
        assert want - rc * 1e-6 <= got <= want + 1e-12, e
    assert float(effective_skin(ref, ref.clone(), cutoff=rc, skin=skin)[0]) == skin


def test_the_smallest_singular_value_is_a_lower_bound_within_1e_7() -> None:
    """The closed form that replaces ``svdvals`` (which waits for the host on
    CUDA): below the exact value by about 1e-7 relative, never above, from
    tiny strains to large ones and where two singular values coincide."""
    g = torch.Generator().manual_seed(2)
    cases = [torch.eye(3, dtype=F64) + s * torch.randn(500, 3, 3, generator=g, dtype=F64)
             for s in (1e-9, 1e-5, 1e-2, 0.3)]  # fmt: skip
    cases.append(torch.diag_embed(torch.tensor([[1.01, 1.0, 1.0], [0.97, 0.97, 1.0]], dtype=F64)))
    for f in cases:
        want = torch.linalg.svdvals(f)[..., -1]
        got = _smallest_singular_value(f)
        rel = (got - want) / want
        assert float(rel.max()) <= 0.0 and float(rel.min()) > -3e-7, (f.shape, rel)
    assert float(_smallest_singular_value(1.25 * torch.eye(3, dtype=F64))) == 1.25


def test_affine_motion_is_not_a_displacement() -> None:
    g = torch.Generator().manual_seed(1)
    ref = _triclinic()
    grad = torch.eye(3, dtype=F64) + 0.02 * torch.randn(3, 3, generator=g, dtype=F64)
    x0 = torch.rand(40, 3, generator=g, dtype=F64) @ ref * 3.0  # also far outside the cell
    si = torch.zeros(40, dtype=torch.int64)
    u = nonaffine_displacements(x0 @ grad, x0, si, ref, ref @ grad)
    assert float(u.abs().max()) < 1e-12
    # the plain Cartesian displacement of the same motion is large
    assert float((x0 @ grad - x0).norm(dim=1).max()) > 0.5


def test_unchanged_cell_is_exactly_the_half_skin_test() -> None:
    g = torch.Generator().manual_seed(2)
    cell = torch.stack([_triclinic(), _triclinic(0.9)])
    for trial in range(30):
        x0 = torch.rand(50, 3, generator=g, dtype=F64) * 6.0
        x = x0 + 0.3 * torch.randn(50, 3, generator=g, dtype=F64) * (trial / 30)
        si = torch.arange(50) % 2
        skin = 0.8
        old = bool(((x - x0) ** 2).sum(dim=1).max() > (0.5 * skin) ** 2)
        assert bool(skin_exceeded(x, x0, si, cell, cell.clone(), cutoff=3.0, skin=skin)) == old
    x32 = x.to(torch.float32)
    assert not bool(skin_exceeded(x32, x32, si, cell, cell.clone(), cutoff=3.0, skin=0.0))


def test_same_cell_takes_the_plain_test_with_the_same_answer() -> None:
    """``same_cell=True`` skips the cell algebra (the GPU fast path); on equal
    cells it answers exactly what the full test answers, on a changed cell the
    promise is the caller's (here broken on purpose: the plain test ignores it)."""
    g = torch.Generator().manual_seed(5)
    cell = torch.stack([_triclinic(), _triclinic(0.9)])
    si = torch.arange(40) % 2
    for trial in range(20):
        x0 = torch.rand(40, 3, generator=g, dtype=F64) * 6.0
        x = x0 + 0.3 * torch.randn(40, 3, generator=g, dtype=F64) * (trial / 20)
        full = skin_exceeded(x, x0, si, cell, cell.clone(), cutoff=3.0, skin=0.8)
        fast = skin_exceeded(x, x0, si, cell, cell, cutoff=3.0, skin=0.8, same_cell=True)
        assert bool(fast) == bool(full)
    squeezed = cell * 0.8  # a strain that eats the whole skin: only the full test sees it
    assert bool(skin_exceeded(x0, x0, si, cell, squeezed, cutoff=3.0, skin=0.8))
    assert not bool(skin_exceeded(x0, x0, si, cell, squeezed, cutoff=3.0, skin=0.8, same_cell=True))


def test_reuse_never_misses_a_pair_under_cell_deformation() -> None:
    """Brute force: when the test says reuse, the reference candidates cover every
    pair within the cutoff at the deformed cell; the displacement-only test would
    have reused lists that miss pairs."""
    g = torch.Generator().manual_seed(3)
    ref_cell = _triclinic()
    rc, skin = 2.6, 0.6
    n = 24
    reused = missed_by_old = 0
    for trial in range(60):
        x0 = torch.rand(n, 3, generator=g, dtype=F64) @ ref_cell
        candidates = _pairs(x0, ref_cell, rc + skin)
        amount = float(torch.rand(1, generator=g)) * 0.05
        grad = torch.eye(3, dtype=F64) + amount * torch.randn(3, 3, generator=g, dtype=F64)
        cell = ref_cell @ grad
        noise = float(torch.rand(1, generator=g)) * 0.15 * torch.randn(n, 3, generator=g, dtype=F64)
        # even trials scale the atoms with the cell (a barostat), odd ones do not
        x = (x0 + noise) @ grad if trial % 2 == 0 else x0 + noise
        si = torch.zeros(n, dtype=torch.int64)
        now = _pairs(x, cell, rc)
        if not bool(skin_exceeded(x, x0, si, ref_cell, cell, cutoff=rc, skin=skin)):
            reused += 1
            assert now <= candidates, sorted(now - candidates)[:3]
        # what "moved more than skin / 2" alone would decide
        old_reuse = bool(((x - x0) ** 2).sum(dim=1).max() <= (0.5 * skin) ** 2)
        if old_reuse and not now <= candidates:
            missed_by_old += 1
    assert reused >= 5, f"only {reused} trials reused the list: the test proves little"
    assert missed_by_old >= 1, "no trial shows the displacement-only test failing"


def test_several_systems_use_their_own_cell() -> None:
    a, b = _triclinic(), _triclinic(1.3)
    ref = torch.stack([a, b])
    cur = torch.stack([a, b * 0.97])  # only system 1 is compressed
    x0 = torch.zeros(4, 3, dtype=F64)
    si = torch.tensor([0, 0, 1, 1])
    eff = effective_skin(ref, cur, cutoff=5.0, skin=0.5)
    assert float(eff[0]) == 0.5 and float(eff[1]) < 0.5 - 5.0 * 0.03
    x = x0.clone()
    x[0, 0] = 0.2  # system 0: 0.2 < 0.25, fine
    assert not bool(skin_exceeded(x, x0, si, ref, cur, cutoff=5.0, skin=0.5))
    x[2] = x0[2] @ (torch.linalg.inv(b) @ (b * 0.97)) + torch.tensor([0.2, 0, 0], dtype=F64)
    assert bool(skin_exceeded(x, x0, si, ref, cur, cutoff=5.0, skin=0.5))  # budget 0.095


def test_mismatched_shapes_raise() -> None:
    with pytest.raises(ValidationError, match="ref_cell has shape"):
        effective_skin(torch.eye(3), torch.eye(3).expand(2, 3, 3), cutoff=1.0, skin=0.1)
    with pytest.raises(ValidationError, match="ref_positions"):  # the fixed-cell path too
        skin_exceeded(
            torch.zeros(3, 3),
            torch.zeros(1, 3),
            torch.zeros(3, dtype=torch.int64),
            torch.eye(3),
            torch.eye(3),
            cutoff=1.0,
            skin=0.1,
        )
    with pytest.raises(ValidationError, match="ref_positions"):
        nonaffine_displacements(
            torch.zeros(3, 3),
            torch.zeros(2, 3),
            torch.zeros(3, dtype=torch.int64),
            torch.eye(3),
            torch.eye(3),
        )
