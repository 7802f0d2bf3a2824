"""LennardJones against a dense all-images brute force, finite strain, ASE, and the DD seams."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from models_testutils import (
    DEVICES,
    brute_lj,
    finite_strain_stress,
    fold,
    ghost_layout,
    jittered_lattice,
    make_batch,
)

from nvdd.core import Batch, ConfigurationError, ValidationError
from nvdd.models import ForceMode, LennardJones, LJBackend, LJConfig, MixingRule
from nvdd.testing import assert_close_by_id, run_ranks

MODES = [ForceMode.DIRECT, ForceMode.AUTOGRAD]

# Two species (Ar-like 18 and a smaller 10) and an explicit unlike pair for 10-36.
_SPECIES = {18: (1.0, 1.0), 10: (0.4, 0.8), 36: (1.3, 1.1)}
_PAIRS = {(36, 10): (0.7, 0.95)}


def _params(za: int, zb: int) -> tuple[float, float]:
    """The pair parameters the config below must produce (written independently)."""
    key = {za, zb}
    if key == {10, 36}:
        return 0.7, 0.95
    (ea, sa), (eb, sb) = _SPECIES[za], _SPECIES[zb]
    return math.sqrt(ea * eb), 0.5 * (sa + sb)


def _model(
    mode: ForceMode,
    cutoff: float = 2.5,
    shift: bool = True,
    skin: float = 0.0,
    backend: str = "auto",
    half_list: bool = True,
) -> LennardJones:
    return LennardJones(
        LJConfig(
            cutoff=cutoff,
            species=_SPECIES,
            pairs=_PAIRS,
            shift_energy=shift,
            force_mode=mode,
            skin=skin,
            backend=LJBackend(backend),
            half_list=half_list,
        )
    )


_TRICLINIC = np.array([[1.9, 0.0, 0.0], [0.5, 2.1, 0.0], [-0.3, 0.4, 2.0]])
_GEOMETRIES = {
    # name: (cell, pbc, atoms per axis) -- spacing about 1.1 sigma
    "cubic_periodic": (np.eye(3) * 3.3, [True, True, True], (3, 3, 3)),
    "triclinic_smaller_than_cutoff": (_TRICLINIC, [True, True, True], (2, 2, 2)),
    "mixed_pbc": (_TRICLINIC * 1.5, [True, False, True], (3, 3, 3)),
    "mixed_zero_open_vector": (
        np.array([[3.3, 0.0, 0.0], [0.0, 0.0, 0.0], [0.6, 0.0, 3.4]]),
        [True, False, True],
        (3, 3, 3),
    ),
    "open": (np.eye(3) * 3.3, [False, False, False], (3, 3, 3)),
}


def _geometry_batch(name: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> Batch:
    cell, pbc, grid = _GEOMETRIES[name]
    lattice = cell if abs(np.linalg.det(cell)) > 0 else cell + np.diag([0, 3.3, 0])
    pos = jittered_lattice(grid, lattice, 0.08, seed)
    z = np.random.default_rng(seed).choice([18, 10, 36], size=len(pos)).tolist()
    return make_batch(pos, cell, pbc, z, dtype)


def _check_against_brute(
    out: dict[str, torch.Tensor], b: Batch, cutoff: float, shift: bool
) -> None:
    energy, forces, atom_e, virial = brute_lj(b, cutoff, _params, shift)
    scale = float(np.abs(forces).max())
    torch.testing.assert_close(out["energy"], torch.tensor(energy), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["atom_energies"], torch.tensor(atom_e), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        out["forces"], torch.tensor(forces), rtol=0, atol=1e-12 * max(1.0, scale)
    )
    torch.testing.assert_close(
        out["virial"], torch.tensor(virial), rtol=1e-12, atol=1e-12 * max(1.0, scale)
    )


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("geometry", sorted(_GEOMETRIES))
def test_lj_equals_brute_force(geometry: str, mode: ForceMode) -> None:
    b = _geometry_batch(geometry)
    out = _model(mode)(b)
    assert out["energy"].shape == (1,) and out["forces"].shape == (b.n_atoms, 3)
    assert out["atom_energies"].shape == (b.n_atoms,) and out["stress"].shape == (1, 3, 3)
    assert float(out["forces"].abs().max()) > 0.1  # a real test: the atoms interact
    _check_against_brute(dict(out), b, 2.5, shift=True)


@pytest.mark.parametrize("device", DEVICES)
def test_lj_without_shift_and_two_systems_in_one_batch(device: str) -> None:
    first, second = (
        _geometry_batch("cubic_periodic", 1),
        _geometry_batch("triclinic_smaller_than_cutoff", 2),
    )
    both = Batch.concatenate([first, second.replace(atom_ids=second.atom_ids + 100)])
    model = _model(ForceMode.DIRECT, shift=False).to(device)
    out = {k: v.cpu() for k, v in model(both.to(device)).items()}
    _check_against_brute(out, both, 2.5, shift=False)
    alone = model(second.to(device))
    torch.testing.assert_close(out["energy"][1], alone["energy"][0].cpu(), rtol=1e-13, atol=0)
    torch.testing.assert_close(
        out["forces"][first.n_atoms :], alone["forces"].cpu(), rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("geometry", ["triclinic_smaller_than_cutoff", "mixed_pbc", "open"])
def test_direct_and_autograd_agree(geometry: str) -> None:
    b = _geometry_batch(geometry, seed=3)
    direct, auto = _model(ForceMode.DIRECT)(b), _model(ForceMode.AUTOGRAD)(b)
    for key in ("energy", "atom_energies", "forces", "virial", "stress"):
        torch.testing.assert_close(direct[key], auto[key], rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize(
    "geometry", ["cubic_periodic", "triclinic_smaller_than_cutoff", "mixed_pbc"]
)
def test_stress_is_the_finite_strain_derivative(geometry: str, mode: ForceMode) -> None:
    b = _geometry_batch(geometry, seed=4)
    model = _model(mode)
    stress = model(b)["stress"]
    expected = finite_strain_stress(lambda x: model(x, compute_stress=False)["energy"], b)
    assert float(stress.abs().max()) > 1e-2
    torch.testing.assert_close(stress, expected, rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(stress, stress.transpose(1, 2), rtol=0, atol=1e-12)


def test_sign_conventions_match_ase() -> None:
    ase = pytest.importorskip("ase")  # a declared test dependency; absent on some GPU hosts
    from ase.calculators.lj import LennardJones as AseLJ

    cell = _TRICLINIC * 1.6
    pos = jittered_lattice((3, 3, 3), cell, 0.1, seed=8)
    atoms = ase.Atoms("Ar" * len(pos), positions=pos, cell=cell, pbc=True)
    atoms.calc = AseLJ(sigma=1.0, epsilon=1.0, rc=2.5, smooth=False)
    model = LennardJones(LJConfig(cutoff=2.5, epsilon=1.0, sigma=1.0))
    out = model(Batch.from_ase(atoms))
    assert float(out["energy"][0]) == pytest.approx(atoms.get_potential_energy(), rel=1e-12)
    np.testing.assert_allclose(out["forces"].numpy(), atoms.get_forces(), rtol=0, atol=1e-11)
    np.testing.assert_allclose(
        out["stress"][0].numpy(), atoms.get_stress(voigt=False), rtol=1e-10, atol=1e-12
    )


def test_energy_shift_makes_the_energy_vanish_at_the_cutoff() -> None:
    cutoff = 2.5
    dimer = make_batch(
        np.array([[0.0, 0, 0], [cutoff - 1e-9, 0, 0]]), np.zeros((3, 3)), [False] * 3, [18, 10]
    )
    eps, sig = _params(18, 10)
    phi_rc = 4 * eps * ((sig / cutoff) ** 12 - (sig / cutoff) ** 6)
    shifted = float(_model(ForceMode.DIRECT, cutoff)(dimer)["energy"][0])
    plain = float(_model(ForceMode.DIRECT, cutoff, shift=False)(dimer)["energy"][0])
    assert abs(shifted) < 1e-9 and plain == pytest.approx(phi_rc, rel=1e-7)
    beyond = dimer.replace(positions=dimer.positions * (cutoff + 1e-9) / (cutoff - 1e-9))
    assert float(_model(ForceMode.DIRECT, cutoff, shift=False)(beyond)["energy"][0]) == 0.0


def test_mixing_rules_and_explicit_pairs() -> None:
    rows, eps, sig = LJConfig(cutoff=2.0, species={1: (0.5, 1.0), 2: (2.0, 3.0)}).tables()
    a, b = int(rows[1]), int(rows[2])
    assert float(eps[a, b]) == pytest.approx(1.0) and float(sig[a, b]) == pytest.approx(2.0)
    _, _, sig_geo = LJConfig(
        cutoff=2.0, species={1: (0.5, 1.0), 2: (2.0, 3.0)}, mixing=MixingRule.GEOMETRIC
    ).tables()
    assert float(sig_geo[a, b]) == pytest.approx(math.sqrt(3.0))
    rows, eps, sig = LJConfig(
        cutoff=2.0, species=_SPECIES, pairs=_PAIRS, epsilon=0.1, sigma=0.5
    ).tables()
    assert float(eps[rows[10], rows[36]]) == float(eps[rows[36], rows[10]]) == 0.7
    assert int(rows[5]) == 3 and float(sig[3, 3]) == 0.5  # unlisted elements use the default
    assert int(rows[18]) != int(rows[10])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cutoff": 0.0, "epsilon": 1.0, "sigma": 1.0}, "cutoff"),
        ({"cutoff": 2.0}, "needs species parameters"),
        ({"cutoff": 2.0, "epsilon": 1.0}, "together"),
        ({"cutoff": 2.0, "species": {18: (-1.0, 1.0)}}, "epsilon >= 0"),
        (
            {"cutoff": 2.0, "species": {18: (1.0, 1.0)}, "pairs": {(18, 2): (1.0, 1.0)}},
            "listed in species",
        ),
        ({"cutoff": 2.0, "species": {200: (1.0, 1.0)}}, "atomic number"),
        ({"cutoff": 2.0, "species": {18: (1.0, 1.0)}, "skin": -1.0}, "skin"),
    ],
)
def test_bad_configs_raise(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        LJConfig(**kwargs)  # type: ignore[arg-type]


def test_config_is_frozen_hashable_and_accepts_mode_strings() -> None:
    cfg = LJConfig(cutoff=2.0, species={18: (1.0, 1.0)}, force_mode="autograd")  # type: ignore[arg-type]
    assert cfg.force_mode is ForceMode.AUTOGRAD
    assert hash(cfg) == hash(
        LJConfig(cutoff=2.0, species={18: (1.0, 1.0)}, force_mode=ForceMode.AUTOGRAD)
    )
    with pytest.raises(TypeError):
        cfg.species[18] = (2.0, 2.0)  # type: ignore[index]
    assert _model(ForceMode.DIRECT).cutoff == 2.5


def test_unknown_species_is_a_validation_error_naming_the_atom() -> None:
    b = _geometry_batch("open")
    z = b.atomic_numbers.clone()
    z[4] = 6
    with pytest.raises(ValidationError, match=r"rank 0: atomic_numbers\[4\] = 6 has no parameters"):
        _model(ForceMode.DIRECT)(b.replace(atomic_numbers=z))


def test_float32_agrees_with_float64() -> None:
    b = _geometry_batch("triclinic_smaller_than_cutoff", seed=5)
    model = _model(ForceMode.DIRECT)
    out64, out32 = model(b), model(b.to(dtype=torch.float32))
    assert out32["forces"].dtype == torch.float32
    scale = float(out64["forces"].abs().max())
    torch.testing.assert_close(out32["energy"].double(), out64["energy"], rtol=1e-5, atol=0)
    torch.testing.assert_close(out32["forces"].double(), out64["forces"], rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("backend", ["torch", "warp"])
def test_verlet_skin_in_the_model_is_exact(backend: str) -> None:
    b = _geometry_batch("mixed_pbc", seed=6)
    cached = _model(ForceMode.DIRECT, skin=0.4, backend=backend)
    plain = _model(ForceMode.DIRECT, backend=backend)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        b = b.replace(
            positions=b.positions
            + 0.02 * torch.randn(b.n_atoms, 3, generator=gen, dtype=torch.float64)
        )
        a, c = cached(b), plain(b)
        torch.testing.assert_close(a["forces"], c["forces"], rtol=1e-13, atol=1e-13)
    lists = (cached.neighbors, plain.neighbors)
    if backend == "warp":
        lists = (cached.device_neighbors, plain.device_neighbors)  # type: ignore[assignment]
    assert [n.n_builds for n in lists] == [1, 3]


# ------------------------------------------------------------ DD seams (b), (c)
@pytest.mark.parametrize("n_receivers", [0, 9, 27])
def test_direct_forces_are_minus_the_gradient_of_the_local_energy(n_receivers: int) -> None:
    """With a receiver filter and ``ghost_forces=True``, the edge pushes half its
    pair force onto both ends; by default (direct forces: the model's spec says
    owned rows are exact) the receivers get whole forces and the rest none."""
    b = _geometry_batch("open", seed=9)
    model = _model(ForceMode.DIRECT)
    direct = model(b, n_receivers=n_receivers, ghost_forces=True)
    auto = _model(ForceMode.AUTOGRAD)(b, n_receivers=n_receivers)
    for key in ("energy", "forces", "virial"):
        torch.testing.assert_close(direct[key], auto[key], rtol=1e-12, atol=1e-12, msg=key)
    if 0 < n_receivers < b.n_atoms:
        assert float(direct["forces"][n_receivers:].abs().max()) > 0  # ghost rows get forces
        assert float(direct["atom_energies"][n_receivers:].abs().max()) == 0
    owned = model(b, n_receivers=n_receivers)  # the default: complete receiver rows
    whole = model(b)["forces"]
    torch.testing.assert_close(
        owned["forces"][:n_receivers], whole[:n_receivers], rtol=1e-12, atol=1e-12
    )
    assert float(owned["forces"][n_receivers:].abs().sum()) == 0
    for key in ("energy", "virial"):
        torch.testing.assert_close(owned[key], direct[key], rtol=1e-12, atol=1e-12, msg=key)


def _rank_share(full: Batch, owned: torch.Tensor, mode: ForceMode) -> tuple[torch.Tensor, ...]:
    """One emulated rank: [owned | ghost] rows, open boundaries, owned receivers."""
    layout = ghost_layout(full, owned, 2.5)
    out = _model(mode)(layout.batch, n_receivers=layout.n_owned)
    return (
        out["energy"],
        fold(out["forces"], layout.source, full.n_atoms),
        out["virial"],
        fold(out["atom_energies"][: layout.n_owned], layout.source[: layout.n_owned], full.n_atoms),
    )


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_emulated_domain_decomposition_reproduces_the_full_system(mode: ForceMode) -> None:
    full = _geometry_batch("triclinic_smaller_than_cutoff", seed=10)
    reference = _model(mode)(full)
    parts = [
        _rank_share(full, owned, mode)
        for owned in (torch.arange(0, 8, 3), torch.tensor([1, 2, 4, 5, 7]))
    ]
    total = [sum(p[k] for p in parts) for k in range(4)]
    torch.testing.assert_close(total[0], reference["energy"], rtol=1e-12, atol=0)
    torch.testing.assert_close(total[1], reference["forces"], rtol=0, atol=1e-11)
    torch.testing.assert_close(total[2], reference["virial"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total[3], reference["atom_energies"], rtol=1e-12, atol=1e-12)


def _gloo_rank() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    full = _geometry_batch("cubic_periodic", seed=12)
    owned = torch.arange(rank, full.n_atoms, world)  # round-robin ownership
    energy, forces, virial, _ = _rank_share(full, owned, ForceMode.DIRECT)
    for t in (energy, forces, virial):
        dist.all_reduce(t)
    return full.atom_ids, forces, energy, virial


@pytest.mark.gloo
def test_two_gloo_ranks_sum_to_the_single_process_result() -> None:
    full = _geometry_batch("cubic_periodic", seed=12)
    reference = _model(ForceMode.DIRECT)(full)
    results = run_ranks(_gloo_rank, 2, timeout_s=120)
    for ids, forces, energy, virial in results:
        assert_close_by_id(
            ids, forces, full.atom_ids, reference["forces"], atol=1e-10, what="forces"
        )
        torch.testing.assert_close(energy, reference["energy"], rtol=1e-12, atol=0)
        torch.testing.assert_close(virial, reference["virial"], rtol=1e-12, atol=1e-12)


def test_species_check_names_the_first_bad_atom_with_one_read() -> None:
    from nvdd.models._species import check_species, species_table

    table = species_table((1, 8))
    assert check_species(table, torch.tensor([8, 1, 1])) is None
    assert check_species(table, torch.tensor([], dtype=torch.int64)) is None
    # an atomic number outside the table is reported before an unknown one
    got = check_species(table, torch.tensor([6, 1, 200, -1]))
    assert got == "atomic_numbers[2] = 200 is outside 0..118", got
    got = check_species(table, torch.tensor([1, 8, 6]))
    assert got is not None and got.startswith("atomic_numbers[2] = 6 has no parameters"), got
