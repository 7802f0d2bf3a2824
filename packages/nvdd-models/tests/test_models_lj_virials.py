"""Per-atom virials of LennardJones (``LJConfig.atom_virials``): a dense numpy
oracle, the sum rule, ASE's per-atom stresses, the owned-receiver seam, opt-in."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
import torch
from models_testutils import DEVICES, ghost_layout, image_ranges, jittered_lattice, make_batch

from nvdd.core import Batch, ConfigurationError
from nvdd.models import ForceMode, LennardJones, LJBackend, LJConfig

_SPECIES = {18: (1.0, 1.0), 10: (0.4, 0.8)}
_TRICLINIC = np.array([[1.9, 0.0, 0.0], [0.5, 2.1, 0.0], [-0.3, 0.4, 2.0]])
_GEOMETRIES = {
    # name: (cell, atoms per axis); cutoff 2.5: several images of each atom interact
    "cubic": (np.eye(3) * 3.3, (3, 3, 3)),
    "triclinic": (_TRICLINIC * 1.5, (3, 3, 3)),
}
#: (backend, half_list, force mode): every implementation that returns atom virials.
_PATHS = [
    ("torch", True, ForceMode.DIRECT),
    ("torch", True, ForceMode.AUTOGRAD),
    ("warp", True, ForceMode.DIRECT),
    ("warp", False, ForceMode.DIRECT),
]
_IDS = ["torch-direct", "torch-autograd", "warp-half", "warp-full"]


def _model(backend: str, half: bool, mode: ForceMode, atom_virials: bool = True) -> LennardJones:
    return LennardJones(
        LJConfig(
            cutoff=2.5,
            species=_SPECIES,
            force_mode=mode,
            backend=LJBackend(backend),
            half_list=half,
            atom_virials=atom_virials,
        )
    )


def _batch(name: str, seed: int = 0) -> Batch:
    cell, grid = _GEOMETRIES[name]
    pos = jittered_lattice(grid, cell, 0.08, seed)
    z = np.random.default_rng(seed).choice([18, 10], size=len(pos)).tolist()
    return make_batch(pos, cell, [True, True, True], z, torch.float64)


def _brute_atom_virials(batch: Batch, cutoff: float) -> np.ndarray:
    """``W_i = 1/2 sum_{j, S} (-phi'(r)/r) d (x) d`` over every image, ``d = x_j + S h - x_i``
    (shifted LJ: the shift leaves phi' unchanged), written from the formula alone."""
    pos = batch.positions.double().numpy()
    z = batch.atomic_numbers.numpy()
    cell = batch.cell[0].double().numpy()

    def params(a: int, b: int) -> tuple[float, float]:
        (ea, sa), (eb, sb) = _SPECIES[a], _SPECIES[b]
        return float(np.sqrt(ea * eb)), 0.5 * (sa + sb)

    eps = np.array([[params(a, b)[0] for b in z] for a in z])
    sig = np.array([[params(a, b)[1] for b in z] for a in z])
    out = np.zeros((len(pos), 3, 3))
    for img in itertools.product(*image_ranges(cell, [True] * 3, cutoff)):
        d = pos[None, :, :] + np.asarray(img, dtype=np.float64) @ cell - pos[:, None, :]
        r2 = (d * d).sum(-1)
        mask = r2 < cutoff * cutoff
        if img == (0, 0, 0):
            np.fill_diagonal(mask, False)
        r2 = np.where(mask, r2, 1.0)
        sr6 = (sig * sig / r2) ** 3
        minus_dphi_over_r = np.where(mask, 24 * eps * (2 * sr6 * sr6 - sr6) / r2, 0.0)
        out += 0.5 * np.einsum("ij,ija,ijb->iab", minus_dphi_over_r, d, d)
    return out


@pytest.mark.parametrize(("backend", "half", "mode"), _PATHS, ids=_IDS)
@pytest.mark.parametrize("geometry", sorted(_GEOMETRIES))
def test_atom_virials_equal_a_brute_force_and_sum_to_the_virial(
    geometry: str, backend: str, half: bool, mode: ForceMode
) -> None:
    b = _batch(geometry)
    out = _model(backend, half, mode)(b)
    w = out["atom_virials"]
    assert w.shape == (b.n_atoms, 3, 3) and w.dtype == torch.float64
    ref = torch.from_numpy(_brute_atom_virials(b, 2.5))
    scale = float(ref.abs().max())
    assert scale > 1.0  # a real test: the atoms interact
    torch.testing.assert_close(w, ref, rtol=0, atol=1e-12 * scale)
    torch.testing.assert_close(w.sum(0), out["virial"][0], rtol=0, atol=1e-12 * scale)
    # the same relation to the stress as the system values: stress = -sum(W) / V
    volume = abs(float(torch.linalg.det(b.cell[0])))
    torch.testing.assert_close(-w.sum(0) / volume, out["stress"][0], rtol=0, atol=1e-12 * scale)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("half", [True, False], ids=["half", "full"])
@pytest.mark.parametrize("device", DEVICES)
def test_warp_atom_virials_on_each_device_and_dtype(
    device: str, half: bool, dtype: torch.dtype
) -> None:
    """The Warp variant kernel (its own module) on every device and float type,
    against the float64 brute force: 1e-12 of the scale in float64, 1e-5 in float32."""
    b = _batch("triclinic", seed=4)
    ref = torch.from_numpy(_brute_atom_virials(b, 2.5))
    scale = float(ref.abs().max())
    assert scale > 1.0
    moved = b.replace(positions=b.positions.to(dtype), cell=b.cell.to(dtype)).to(device)
    out = _model("warp", half, ForceMode.DIRECT).to(device)(moved)
    w = out["atom_virials"]
    assert w.device.type == device and w.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(w.double().cpu(), ref, rtol=0, atol=tol * scale)
    torch.testing.assert_close(
        w.sum(0).double().cpu(), out["virial"][0].double().cpu(), rtol=0, atol=tol * scale
    )


@pytest.mark.parametrize(("backend", "half", "mode"), _PATHS, ids=_IDS)
def test_two_systems_and_no_stress_still_give_the_atom_virials(
    backend: str, half: bool, mode: ForceMode
) -> None:
    a, c = _batch("cubic", seed=1), _batch("triclinic", seed=2)
    both = Batch.concatenate([a, c.replace(atom_ids=c.atom_ids + 100)])
    model = _model(backend, half, mode)
    out = model(both, compute_stress=False)
    assert "virial" not in out and "stress" not in out
    alone = torch.cat([model(a)["atom_virials"], model(c)["atom_virials"]])
    torch.testing.assert_close(out["atom_virials"], alone, rtol=0, atol=1e-10)


def test_per_atom_stresses_are_those_of_ases_lennard_jones() -> None:
    """``Batch.to_ase`` writes ``-W_i / V`` in Voigt order: ASE's own LJ calculator
    (unsmoothed, energy shifted at the cutoff) gives the same ``get_stresses()``."""
    pytest.importorskip("ase")
    from ase.calculators.lj import LennardJones as AseLJ

    cell = _TRICLINIC * 2.0  # ASE's neighbour list: a cell wider than the cutoff
    pos = jittered_lattice((3, 3, 3), cell, 0.08, 3)
    b = make_batch(pos, cell, [True, True, True], [18] * len(pos), torch.float64)
    out = _model("warp", True, ForceMode.DIRECT)(b)
    kept = b.replace(
        energy=out["energy"],
        forces=out["forces"],
        stress=out["stress"],
        atom_extras={"atom_virials": out["atom_virials"]},
    )
    atoms = kept.to_ase()[0]
    ours = atoms.get_stresses()
    oracle = atoms.copy()
    oracle.calc = AseLJ(sigma=1.0, epsilon=1.0, rc=2.5, smooth=False)  # type: ignore[no-untyped-call]
    ref = oracle.get_stresses()
    assert ours.shape == (b.n_atoms, 6) and float(np.abs(ref).max()) > 0.01
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-14)
    np.testing.assert_allclose(ours.sum(0), atoms.get_stress(), rtol=0, atol=1e-14)


@pytest.mark.parametrize(("backend", "half", "mode"), _PATHS, ids=_IDS)
def test_owned_receivers_give_exact_owned_rows_and_zero_ghost_rows(
    backend: str, half: bool, mode: ForceMode
) -> None:
    """Seam (c), emulated: each rank's owned rows are the full system's rows, ghost
    rows are zero, so the runtime keeps owned rows and folds nothing."""
    full = _batch("triclinic", seed=4)
    model = _model(backend, half, mode)
    reference = model(full)["atom_virials"]
    assembled = torch.zeros_like(reference)
    for owned in (torch.arange(0, 27, 2), torch.arange(1, 27, 2)):
        layout = ghost_layout(full, owned, 2.5)
        w = model(layout.batch, n_receivers=layout.n_owned)["atom_virials"]
        assert w.shape[0] == layout.batch.n_atoms > layout.n_owned
        assert float(w[layout.n_owned :].abs().max()) == 0.0
        assembled[layout.source[: layout.n_owned]] = w[: layout.n_owned]
    torch.testing.assert_close(assembled, reference, rtol=0, atol=1e-11)


def test_atom_virials_are_opt_in_and_part_of_the_config() -> None:
    b = _batch("cubic")
    for backend in ("torch", "warp"):
        plain = _model(backend, True, ForceMode.DIRECT, atom_virials=False)
        assert "atom_virials" not in plain(b)
    warp = _model("warp", True, ForceMode.DIRECT, atom_virials=False)
    warp(b)
    # the default path never launches the per-atom kernel variant
    assert warp._warp._kernel.recorded == 1 and warp._warp._atom_kernel.recorded == 0
    on = LJConfig(cutoff=2.5, epsilon=1.0, sigma=1.0, atom_virials=True)
    off = LJConfig(cutoff=2.5, epsilon=1.0, sigma=1.0)
    assert on != off and hash(on) != hash(off) and pickle.loads(pickle.dumps(on)) == on
    assert "atom_virials=True" in repr(LennardJones(on))
    with pytest.raises(ConfigurationError, match="atom_virials must be a bool, got 'yes'"):
        LJConfig(cutoff=2.5, epsilon=1.0, sigma=1.0, atom_virials="yes")  # type: ignore[arg-type]


def test_the_compiled_torch_path_returns_the_eager_atom_virials() -> None:
    from nvdd.spec import CompilePolicy

    torch._dynamo.reset()
    b = _batch("triclinic", seed=5)
    eager = _model("torch", True, ForceMode.DIRECT)
    compiled = _model("torch", True, ForceMode.DIRECT)
    assert compiled.compile_forward(CompilePolicy(enabled=True, backend="aot_eager")) is True
    want, got = eager(b), compiled(b)
    assert compiled._core is not None and set(got) == set(want)
    torch.testing.assert_close(got["atom_virials"], want["atom_virials"], rtol=0, atol=1e-10)
    torch.testing.assert_close(got["atom_virials"].sum(0), got["virial"][0], rtol=0, atol=1e-10)
