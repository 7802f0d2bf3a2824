"""SpatialPartitioner: grid choice, boxes, ownership, hysteresis, balance, validation."""

from __future__ import annotations

import pickle

import pytest
import torch
from partition_testlib import KINDS, cell_for, make_batch, positions_for

from nvdd.core import ConfigurationError, ValidationError
from nvdd.halo import ParticleHaloConfig
from nvdd.partition import BalanceMode, SpatialPartitioner


def brute_force_owner(
    part: SpatialPartitioner, pos: torch.Tensor, si: torch.Tensor
) -> torch.Tensor:
    """The only box (of the atom's system) that holds its wrapped fractional point."""
    frac = part.fractional(pos, si)
    boxes = part.boxes[si]  # (n, world, 2, 3)
    f = frac.unsqueeze(1)
    inside = ((f >= boxes[:, :, 0]) & (f < boxes[:, :, 1])).all(dim=2)
    assert bool((inside.sum(dim=1) == 1).all()), "boxes must hold every point exactly once"
    return inside.int().argmax(dim=1)


# ---------------------------------------------------------------- grid choice
def test_grid_follows_the_cell_shape() -> None:
    cube = torch.eye(3) * 20
    assert SpatialPartitioner(cube, [True] * 3, 8, 3.0).grid_dims == ((2, 2, 2),)
    long_x = torch.diag(torch.tensor([40.0, 10.0, 10.0]))
    assert SpatialPartitioner(long_x, [True] * 3, 4, 2.0).grid_dims == ((4, 1, 1),)
    flat_z = torch.diag(torch.tensor([30.0, 30.0, 8.0]))
    assert SpatialPartitioner(flat_z, [True] * 3, 4, 2.0).grid_dims == ((2, 2, 1),)


def test_grid_uses_interplanar_spacings_for_triclinic_cells() -> None:
    # |a| = 10 is the longest vector, but a's lattice planes are only 4.06 A apart
    # (b leans on a); c's are 7 A apart: cutting c leaves the thicker boxes.
    sheared = torch.tensor([[10.0, 0.0, 0.0], [9.0, 4.0, 0.0], [0.0, 0.0, 7.0]])
    assert SpatialPartitioner(sheared, [True] * 3, 2, 1.0).grid_dims == ((1, 1, 2),)
    upright = torch.diag(torch.tensor([10.0, 4.0, 7.0]))  # the Cartesian view of it
    assert SpatialPartitioner(upright, [True] * 3, 2, 1.0).grid_dims == ((2, 1, 1),)


def test_thin_boxes_are_avoided_when_possible() -> None:
    # Cutting x 4 ways gives 7.5 A boxes < ghost width 8: a 2 x 2 grid avoids it.
    cell = torch.diag(torch.tensor([30.0, 17.0, 17.0]))
    assert SpatialPartitioner(cell, [True] * 3, 4, 8.0).grid_dims[0] in ((2, 2, 1), (2, 1, 2))


def test_thin_open_slab_is_not_cut_along_its_thin_axis() -> None:
    gen = torch.Generator().manual_seed(0)
    pos = torch.rand(400, 3, generator=gen, dtype=torch.float64) * torch.tensor([30.0, 30.0, 4.0])
    part = SpatialPartitioner(
        torch.diag(torch.tensor([30.0, 30.0, 0.0])), [True, True, False], 4, 3.0, positions=pos
    )
    assert part.grid_dims == ((2, 2, 1),)


def test_grid_dims_are_taken_verbatim_and_checked() -> None:
    cube = torch.eye(3) * 20
    part = SpatialPartitioner(cube, [True] * 3, 6, 2.0, grid_dims=(1, 6, 1))
    assert part.grid_dims == ((1, 6, 1),)
    with pytest.raises(
        ConfigurationError, match=r"grid_dims \(2, 2, 2\).*8 boxes.*world size is 6"
    ):
        SpatialPartitioner(cube, [True] * 3, 6, 2.0, grid_dims=(2, 2, 2))
    with pytest.raises(ConfigurationError, match="three positive ints"):
        SpatialPartitioner(cube, [True] * 3, 2, 2.0, grid_dims=(2, 1))
    two = torch.stack([cube, cube * 2])
    part = SpatialPartitioner(two, [True] * 3, 4, 2.0, grid_dims=[(4, 1, 1), (1, 2, 2)])
    assert part.grid_dims == ((4, 1, 1), (1, 2, 2))
    with pytest.raises(ConfigurationError, match="3 grids for 2 systems"):
        SpatialPartitioner(two, [True] * 3, 4, 2.0, grid_dims=[(4, 1, 1)] * 3)


def test_open_axis_without_vector_or_atoms_cannot_be_cut() -> None:
    with pytest.raises(ConfigurationError, match="pass positions"):
        SpatialPartitioner(torch.zeros(3, 3), [False] * 3, 2, 2.0)
    with pytest.raises(ConfigurationError, match="cuts open axis 2"):
        SpatialPartitioner(
            torch.diag(torch.tensor([10.0, 10, 0])),
            [True, True, False],
            2,
            2.0,
            grid_dims=(1, 1, 2),
        )
    # A periodic axis suffices: the open one is left uncut.
    part = SpatialPartitioner(torch.diag(torch.tensor([10.0, 10, 0])), [True, True, False], 2, 2.0)
    assert part.grid_dims[0][2] == 1


# ------------------------------------------------------------ boxes and owners
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("balance", list(BalanceMode))
def test_boxes_tile_and_owner_of_matches_brute_force(kind: str, balance: BalanceMode) -> None:
    batch = make_batch(120, kind, seed=4, n_systems=2)
    part = SpatialPartitioner.from_batch(batch, 4, 2.5, balance=balance)
    ParticleHaloConfig(part.boxes, part.pbc, 2.5)  # the halo's exact tiling check
    gen = torch.Generator().manual_seed(5)
    # Also points far outside the cell (periodic images) and outside the atoms' extent.
    far = batch.positions + torch.randn(batch.n_atoms, 3, generator=gen, dtype=torch.float64) * 30
    for pos in (batch.positions, far):
        owner = part.owner_of(pos, batch.system_index)
        assert torch.equal(owner, brute_force_owner(part, pos, batch.system_index))
        assert torch.equal(
            part.owned_counts(pos, batch.system_index), torch.bincount(owner, minlength=4)
        )


def test_owner_of_is_dtype_independent_and_a_cut_belongs_to_the_upper_box() -> None:
    cell, pbc = cell_for("periodic")
    part = SpatialPartitioner(cell, pbc, 2, 2.0, grid_dims=(2, 1, 1))
    on_cut = torch.tensor([[7.0, 1.0, 1.0], [0.0, 1.0, 1.0], [14.0, 1.0, 1.0]], dtype=torch.float64)
    assert part.owner_of(on_cut).tolist() == [1, 0, 0]
    pos = positions_for("periodic", 200, torch.Generator().manual_seed(6))
    assert torch.equal(part.owner_of(pos.float()), part.owner_of(pos.float().double()))


def test_two_systems_use_their_own_boxes() -> None:
    batch = make_batch(80, "periodic", seed=7, n_systems=2)  # periodic + open
    part = SpatialPartitioner.from_batch(batch, 2, 2.0)
    si = batch.system_index
    for s in range(2):
        alone = SpatialPartitioner.from_batch(
            batch.select(si == s).replace(
                system_index=torch.zeros(int((si == s).sum()), dtype=torch.int64),
                cell=batch.cell[s : s + 1],
                pbc=batch.pbc[s : s + 1],
                energy=batch.energy[s : s + 1],
                stress=batch.stress[s : s + 1],
                system_extras={"temperature": batch.system_extras["temperature"][s : s + 1]},
            ),
            2,
            2.0,
        )
        assert torch.equal(part.boxes[s], alone.boxes[0])
        assert torch.equal(
            part.owner_of(batch.positions, si)[si == s], alone.owner_of(batch.positions[si == s])
        )
    with pytest.raises(ValidationError, match="system_index is required"):
        part.owner_of(batch.positions)


# -------------------------------------------------------------- hysteresis
def test_keeps_owner_without_hysteresis_is_owner_equality() -> None:
    batch = make_batch(150, "triclinic", seed=8)
    part = SpatialPartitioner.from_batch(batch, 4, 2.0, balance=BalanceMode.QUANTILE)
    owner = part.owner_of(batch.positions)
    for r in range(4):
        current = torch.full_like(owner, r)
        keep = part.keeps_owner(batch.positions, None, current, 0.0)
        assert torch.equal(keep, owner == r)


@pytest.mark.parametrize("kind", ["periodic", "triclinic"])
def test_hysteresis_is_a_distance_along_the_face_normal(kind: str) -> None:
    cell, pbc = cell_for(kind)
    part = SpatialPartitioner(cell, pbc, 2, 3.0, grid_dims=(2, 1, 1), skin=1.0)
    inv = torch.linalg.inv(cell)
    normal = inv[:, 0] / torch.linalg.vector_norm(inv[:, 0])  # normal of the x = 0.5 face
    on_face = torch.tensor([[0.5, 0.3, 0.6]], dtype=torch.float64) @ cell
    h = 0.4
    for dist, stays in ((0.39, True), (0.41, False)):
        outside = on_face - dist * normal  # into box 0, away from box 1
        assert part.owner_of(outside).tolist() == [0]
        assert part.keeps_owner(outside, None, torch.tensor([1]), h).tolist() == [stays]
    # Across the periodic face at 0 == 1: box 0 grown by h reaches 1 - h.
    near_wrap = torch.tensor([[0.999, 0.3, 0.6]], dtype=torch.float64) @ cell
    assert part.owner_of(near_wrap).tolist() == [1]
    assert part.keeps_owner(near_wrap, None, torch.tensor([0]), h).tolist() == [True]


def test_hysteresis_validation_names_both_values() -> None:
    cell, pbc = cell_for("periodic")
    part = SpatialPartitioner(cell, pbc, 2, 3.0, skin=0.5)
    pos = torch.zeros(1, 3, dtype=torch.float64)
    with pytest.raises(ConfigurationError, match=r"hysteresis 0.5 must be below the skin 0.5"):
        part.keeps_owner(pos, None, torch.tensor([0]), 0.5)
    with pytest.raises(ConfigurationError, match="hysteresis must be finite and >= 0"):
        part.check_hysteresis(-0.1)
    assert part.check_hysteresis(0.49) == 0.49
    free = SpatialPartitioner(cell, pbc, 2, 3.0)  # no skin: any h >= 0
    assert free.check_hysteresis(5.0) == 5.0


# ------------------------------------------------------------------ balance
def _slab() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    cell = torch.diag(torch.tensor([20.0, 20.0, 60.0], dtype=torch.float64))
    pos = torch.rand(480, 3, generator=gen, dtype=torch.float64) * torch.tensor([20.0, 20.0, 12.0])
    pos[:, 2] += 4.0  # a 12 A slab in a 60 A periodic cell: mostly vacuum along z
    return cell, pos


def _cluster() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10)
    cell = torch.eye(3, dtype=torch.float64) * 60.0
    pos = torch.randn(480, 3, generator=gen, dtype=torch.float64) * 3.5 + torch.tensor(
        [18.0, 24.0, 40.0]
    )  # off-centre droplet in a large periodic box
    return cell, pos


@pytest.mark.parametrize("system", ["slab", "cluster"])
@pytest.mark.parametrize(
    ("world", "grid"), [(4, None), (8, None), (4, (1, 1, 4)), (6, (2, 3, 1)), (8, (2, 2, 2))]
)
def test_quantile_cuts_balance_within_ten_percent(
    system: str, world: int, grid: tuple[int, int, int] | None
) -> None:
    cell, pos = _slab() if system == "slab" else _cluster()
    kw = {"grid_dims": grid} if grid else {}
    balanced = SpatialPartitioner(
        cell, [True] * 3, world, 3.0, positions=pos, balance=BalanceMode.QUANTILE, **kw
    )
    uniform = SpatialPartitioner(
        cell, [True] * 3, world, 3.0, positions=pos, grid_dims=balanced.grid_dims[0]
    )
    assert balanced.imbalance() <= 1.1
    assert uniform.imbalance() > balanced.imbalance()
    assert balanced.imbalance() == balanced.imbalance(pos)  # build counts are these atoms'
    counts = balanced.owned_counts(pos)
    assert int(counts.sum()) == 480 and int(counts.min()) > 0


def test_quantile_cuts_on_an_open_cluster() -> None:
    _, pos = _cluster()
    part = SpatialPartitioner(
        torch.zeros(3, 3), [False] * 3, 8, 3.0, positions=pos, balance=BalanceMode.QUANTILE
    )
    assert part.imbalance() <= 1.1
    boxes = part.boxes[0]
    assert bool(torch.isneginf(boxes[:, 0]).any()) and bool(torch.isposinf(boxes[:, 1]).any())


def test_quantile_cuts_survive_tied_coordinates() -> None:
    # A simple-cubic crystal: many atoms share each coordinate; cuts fall between planes.
    g = torch.arange(6, dtype=torch.float64) * 2.0 + 1.0
    pos = torch.cartesian_prod(g, g, g)
    part = SpatialPartitioner(
        torch.eye(3) * 12.0, [True] * 3, 4, 2.0, positions=pos, balance=BalanceMode.QUANTILE
    )
    assert part.imbalance() == 1.0  # 6 planes per axis split 3 + 3
    ParticleHaloConfig(part.boxes, part.pbc, 2.0)


def test_quantile_cuts_treat_coordinates_ulps_apart_as_one_plane() -> None:
    """Values that differ in the last bits (wrapped fractions of a triclinic
    lattice) are one plane: the midpoint of two values an ulp apart rounds onto
    one of them, and two such gaps gave two equal cuts, an empty box that the
    cut table refused (ConfigurationError on a valid 4-rank run, found by the
    randomized search, seed 3241 of ``it_fuzz``)."""
    from nvdd.partition._cuts import _quantile_cuts

    one = torch.tensor(1.0, dtype=torch.float64)
    plane = [torch.tensor(1.0 / 6.0, dtype=torch.float64)]
    for _ in range(4):
        plane.append(torch.nextafter(plane[-1], one))
    for parts in (2, 3, 4, 5):
        cuts = _quantile_cuts(torch.stack(plane), parts, 0.0, 1.0)
        assert cuts.numel() == parts - 1 and bool((cuts[1:] > cuts[:-1]).all()), (parts, cuts)
    with_planes = torch.cat([torch.stack(plane), torch.tensor([0.4, 0.4, 0.65, 0.9])])
    cuts = _quantile_cuts(with_planes, 4, 0.0, 1.0)
    assert bool((cuts[1:] > cuts[:-1]).all()), cuts
    assert not bool(((cuts > plane[0]) & (cuts < plane[-1])).any()), cuts  # never inside a plane


def test_imbalance_needs_atoms() -> None:
    part = SpatialPartitioner(torch.eye(3) * 10, [True] * 3, 2, 2.0)
    with pytest.raises(ConfigurationError, match="needs positions"):
        part.imbalance()
    pos = torch.tensor([[1.0, 1, 1], [2, 2, 2], [3, 3, 3]], dtype=torch.float64)
    assert part.imbalance(pos) == pytest.approx(3 / 1.5)


# --------------------------------------------------------------- validation
def test_constructor_validation() -> None:
    cube = torch.eye(3) * 10
    with pytest.raises(ConfigurationError, match="ghost_width must be finite and > 0"):
        SpatialPartitioner(cube, [True] * 3, 2, 0.0)
    with pytest.raises(ConfigurationError, match="world_size must be a positive int"):
        SpatialPartitioner(cube, [True] * 3, 0, 1.0)
    with pytest.raises(ConfigurationError, match="needs positions"):
        SpatialPartitioner(cube, [True] * 3, 2, 1.0, balance=BalanceMode.QUANTILE)
    with pytest.raises(ConfigurationError, match="either cuts or grid_dims"):
        SpatialPartitioner(cube, [True] * 3, 2, 1.0, cuts=((0.5,), (), ()), grid_dims=(2, 1, 1))
    with pytest.raises(ValidationError, match="cell has shape"):
        SpatialPartitioner(torch.zeros(3, 2), [True] * 3, 2, 1.0)
    with pytest.raises(ValidationError, match="pbc has shape"):
        SpatialPartitioner(cube, torch.ones(2, 3, dtype=torch.bool), 2, 1.0)
    with pytest.raises(ValidationError, match="non-finite"):
        SpatialPartitioner(cube, [True] * 3, 2, 1.0, positions=torch.full((2, 3), float("nan")))


def test_empty_system_is_rejected() -> None:
    two = torch.stack([torch.eye(3) * 10, torch.eye(3) * 12])
    pos = torch.rand(5, 3, dtype=torch.float64)
    with pytest.raises(ValidationError, match=r"system\(s\) \[1\] have no atoms"):
        SpatialPartitioner(
            two, [True] * 3, 2, 1.0, positions=pos, system_index=torch.zeros(5, dtype=torch.int64)
        )


def test_explicit_cuts_must_tile() -> None:
    cube = torch.eye(3) * 10
    part = SpatialPartitioner(cube, [True] * 3, 4, 1.0, cuts=((0.25, 0.5, 0.8), (), ()))
    assert part.grid_dims == ((4, 1, 1),)
    assert part.boxes[0, :, 1, 0].tolist() == [0.25, 0.5, 0.8, 1.0]
    with pytest.raises(ConfigurationError, match="do not tile"):  # overlap
        SpatialPartitioner(cube, [True] * 3, 3, 1.0, cuts=((0.6, 0.4), (), ()))
    with pytest.raises(
        ConfigurationError, match="do not tile"
    ):  # outside [0, 1] of a periodic axis
        SpatialPartitioner(cube, [True] * 3, 2, 1.0, cuts=((1.2,), (), ()))
    with pytest.raises(ConfigurationError, match="do not tile"):  # empty box
        SpatialPartitioner(cube, [True] * 3, 3, 1.0, cuts=((0.5, 0.5), (), ()))
    with pytest.raises(ConfigurationError, match="2 boxes but the world size is 4"):
        SpatialPartitioner(cube, [True] * 3, 4, 1.0, cuts=((0.5,), (), ()))
    # Open axes accept cuts anywhere on the real line.
    part = SpatialPartitioner(torch.zeros(3, 3), [False] * 3, 2, 1.0, cuts=((-7.5,), (), ()))
    assert part.boxes[0, 0, 1, 0] == -7.5


# --------------------------------------------------------------- halo config
def test_halo_config_carries_the_boxes() -> None:
    batch = make_batch(60, "mixed", seed=11)
    part = SpatialPartitioner.from_batch(batch, 1, 2.5)
    cfg = part.halo_config()
    assert isinstance(cfg, ParticleHaloConfig)
    assert torch.equal(cfg.boxes, part.boxes) and torch.equal(cfg.pbc, part.pbc)
    assert cfg.ghost_width == 2.5
    four = SpatialPartitioner.from_batch(batch, 4, 2.5)
    with pytest.raises(ConfigurationError, match="4 boxes per system but the group has 1"):
        four.halo_config()
    # made and checked once (every halo rebuild asks), still right after a pickle
    assert part.halo_config() is cfg
    again = pickle.loads(pickle.dumps(part)).halo_config()
    assert again is not cfg and torch.equal(again.boxes, cfg.boxes)
    with pytest.raises(ConfigurationError, match="4 boxes per system"):
        four.halo_config()  # (a failed check is not cached)


def test_whole_axes_and_a_halo_config_that_leaves_them_to_the_model() -> None:
    part = SpatialPartitioner(torch.eye(3) * 20, [True, False, True], 2, 2.0)
    assert part.grid_dims == ((2, 1, 1),)
    # y is whole but open (nothing periodic to leave), z whole and periodic
    assert part.whole_axes.tolist() == [[False, False, True]]
    one = SpatialPartitioner(torch.eye(3) * 20, [True, False, True], 1, 2.0)
    wrapped = one.halo_config(wrap_whole_axes=True)  # (a group of one rank here)
    assert wrapped.wrapped is not None and wrapped.wrapped.tolist() == [[True, False, True]]
    assert wrapped.image_pbc.tolist() == [[False, False, False]]
    assert one.halo_config().wrapped is None  # the default: explicit images everywhere
    assert one.halo_config(wrap_whole_axes=True) is wrapped  # cached per (group, flag)
    cube = SpatialPartitioner(torch.eye(3) * 20, [True] * 3, 4, 2.0, grid_dims=(2, 2, 1))
    assert cube.whole_axes.tolist() == [[False, False, True]]
    with pytest.raises(ConfigurationError, match="wrapped axis 0 of system 0 is cut"):
        ParticleHaloConfig(
            boxes=cube.boxes, pbc=cube.pbc, ghost_width=2.0, wrapped=torch.tensor([[True] * 3])
        )
    with pytest.raises(ConfigurationError, match="wrapped axis 1 of system 0 is open"):
        ParticleHaloConfig(
            boxes=part.boxes,
            pbc=part.pbc,
            ghost_width=2.0,
            wrapped=torch.tensor([[False, True, False]]),
        )


def test_repr_names_grid_and_balance() -> None:
    part = SpatialPartitioner(torch.eye(3) * 20, [True] * 3, 2, 2.0)
    assert "grid_dims=[(2, 1, 1)]" in repr(part) and "UNIFORM" in repr(part)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ownership_on_a_device_matches_the_cpu(device: str, dtype: torch.dtype) -> None:
    batch = make_batch(150, "triclinic", seed=12, n_systems=2, dtype=dtype)
    part = SpatialPartitioner.from_batch(batch, 4, 2.0, balance=BalanceMode.QUANTILE, skin=1.0)
    pos, si = batch.positions, batch.system_index
    moved = pos + 0.7 * torch.randn(pos.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    here = part.owner_of(pos, si)
    on_dev = part.owner_of(moved.to(device), si.to(device), cell=batch.cell.to(device))
    assert on_dev.device.type == device
    assert torch.equal(on_dev.cpu(), part.owner_of(moved, si, cell=batch.cell))
    keep = part.keeps_owner(moved.to(device), si.to(device), here.to(device), 0.5)
    assert torch.equal(keep.cpu(), part.keeps_owner(moved, si, here, 0.5))
    wrapped = part.wrap_positions(moved.to(device), si.to(device))
    assert wrapped.dtype == dtype and wrapped.device.type == device
    assert torch.allclose(wrapped.cpu(), part.wrap_positions(moved, si), atol=1e-5)
