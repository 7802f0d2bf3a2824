"""Ghosts only where a neighbour rank is (``DomainConfig(wrap_whole_axes=True)``,
record 0079): along a periodic axis the rank grid leaves whole, the model's
neighbour list applies the periodicity and the halo sends no image rows.

One launch of 2 gloo ranks runs the shipped Lennard-Jones and reference MPNN on
a ``2x1x1`` grid (y and z whole) of a periodic, a mixed and a triclinic box,
and counts the ghost rows with and without the option; the test process
compares every trajectory with one process by atom id.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nvdd.core import Batch, ConfigurationError
from nvdd.dynamics import (
    DistributedModel,
    DistributedPipelineModel,
    DomainConfig,
    DomainParallel,
    VelocityVerlet,
)
from nvdd.models import LennardJones, LJConfig, MPNNConfig, ReferenceMPNN
from nvdd.spec import (
    SPEC_LJ_HALO,
    SPEC_MPNN_HALO,
    ScatterMode,
    StrategyKind,
    StrategyOptions,
    receptive_field_spec,
)
from nvdd.testing import assert_close_by_id, run_ranks

#: name -> (cell, pbc). The triclinic box's z spacing (about 7.9 A) is below
#: twice the LJ cutoff: the model meets several images along a whole axis.
BOXES: dict[str, tuple[list[list[float]], tuple[bool, bool, bool]]] = {
    "periodic": ([[13.0, 0, 0], [0, 10.0, 0], [0, 0, 9.6]], (True, True, True)),
    "mixed": ([[13.0, 0, 0], [0, 10.0, 0], [0, 0, 9.6]], (True, False, True)),
    "triclinic": ([[13.0, 0, 0], [1.5, 10.0, 0], [-1.0, 0.8, 8.0]], (True, True, True)),
}
N_STEPS = 6
SKIN = 0.6


def _batch(box: str) -> Batch:
    cell, pbc = BOXES[box]
    g = torch.Generator().manual_seed(3)
    axes = (torch.arange(4), torch.arange(3), torch.arange(3))
    frac = (torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3) + 0.5) / (
        torch.tensor([4.0, 3.0, 3.0])
    )
    frac = frac.double() + 0.03 * torch.randn(frac.shape, generator=g, dtype=torch.float64)
    n = frac.shape[0]
    c = torch.tensor(cell, dtype=torch.float64)
    return Batch(
        positions=frac @ c,
        atomic_numbers=torch.full((n,), 18),
        velocities=torch.randn(n, 3, generator=g, dtype=torch.float64) * 0.01,
        cell=c,
        pbc=list(pbc),
        atom_ids=torch.randperm(n, generator=g) * 5 + 2,
    )


#: (model, box): LJ's Warp half list (the default) on every box, its full list
#: and its torch backend on the triclinic box, the reference MPNN on every box
#: (and on its device edges on the triclinic box).
CASES = [
    *(("lj", box) for box in BOXES),
    ("lj-full", "triclinic"),
    ("lj-torch", "triclinic"),
    *(("mpnn", box) for box in BOXES),
    ("mpnn-device", "triclinic"),
]


def _model(kind: str) -> Any:
    from nvdd.models import LJBackend

    if kind.startswith("lj"):
        backend = LJBackend.TORCH if kind == "lj-torch" else LJBackend.AUTO
        config = LJConfig(
            cutoff=4.5,
            epsilon=0.0104,
            sigma=3.0,
            skin=SKIN,
            backend=backend,
            half_list=kind != "lj-full",
        )
        return LennardJones(config)
    edges = "device" if kind == "mpnn-device" else "auto"
    config = MPNNConfig(
        cutoff=3.6, species=(18,), hidden=8, n_layers=2, seed=7, skin=SKIN, neighbors=edges
    )
    return ReferenceMPNN(config, dtype=torch.float64)


def _dd(kind: str, box: str, wrap: bool) -> dict[str, Any]:
    model = _model(kind)
    dyn = VelocityVerlet(model, _batch(box), dt_fs=2.0)
    config = DomainConfig(
        cutoff=float(model.cutoff), skin=SKIN, grid_dims=(2, 1, 1), wrap_whole_axes=wrap
    )
    with DomainParallel(dyn, config) as dp:
        dp.partition()
        provider = dp.model
        assert isinstance(provider, DistributedModel)
        ghosts = provider.plan.n_ghost
        local_pbc = provider._static.pbc.tolist() if provider._static is not None else None
        dp.run(N_STEPS)
        out = dp.gather(0)
        rebuilds = dp.stats.rebuilds
    got = {"ghosts": ghosts, "pbc": local_pbc, "rebuilds": rebuilds}
    if out is not None:
        got.update(ids=out.atom_ids, forces=out.forces, energy=out.energy)
    return got


def _all_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, box in CASES:
        out[f"{kind}-{box}"] = _dd(kind, box, wrap=True)
        dyn = VelocityVerlet(_model(kind), _batch(box), dt_fs=2.0)
        config = DomainConfig(cutoff=float(dyn.model.cutoff), skin=SKIN, grid_dims=(2, 1, 1))
        with DomainParallel(dyn, config) as dp:  # ghost rows of the default halo
            dp.partition()
            assert isinstance(dp.model, DistributedModel)
            out[f"{kind}-{box}-images"] = dp.model.plan.n_ghost
    return out


@pytest.mark.gloo
def test_whole_axes_left_to_the_model_equal_one_process_by_id_with_fewer_ghosts() -> None:
    ranks = run_ranks(_all_cases, 2, timeout_s=240)
    for kind, box in CASES:
        pbc = BOXES[box][1]
        name = f"{kind}-{box}"
        got = ranks[0][name]
        # the padded rows are periodic exactly along the whole periodic axes
        assert got["pbc"] == [[False, pbc[1], pbc[2]]], name
        # fewer ghost rows on every rank: no images across the y and z faces
        for r in ranks:
            assert 0 < r[name]["ghosts"] < r[f"{name}-images"], (name, r[name]["ghosts"])
        ref = VelocityVerlet(_model(kind), _batch(box), dt_fs=2.0)
        ref.run(N_STEPS)
        assert float(ref.batch.forces.abs().max()) > 1e-3
        assert_close_by_id(
            got["ids"], got["forces"], ref.batch.atom_ids, ref.batch.forces,
            atol=1e-10, what=f"{name} forces",
        )  # fmt: skip
        torch.testing.assert_close(got["energy"], ref.batch.energy, rtol=0, atol=1e-10)
        assert got["rebuilds"] >= 1


NO_WRAP = SPEC_LJ_HALO.replace(options=StrategyOptions(), name="LJ without wrapping")
NO_WRAP_MPNN = SPEC_MPNN_HALO.replace(
    options=StrategyOptions(scatter=ScatterMode.LOCAL), name="MPNN without wrapping"
)


class _UsersLJ(LennardJones):
    """A model defined outside nvdd (here: in this test module)."""

    def __init__(self) -> None:
        super().__init__(LJConfig(cutoff=4.5, epsilon=0.01, sigma=3.0))


def test_only_specs_that_declare_it_lose_their_image_rows() -> None:
    config = DomainConfig(cutoff=4.5, wrap_whole_axes=True)
    lj = DistributedModel(LennardJones(LJConfig(cutoff=4.5, epsilon=0.01, sigma=3.0)), config)
    assert lj.wraps_whole_axes
    assert not DistributedModel(lj.model, DomainConfig(cutoff=4.5)).wraps_whole_axes  # default
    # a spec that does not declare it keeps image rows, and so does a pipeline
    # with one such component (one halo for all)
    assert not DistributedModel(lj.model, config, spec=NO_WRAP).wraps_whole_axes
    assert DistributedPipelineModel([lj.model, _model("mpnn")], config).wraps_whole_axes
    mpnn = ReferenceMPNN(MPNNConfig(cutoff=3.6, species=(18,)), spec=NO_WRAP_MPNN)
    assert not DistributedPipelineModel([lj.model, mpnn], config).wraps_whole_axes
    # a model of the user's declaring a preset that takes it keeps image rows
    # too (nothing checked that its neighbour list honours pbc under a halo)
    assert SPEC_LJ_HALO.options.wraps_periodic_axes
    assert not DistributedModel(_UsersLJ(), config).wraps_whole_axes
    assert not DistributedPipelineModel([lj.model, _UsersLJ()], config).wraps_whole_axes
    with pytest.raises(ConfigurationError, match="wrap_whole_axes must be a bool"):
        DomainConfig(cutoff=4.5, wrap_whole_axes=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"applies to StrategyKind\.HALO only"):
        DomainConfig(cutoff=4.5, wrap_whole_axes=True, strategy=StrategyKind.GRAPH_PARTITION)
    # the receptive-field safe path runs a model nvdd does not ship: image rows
    with pytest.raises(ConfigurationError, match="does not apply to the receptive-field"):
        StrategyOptions(receptive_field_layers=2, wraps_periodic_axes=True)
    assert not receptive_field_spec(layers=2).options.wraps_periodic_axes


def test_one_rank_with_every_axis_whole_holds_no_ghost_row() -> None:
    """``halo_on_one_rank`` (the halo-forced benchmark leg) with the option: a
    1x1x1 grid leaves every axis whole, so the halo holds no ghost row and the
    model sees the real periodic cell; the trajectory equals the plain one."""
    from nvdd.core import shutdown_distributed

    dyn = VelocityVerlet(_model("lj"), _batch("triclinic"), dt_fs=2.0)
    config = DomainConfig(cutoff=4.5, skin=SKIN, halo_on_one_rank=True, wrap_whole_axes=True)
    dp = DomainParallel(dyn, config, watchdog_s=0)
    try:
        dp.partition()
        assert isinstance(dp.model, DistributedModel)
        assert dp.model.plan.n_ghost == 0
        dp.run(N_STEPS)
        out = dp.gather(0)
    finally:
        dp.close()
        shutdown_distributed()  # the world of one this process created
    assert out is not None
    ref = VelocityVerlet(_model("lj"), _batch("triclinic"), dt_fs=2.0)
    ref.run(N_STEPS)
    assert_close_by_id(
        out.atom_ids, out.forces, ref.batch.atom_ids, ref.batch.forces, atol=1e-10, what="forces"
    )
