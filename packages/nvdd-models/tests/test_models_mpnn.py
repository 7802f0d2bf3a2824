"""ReferenceMPNN: finite differences, finite strain, smooth cutoff, dtypes, seeds, DD seams."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from models_testutils import (
    DEVICES,
    finite_difference_forces,
    finite_strain_stress,
    fold,
    ghost_layout,
    jittered_lattice,
    make_batch,
)

from nvdd.core import Batch, ConfigurationError, ValidationError
from nvdd.models import MPNNConfig, NeighborList, ReferenceMPNN
from nvdd.testing import assert_close_by_id

_CFG = MPNNConfig(cutoff=2.6, species=(1, 6, 8), hidden=8, n_basis=6, n_layers=2, seed=3)
_TRICLINIC = np.array([[2.2, 0.0, 0.0], [0.5, 2.4, 0.0], [-0.3, 0.4, 2.3]])


def _batch(kind: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> Batch:
    cells = {
        "periodic": (_TRICLINIC, [True, True, True], (2, 2, 2)),  # cell < 2 * cutoff
        "mixed": (_TRICLINIC * 1.3, [True, False, True], (2, 3, 2)),
        "open": (np.eye(3) * 3.0, [False, False, False], (2, 2, 3)),
    }
    cell, pbc, grid = cells[kind]
    pos = jittered_lattice(grid, cell, 0.15, seed)
    z = np.random.default_rng(seed).choice([1, 6, 8], size=len(pos)).tolist()
    return make_batch(pos, cell, pbc, z, dtype)


def _energy(model: ReferenceMPNN, **kw: Any) -> Any:
    return lambda b: model(b, compute_stress=False, **kw)["energy"]


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("kind", ["periodic", "mixed", "open"])
def test_forces_are_minus_the_energy_gradient(kind: str, layers: int) -> None:
    b = _batch(kind, seed=1)
    model = ReferenceMPNN(MPNNConfig(**{**_CFG.__dict__, "n_layers": layers}))
    forces = model(b)["forces"]
    expected = finite_difference_forces(_energy(model), b, h=1e-5)
    assert float(forces.abs().max()) > 1e-2
    torch.testing.assert_close(forces, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kind", ["periodic", "mixed"])
def test_stress_is_the_finite_strain_derivative(kind: str) -> None:
    b = _batch(kind, seed=2)
    model = ReferenceMPNN(_CFG)
    out = model(b)
    expected = finite_strain_stress(_energy(model), b, h=1e-6)
    assert float(out["stress"].abs().max()) > 1e-3
    torch.testing.assert_close(out["stress"], expected, rtol=1e-6, atol=1e-9)
    volume = torch.linalg.det(b.cell).abs()
    torch.testing.assert_close(out["stress"], -out["virial"] / volume[:, None, None])


def test_open_system_stress_is_zero_without_volume_but_virial_is_exact() -> None:
    b = _batch("open", seed=3)
    b = b.replace(cell=torch.zeros_like(b.cell))
    out = ReferenceMPNN(_CFG)(b)
    assert float(out["stress"].abs().max()) == 0.0
    # virial = -dE/d strain, by finite strain with a unit "volume"
    expected = finite_strain_stress(
        _energy(ReferenceMPNN(_CFG)), b.replace(cell=torch.eye(3, dtype=b.dtype)[None])
    )
    torch.testing.assert_close(out["virial"], -expected, rtol=1e-6, atol=1e-9)


def test_energy_and_forces_are_continuous_at_the_cutoff() -> None:
    model = ReferenceMPNN(_CFG)
    rc = _CFG.cutoff

    def dimer(r: float) -> dict[str, torch.Tensor]:
        pos = np.array([[0.0, 0.0, 0.0], [r, 0.0, 0.0]])
        return dict(model(make_batch(pos, np.zeros((3, 3)), [False] * 3, [6, 8])))

    inside, outside, far = dimer(rc - 1e-4), dimer(rc + 1e-4), dimer(rc + 1.0)
    torch.testing.assert_close(outside["energy"], far["energy"], rtol=0, atol=0)  # no edge at all
    assert float((inside["energy"] - outside["energy"]).abs()) < 1e-10
    assert float(inside["forces"].abs().max()) < 1e-7 and float(outside["forces"].abs().max()) == 0
    closer = dimer(rc - 0.5)
    assert float((closer["energy"] - far["energy"]).abs()) > 1e-4  # the pair does interact


def test_float32_agrees_with_float64() -> None:
    b = _batch("periodic", seed=4)
    out64 = ReferenceMPNN(_CFG)(b)
    model32 = ReferenceMPNN(_CFG, dtype=torch.float32)
    out32 = model32(b.to(dtype=torch.float32))
    assert model32.dtype == torch.float32 and out32["forces"].dtype == torch.float32
    torch.testing.assert_close(out32["energy"].double(), out64["energy"], rtol=1e-5, atol=1e-6)
    scale = float(out64["forces"].abs().max())
    torch.testing.assert_close(out32["forces"].double(), out64["forces"], rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(
        out32["stress"].double(),
        out64["stress"],
        rtol=0,
        atol=1e-5 * float(out64["stress"].abs().max()),
    )


def test_dtype_mismatch_and_unknown_species_raise() -> None:
    b = _batch("open")
    with pytest.raises(
        ValidationError,
        match=r"rank 0: batch is torch.float32 but the model.s parameters are torch.float64",
    ):
        ReferenceMPNN(_CFG)(b.to(dtype=torch.float32))
    z = b.atomic_numbers.clone()
    z[2] = 18
    with pytest.raises(ValidationError, match=r"atomic_numbers\[2\] = 18 has no parameters"):
        ReferenceMPNN(_CFG)(b.replace(atomic_numbers=z))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cutoff": -1.0}, "cutoff"),
        ({"species": ()}, "at least one"),
        ({"species": (1, 1)}, "twice"),
        ({"n_layers": 0}, "n_layers"),
        ({"hidden": 2.5}, "hidden"),
        ({"envelope_exponent": 1}, "envelope_exponent"),
    ],
)
def test_bad_configs_raise(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        ReferenceMPNN(MPNNConfig(**kwargs))


def test_initialisation_is_deterministic_from_the_seed() -> None:
    a, b, c = (
        ReferenceMPNN(_CFG),
        ReferenceMPNN(_CFG),
        ReferenceMPNN(MPNNConfig(**{**_CFG.__dict__, "seed": 4})),
    )
    torch.manual_seed(123)  # the global RNG plays no part
    d = ReferenceMPNN(_CFG)
    for (name, pa), pb, pd in zip(
        a.named_parameters(), b.parameters(), d.parameters(), strict=True
    ):
        assert torch.equal(pa, pb) and torch.equal(pa, pd), name
    assert not torch.equal(a.embedding, c.embedding)
    batch = _batch("mixed", seed=5)
    assert torch.equal(a(batch)["energy"], b(batch)["energy"])


@pytest.mark.parametrize("device", DEVICES)
def test_two_systems_in_one_batch_equal_separate_runs(device: str) -> None:
    first, second = _batch("periodic", 6), _batch("mixed", 7)
    both = Batch.concatenate([first, second.replace(atom_ids=second.atom_ids + 100)])
    model = ReferenceMPNN(_CFG, device=device)
    out = model(both.to(device))
    for s, single in enumerate((first, second)):
        alone = model(single.to(device))
        rows = both.system_index.to(device) == s
        torch.testing.assert_close(out["energy"][s], alone["energy"][0], rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(out["forces"][rows], alone["forces"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out["stress"][s], alone["stress"][0], rtol=1e-12, atol=1e-12)


def test_row_order_does_not_matter() -> None:
    b = _batch("periodic", 8)
    b = b.replace(atom_ids=torch.arange(b.n_atoms) * 7 + 3)
    perm = torch.randperm(b.n_atoms, generator=torch.Generator().manual_seed(0))
    model = ReferenceMPNN(_CFG)
    out, out_p = model(b), model(b.reorder(perm))
    torch.testing.assert_close(out_p["energy"], out["energy"], rtol=1e-13, atol=0)
    assert_close_by_id(
        b.reorder(perm).atom_ids, out_p["forces"], b.atom_ids, out["forces"], atol=1e-12
    )


def test_create_graph_lets_forces_train_the_parameters() -> None:
    model = ReferenceMPNN(_CFG)
    out = model(_batch("periodic", 9), create_graph=True)
    loss = (out["forces"] ** 2).sum() + out["energy"].sum()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    assert float(model.layers[0].filter_in.weight.grad.abs().max()) > 0  # type: ignore[union-attr]
    assert not model(_batch("periodic", 9))["forces"].requires_grad


# ------------------------------------------------------------------- DD seams
@pytest.mark.parametrize("n_receivers", [4, 9])
def test_forces_with_a_receiver_filter_are_minus_the_local_energy_gradient(
    n_receivers: int,
) -> None:
    """Seams (a)-(c): only the first rows' energies count; forces on every row."""
    b = _batch("open", seed=10)
    model = ReferenceMPNN(_CFG)
    out = model(b, n_receivers=n_receivers)
    expected = finite_difference_forces(_energy(model, n_receivers=n_receivers), b, h=1e-5)
    torch.testing.assert_close(out["forces"], expected, rtol=1e-6, atol=1e-8)
    assert float(out["forces"][n_receivers:].abs().max()) > 1e-3  # ghost rows feel the owned rows
    assert float(out["energy"]) == pytest.approx(
        float(out["atom_energies"][:n_receivers].sum()), rel=1e-13
    )


def test_one_layer_emulated_domain_decomposition_is_exact() -> None:
    """With one layer no ghost features need refreshing: two emulated ranks add up."""
    cfg = MPNNConfig(**{**_CFG.__dict__, "n_layers": 1})
    full = _batch("periodic", seed=11)
    reference = ReferenceMPNN(cfg)(full)
    energy, forces = (
        torch.zeros(1, dtype=torch.float64),
        torch.zeros(full.n_atoms, 3, dtype=torch.float64),
    )
    for owned in (torch.tensor([0, 3, 5]), torch.tensor([1, 2, 4, 6, 7])):
        layout = ghost_layout(full, owned, cfg.cutoff)
        out = ReferenceMPNN(cfg)(layout.batch, n_receivers=layout.n_owned)
        energy += out["energy"]
        forces += fold(out["forces"], layout.source, full.n_atoms)
    torch.testing.assert_close(energy, reference["energy"], rtol=1e-12, atol=0)
    torch.testing.assert_close(forces, reference["forces"], rtol=0, atol=1e-11)


class _Recorded(torch.Tensor):
    """A per-atom tensor subclass that records the torch functions it meets."""

    seen: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_message_passing_dispatches_through_a_tensor_subclass() -> None:
    """Seam (d): gathers and scatters of per-atom features reach ``__torch_function__``."""
    b = _batch("periodic", seed=12)
    model = ReferenceMPNN(_CFG)
    edges = NeighborList(_CFG.cutoff)(b.positions, b.cell, b.pbc, b.system_index)
    rows = model.species_rows[b.atomic_numbers]
    r = edges.vectors(b.positions, b.cell, b.system_index).norm(dim=1)
    from nvdd.models._radial import radial_features

    radial = radial_features(r, _CFG.cutoff, _CFG.n_basis, _CFG.envelope_exponent)
    h = model.embedding[rows].detach()
    layer = model.layers[0]
    _Recorded.seen.clear()
    out = layer(h.as_subclass(_Recorded), radial, edges.receivers, edges.senders)
    assert type(out) is _Recorded
    assert "index_select" in _Recorded.seen and "index_add_" in _Recorded.seen
    torch.testing.assert_close(
        out.as_subclass(torch.Tensor), layer(h, radial, edges.receivers, edges.senders)
    )
