"""The conformance kit: LJ and the reference MPNN pass it, wrong specs and vacuous
setups fail it, and the boundary variants are what they claim."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from nvdd.core import Batch, ConfigurationError
from nvdd.models import LennardJones, LJConfig, MPNNConfig, ReferenceMPNN
from nvdd.shardtensor import current_dd_context
from nvdd.spec import SPEC_LJ_HALO
from nvdd.testing import (
    CaseResult,
    ConformanceError,
    ConformanceReport,
    DDTolerances,
    assert_dd_equivalent,
    boundary_variant,
)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _lattice(n: tuple[int, int, int], spacing: float, species: tuple[int, ...], seed: int) -> Batch:
    """A jittered simple-cubic lattice with shuffled atom ids."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.stack(
        torch.meshgrid(*[torch.arange(k, dtype=torch.float64) for k in n], indexing="ij"), -1
    ).reshape(-1, 3)
    positions = (grid + 0.5) * spacing + 0.03 * spacing * torch.randn(
        grid.shape[0], 3, generator=g, dtype=torch.float64
    )
    m = grid.shape[0]
    return Batch(
        positions=positions,
        atomic_numbers=torch.tensor(species)[torch.randint(len(species), (m,), generator=g)],
        cell=torch.diag(torch.tensor(n, dtype=torch.float64) * spacing),
        pbc=[True, True, True],
        atom_ids=torch.randperm(m, generator=g) * 5 + 2,
    )


def _lj() -> LennardJones:
    return LennardJones(LJConfig(cutoff=2.5, species={18: (0.02, 1.0), 36: (0.025, 1.1)}, skin=0.3))


def _mpnn() -> ReferenceMPNN:
    return ReferenceMPNN(MPNNConfig(cutoff=2.6, species=(1, 8), hidden=8, n_basis=6, seed=3))


@pytest.mark.gloo
def test_lennard_jones_passes_on_every_boundary_class() -> None:
    report = assert_dd_equivalent(
        _lj(), _lattice((7, 5, 5), 1.12, (18, 36), seed=1), ranks=(2, 3), steps=10, dt_fs=1.0
    )
    assert isinstance(report, ConformanceReport) and report.passed
    assert [(c.system, c.world_size) for c in report.cases] == [
        (s, w) for w in (2, 3) for s in ("periodic", "triclinic", "mixed", "open")
    ]
    for case in report.cases:
        assert isinstance(case, CaseResult) and case.passed and any(case.n_ghost)
        assert case.errors["cross_rank_pairs"] > 0
        assert case.errors["forces"] <= 1e-10 and case.errors["positions"] <= 1e-8
    # LennardJones's own spec: SPEC_LJ_HALO with forces exact on owned rows (record 0093)
    assert (
        "spec 'SPEC_LJ_HALO | owned forces': the preset SPEC_LJ_HALO with outputs['forces'] "
        "is per_node/owned_only"
    ) in report.summary()


@pytest.mark.gloo
def test_reference_mpnn_passes_float64_and_float32() -> None:
    batch = _lattice((6, 4, 4), 1.3, (1, 8), seed=2)
    assert assert_dd_equivalent(_mpnn(), batch, ranks=(3,), steps=5).passed
    mpnn32 = ReferenceMPNN(_mpnn().config, dtype=torch.float32)
    report = assert_dd_equivalent(
        mpnn32, batch.to(dtype=torch.float32), ranks=(2,), steps=5, systems=("triclinic",)
    )
    assert report.passed and report.cases[0].limits["forces"] < 1e-3


@pytest.mark.gloo
def test_a_wrong_spec_fails_and_the_message_names_it() -> None:
    """The MPNN's energy is already global on every rank; SPEC_LJ_HALO declares it a
    per-rank partial, so the runtime sums it again."""
    batch = _lattice((6, 4, 4), 1.3, (1, 8), seed=2)
    with pytest.raises(ConformanceError) as info:
        assert_dd_equivalent(
            _mpnn(), batch, ranks=(2,), steps=2, systems=("periodic",), spec=SPEC_LJ_HALO
        )
    text = str(info.value)
    assert "FAILED" in text and "spec 'SPEC_LJ_HALO'" in text
    assert "energy differ by" in text and "trace_and_validate" in text
    assert isinstance(info.value, AssertionError)


@pytest.mark.gloo
def test_a_decomposition_without_ghosts_cannot_pass() -> None:
    """Atoms farther apart than the cutoff: no interaction crosses a rank boundary
    (the halo still holds atoms), so nothing could ever differ."""
    sparse = _lattice((4, 2, 2), 4.0, (18,), seed=3)
    with pytest.raises(ConformanceError, match="no pair of atoms within the cutoff straddles"):
        assert_dd_equivalent(_lj(), sparse, ranks=(2,), steps=1, systems=("open",))


class FailsUnderDD(LennardJones):
    """Raises inside a live DD context (a model bug that only decomposition shows)."""

    def forward(self, batch: Batch, **kwargs: Any) -> Any:
        if current_dd_context().is_distributed:
            raise RuntimeError("boom under DD")
        return super().forward(batch, **kwargs)


@pytest.mark.gloo
def test_a_model_that_raises_under_dd_is_reported_per_case() -> None:
    model = FailsUnderDD(_lj().config)
    batch = _lattice((7, 5, 5), 1.12, (18,), seed=1)
    with pytest.raises(ConformanceError) as info:
        assert_dd_equivalent(model, batch, ranks=(2,), steps=1, systems=("periodic", "open"))
    text = str(info.value)
    assert text.count("the decomposed run raised: RuntimeError: boom under DD") == 2


def test_arguments_are_checked() -> None:
    batch = _lattice((3, 3, 3), 1.3, (18,), seed=0)
    with pytest.raises(ConfigurationError, match="ranks must be ints >= 2"):
        assert_dd_equivalent(_lj(), batch, ranks=(1,))
    with pytest.raises(ConfigurationError, match="unknown system variant 'slab'"):
        assert_dd_equivalent(_lj(), batch, ranks=(2,), systems=("slab",))
    with pytest.raises(ConfigurationError, match="needs a cell with a positive volume"):
        boundary_variant(batch.replace(cell=torch.zeros(1, 3, 3, dtype=torch.float64)), "mixed")
    with pytest.raises(ConfigurationError, match="no default tolerances"):
        DDTolerances.for_dtype(torch.float16)


def test_boundary_variants() -> None:
    batch = _lattice((3, 3, 3), 1.3, (18,), seed=0)
    for name, pbc in (
        ("periodic", [True] * 3),
        ("mixed", [True, True, False]),
        ("open", [False] * 3),
    ):
        b = boundary_variant(batch, name)
        assert b.pbc[0].tolist() == pbc and torch.equal(b.cell, batch.cell)
        assert torch.equal(b.atom_ids, batch.atom_ids)
    tri = boundary_variant(batch, "triclinic")
    c = tri.cell[0]
    assert float(c[1, 0]) > 0.1 and float(c[2, 1]) > 0.1  # skewed: off-diagonal terms
    torch.testing.assert_close(tri.cell[0].det(), batch.cell[0].det(), rtol=1e-12, atol=0)
    # the same crystal: every atom moved by a lattice vector of the original cell
    shift = (tri.positions - batch.positions) @ torch.linalg.inv(batch.cell[0])
    torch.testing.assert_close(shift, torch.round(shift), rtol=0, atol=1e-9)
    tri_frac = tri.positions @ torch.linalg.inv(tri.cell[0])
    assert bool((tri_frac >= 0).all() and (tri_frac < 1).all())
    given = boundary_variant(batch, "given")
    assert torch.equal(given.positions, batch.positions) and given is not batch


def test_public_names_resolve() -> None:
    import nvdd.testing

    for name in nvdd.testing.__all__:
        assert getattr(nvdd.testing, name) is not None, name
    assert issubclass(nvdd.testing.ConformanceError, AssertionError)
