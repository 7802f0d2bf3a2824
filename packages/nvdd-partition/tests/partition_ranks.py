"""Bodies run on every rank by the gloo tests of nvdd-partition.

Kept apart from the test modules so a rank imports neither pytest nor the tests
(rank start-up is most of a small test's time on two cores). Each body checks
what only a rank can see (its own rows) and returns small summaries.
"""

from __future__ import annotations

import resource
import warnings

import torch
import torch.distributed as dist
from partition_testlib import assert_batches_equal, make_batch

from nvdd.core import Batch, ConfigurationError, ValidationError, make_mesh
from nvdd.partition import (
    BalanceMode,
    DegeneratePartitionWarning,
    ShardedBatch,
    SpatialPartitioner,
)
from nvdd.testing import assert_same_ids


def expected(batch: Batch, part: SpatialPartitioner) -> Batch:
    """The unsharded oracle: the batch with wrapped positions, in id order."""
    wrapped = part.wrap_positions(batch.positions, batch.system_index, cell=batch.cell)
    return batch.replace(positions=wrapped).sort_by_id()


# ------------------------------------------------------------ scatter/gather
def scatter_gather(
    n: int, kind: str, n_systems: int, balance: str, src: int, dst: int, dtype: str
) -> tuple[int, list[float], float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(n, kind, seed=21, n_systems=n_systems, dtype=getattr(torch, dtype))

    def factory(b: Batch) -> SpatialPartitioner:
        return SpatialPartitioner.from_batch(b, world, 2.5, balance=BalanceMode[balance])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegeneratePartitionWarning)  # tested elsewhere
        sb = ShardedBatch.from_batch(batch if rank == src else None, None, factory, src=src)
    part = sb.partitioner
    oracle = expected(batch, part)
    # Only this rank's rows arrived, and they are exactly the rows its box owns.
    owner = part.owner_of(batch.positions, batch.system_index, cell=batch.cell)
    assert_same_ids(sb.local_batch.atom_ids, batch.atom_ids[owner == rank], "owned ids")
    assert sb.n_owned == sb.owned_counts[rank] and sb.n_atoms == batch.n_atoms
    mine = sb.local_batch
    assert bool((part.owner_of(mine.positions, mine.system_index) == rank).all())
    assert_batches_equal(
        mine.sort_by_id(), oracle.select(torch.isin(oracle.atom_ids, mine.atom_ids))
    )
    gathered = sb.gather(dst)
    if rank == dst:
        assert gathered is not None
        assert_batches_equal(gathered, oracle)
    else:
        assert gathered is None
    assert_batches_equal(sb.to_global(), oracle)
    return sb.n_owned, part.boxes.flatten().tolist(), sb.imbalance


def scatter_gather_cases(cases: list[tuple[object, ...]]) -> list[tuple[int, list[float], float]]:
    """Several :func:`scatter_gather` cases in the same ranks."""
    return [scatter_gather(*case) for case in cases]  # type: ignore[arg-type]


# ------------------------------------------------------- meshes, broadcast
def meshes_and_broadcast() -> tuple[list[list[int]], list[float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(50, "periodic", seed=4)
    owned = []
    for kind in ("devicemesh", "group", "default"):
        mesh: object = None
        if kind == "devicemesh":
            mesh = make_mesh("cpu")
        elif kind == "group":
            mesh = dist.new_group(list(range(world)))
        part = SpatialPartitioner.from_batch(batch, world, 2.0) if rank == 0 else None
        sb = ShardedBatch.from_batch(batch if rank == 0 else None, mesh, part)  # type: ignore[arg-type]
        if kind == "devicemesh":
            assert sb.mesh is mesh and sb.group is not None
        gathered = sb.gather(0)
        if rank == 0:
            assert gathered is not None
            assert_batches_equal(gathered, expected(batch, sb.partitioner))
        owned.append(sb.local_batch.atom_ids.tolist())
    # A balanced partitioner built on rank 1 only, broadcast to all.
    src_part = None
    if rank == 1:
        blob = make_batch(80, "open", seed=5)
        src_part = SpatialPartitioner.from_batch(blob, world, 2.0, balance=BalanceMode.QUANTILE)
    got = SpatialPartitioner.broadcast(src_part, src=1)
    assert got.balance is BalanceMode.QUANTILE and got.world_size == world
    return owned, [*got.boxes.flatten().tolist(), got.imbalance()]


# ------------------------------------------------------------------ migrate
def displace(batch: Batch, seed: int, scale: float) -> torch.Tensor:
    """The same random displacement for each atom id on every rank."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(400_000, 3, generator=gen, dtype=torch.float64) * scale
    return batch.positions + table[batch.atom_ids % 400_000].to(batch.dtype)


def migrate_rounds(kind: str, n_systems: int, hysteresis: float) -> list[int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(80, kind, seed=6, n_systems=n_systems)
    part = SpatialPartitioner.from_batch(batch, world, 2.0, balance=BalanceMode.QUANTILE, skin=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegeneratePartitionWarning)
        sb = ShardedBatch.from_batch(batch if rank == 0 else None, None, part)
    reference = expected(batch, part)  # the unsharded run, moved the same way
    moved = []
    for step in range(3):
        local = sb.local_batch
        sb.update_from_batch(local.replace(positions=displace(local, 100 + step, 1.5)))
        reference = reference.replace(positions=displace(reference, 100 + step, 1.5))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DegeneratePartitionWarning)
            stats = sb.migrate(hysteresis)
        moved.append(stats.n_moved)
        assert stats.owned_counts == sb.owned_counts and sum(stats.owned_counts) == batch.n_atoms
        assert stats.n_received == sb.n_owned - (local.n_atoms - stats.n_sent)
        assert sb.last_migration == stats
        mine = sb.local_batch
        if hysteresis == 0.0:  # every atom sits on the rank owning its position
            assert bool((part.owner_of(mine.positions, mine.system_index) == rank).all())
        else:  # ... or within the hysteresis of its box
            current = torch.full_like(mine.atom_ids, rank)
            keep = part.keeps_owner(mine.positions, mine.system_index, current, hysteresis)
            assert bool(keep.all())
        reference = reference.replace(
            positions=part.wrap_positions(reference.positions, reference.system_index)
        )
        # Atoms kept by hysteresis across a periodic face sit at the image next to
        # their owner's box: compare positions modulo the lattice (to rounding),
        # every other field bit for bit.
        got = sb.to_global()
        wrapped = part.wrap_positions(got.positions, got.system_index)
        torch.testing.assert_close(wrapped, reference.positions, rtol=0, atol=1e-12)
        assert_batches_equal(got.replace(positions=reference.positions), reference)
    return moved


def migrate_cases(cases: list[tuple[str, int, float]]) -> list[list[int]]:
    return [migrate_rounds(*case) for case in cases]


def ping_pong(hysteresis: float, amplitude: float) -> list[tuple[int, int]]:
    """Atom 0 crosses the x = 10 face and comes back, six times: (n_moved, held here)."""
    rank = dist.get_rank()
    cell = torch.eye(3, dtype=torch.float64) * 20.0
    gen = torch.Generator().manual_seed(7)
    pos = torch.rand(40, 3, generator=gen, dtype=torch.float64) * 20.0
    pos[0] = torch.tensor([10.05, 3.0, 3.0], dtype=torch.float64)  # just right of the face
    batch = Batch(pos, torch.ones(40, dtype=torch.int64), cell=cell, pbc=[True] * 3)
    part = SpatialPartitioner(cell, [True] * 3, 2, 3.0, grid_dims=(2, 1, 1), skin=1.0)
    sb = ShardedBatch.from_batch(batch if rank == 0 else None, None, part)
    history = []
    for step in range(6):
        local = sb.local_batch
        p = local.positions.clone()
        p[local.atom_ids == 0, 0] += (-1.0 if step % 2 == 0 else 1.0) * amplitude
        sb.update_from_batch(local.replace(positions=p))
        stats = sb.migrate(hysteresis)
        history.append((stats.n_moved, int((sb.local_batch.atom_ids == 0).sum())))
    return history


def ping_pong_cases(cases: list[tuple[float, float]]) -> list[list[tuple[int, int]]]:
    return [ping_pong(*case) for case in cases]


def migrate_with_a_new_cell() -> dict[str, int]:
    """Migration after the cell changed (NPT): owners and wrapping follow the
    *current* cell. The atoms stay put while the cell is sheared and compressed,
    so their fractional coordinates (and owners) change."""
    rank = dist.get_rank()
    cell = torch.tensor([[9.0, 0.0, 0.0], [2.0, 8.0, 0.0], [-1.0, 1.5, 8.5]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(17)
    pos = torch.rand(60, 3, generator=gen, dtype=torch.float64) @ cell
    batch = Batch(pos, torch.ones(60, dtype=torch.int64), cell=cell, pbc=[True] * 3)
    part = SpatialPartitioner(cell, [True] * 3, 2, 2.0, grid_dims=(2, 1, 1), skin=1.0)
    sb = ShardedBatch.from_batch(batch if rank == 0 else None, None, part)
    new_cell = cell @ torch.tensor(
        [[0.85, 0.0, 0.0], [0.35, 1.0, 0.0], [0.0, 0.0, 0.95]], dtype=torch.float64
    )
    sb.update_from_batch(sb.local_batch.replace(cell=new_cell.unsqueeze(0)))
    sb.migrate(0.0)
    mine = sb.local_batch
    owner = part.owner_of(mine.positions, mine.system_index, cell=mine.cell)
    assert bool((owner == rank).all()), "an atom sits on the wrong rank for the current cell"
    frac = part.fractional(mine.positions, mine.system_index, cell=mine.cell, wrap=False)
    assert bool(((frac >= 0) & (frac < 1)).all()), "not wrapped into the current cell"
    whole = sb.gather(0)
    if whole is None:
        return {"moved": sb.last_migration.n_moved if sb.last_migration else -1}
    assert_same_ids(whole.atom_ids, batch.atom_ids, "ids after migration")
    old = part.owner_of(whole.positions, whole.system_index, cell=cell)
    new = part.owner_of(whole.positions, whole.system_index, cell=new_cell)
    moved = sb.last_migration.n_moved if sb.last_migration else -1
    return {"moved": moved, "owner_changed_by_the_cell": int((old != new).sum())}


# ------------------------------------------------------------------- errors
def _error_case(case: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(30, "periodic", seed=8)
    part = SpatialPartitioner.from_batch(batch, world, 2.0)
    if case == "empty_system":
        two = make_batch(30, "periodic", seed=8, n_systems=2)
        empty = two.select(two.system_index == 0)  # system 1 has no atom left
        ShardedBatch.from_batch(empty if rank == 0 else None, None, part)
    elif case == "world":
        wrong = SpatialPartitioner.from_batch(batch, world + 1, 2.0)
        ShardedBatch.from_batch(batch if rank == 0 else None, None, wrong)
    elif case == "no_batch":
        ShardedBatch.from_batch(None, None, part)
    elif case == "factory":
        ShardedBatch.from_batch(batch if rank == 0 else None, None, lambda b: "oops")  # type: ignore[arg-type,return-value]
    else:
        sb = ShardedBatch.from_batch(batch if rank == 0 else None, None, part)
        local = sb.local_batch
        if case == "update" and rank == 1:
            local = local.replace(atom_ids=local.atom_ids + 1000)
        if case == "nan" and rank == 1:
            p = local.positions.clone()
            p[0, 0] = float("nan")
            local = local.replace(positions=p)
        sb.update_from_batch(local, check=case == "update")
        if case == "nan":
            sb.migrate()


def errors(cases: list[str]) -> list[tuple[str, str]]:
    """Each case's (error type, message) on this rank; a barrier after each proves
    that no rank is left hanging in a collective."""
    out = []
    for case in cases:
        try:
            _error_case(case)
            result = ("none", "")
        except (ValidationError, ConfigurationError) as exc:
            result = (type(exc).__name__, str(exc))
        dist.barrier()
        out.append(result)
    return out


# --------------------------------------------------------------- degenerate
def degenerate(case: str, require: bool) -> tuple[str, str]:
    """(outcome, message) of a degenerate scatter or migration on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if case == "empty_rank":  # an off-centre droplet, even cuts: some boxes stay empty
        gen = torch.Generator().manual_seed(31)
        pos = torch.randn(60, 3, generator=gen, dtype=torch.float64) + 8.0
        cell = torch.eye(3, dtype=torch.float64) * 40.0
        batch = Batch(pos, torch.ones(60, dtype=torch.int64), cell=cell, pbc=[True] * 3)
        part = SpatialPartitioner(batch.cell, batch.pbc, world, 2.0, require_nondegenerate=require)
    elif case == "covered":  # 10 A cell, 2 boxes, 3 A halo: every rank holds every atom
        batch = make_batch(30, "periodic", seed=32)
        batch = batch.replace(
            cell=torch.diag(torch.tensor([10.0, 10.0, 10.0], dtype=torch.float64)).unsqueeze(0)
        )
        part = SpatialPartitioner(batch.cell, batch.pbc, world, 3.0, require_nondegenerate=require)
    else:  # "migrate_empties": fine at scatter, then every atom moves into box 0
        batch = make_batch(40, "periodic", seed=33)
        part = SpatialPartitioner(batch.cell, batch.pbc, world, 2.0, require_nondegenerate=require)
    outcome, message = "ok", ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            sb = ShardedBatch.from_batch(batch if rank == 0 else None, None, part)
            if case == "migrate_empties":
                local = sb.local_batch
                p = local.positions * 0.01  # everything collapses next to the origin
                sb.update_from_batch(local.replace(positions=p))
                sb.migrate()
        except ValidationError as exc:
            outcome, message = "raised", str(exc)
    dist.barrier()
    degenerate_warnings = [w for w in caught if issubclass(w.category, DegeneratePartitionWarning)]
    if outcome == "ok" and degenerate_warnings:
        outcome, message = "warned", str(degenerate_warnings[0].message)
    return outcome, message


# ------------------------------------------------------------------- memory
def _peak_rss_reset() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _rss() -> tuple[int, int]:
    """(current RSS, peak RSS) in bytes."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                fields[line.split(":")[0]] = int(line.split()[1]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _memory_batch(n: int) -> Batch:
    gen = torch.Generator().manual_seed(41)
    return Batch(
        torch.rand(n, 3, generator=gen, dtype=torch.float64) * 60.0,
        torch.ones(n, dtype=torch.int64),
        cell=torch.eye(3, dtype=torch.float64) * 60.0,
        pbc=[True] * 3,
        atom_extras={"charge": torch.zeros(n, dtype=torch.float64)},
    )


def scatter_memory(n: int, src: int) -> tuple[int, int, int, int]:
    """(peak RSS growth in bytes during the scatter, bytes of the owned rows, rows
    owned, bytes of one row) on this rank.

    A small scatter first pays the one-off costs (gloo buffers, lazy imports and
    allocator arenas, about 20 MB per rank); then the peak RSS is reset and the
    large scatter measured from the current RSS.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    part = SpatialPartitioner(torch.eye(3) * 60.0, [True] * 3, world, 3.0) if rank == src else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegeneratePartitionWarning)
        small = _memory_batch(16 * world) if rank == src else None
        ShardedBatch.from_batch(small, None, part, src=src).to_global()
    batch = _memory_batch(n) if rank == src else None
    dist.barrier()
    if _peak_rss_reset():
        before, _ = _rss()
        sb = ShardedBatch.from_batch(batch, None, part, src=src)
        _, peak = _rss()
    else:  # no clear_refs: the high-water mark since start (an upper bound)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        sb = ShardedBatch.from_batch(batch, None, part, src=src)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = sum(t.numel() * t.element_size() for t in sb.local_batch.atom_fields().values())
    return peak - before, held, sb.n_owned, held // max(sb.n_owned, 1)


# --------------------------------------------------------------- with the halo
def halo_contract(n: int, kind: str, n_systems: int, ghost_width: float) -> tuple[int, int, int]:
    """Build nvdd.halo's plan from this partitioner's boxes and domain cell and check
    that every ghost lies in this rank's box grown by the ghost width; returns
    (owned, ghosts, distinct ids held)."""
    from nvdd.halo import SelectBackend, build_halo_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(n, kind, seed=51, n_systems=n_systems)
    part = SpatialPartitioner.from_batch(batch, world, ghost_width, balance=BalanceMode.QUANTILE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegeneratePartitionWarning)
        sb = ShardedBatch.from_batch(batch if rank == 0 else None, None, part)
    local = sb.local_batch
    cell = part.domain_cell(local.cell)
    plan = build_halo_plan(
        part.halo_config(),
        local.positions,
        local.atom_ids,
        local.system_index,
        cell,
        backend=SelectBackend.TORCH,
    )
    ghosts = plan.ghost_positions(local.positions, cell)
    frac = part.fractional(ghosts, plan.ghost_system_index, cell=local.cell, wrap=False)
    box = part.boxes[plan.ghost_system_index, rank]
    grow = part.ghost_frac(local.cell)[plan.ghost_system_index]
    slack = 1e-9
    inside = (frac >= box[:, 0] - grow - slack) & (frac <= box[:, 1] + grow + slack)
    assert bool(inside.all()), "a ghost lies outside this rank's grown box"
    held = torch.unique(torch.cat([local.atom_ids, plan.ghost_atom_ids]))
    return sb.n_owned, plan.n_ghost, int(held.numel())


# ------------------------------------------------------- already distributed
def wrap_distributed(mismatch: bool) -> tuple[str, list[int]]:
    """Each rank starts from a contiguous block of rows (as after reading a
    checkpoint), wraps them in a ShardedBatch and migrates them to their owners."""
    from nvdd.partition import IndexPartitioner

    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(60, "triclinic", seed=61)
    width = 2.0 + (0.5 * rank if mismatch else 0.0)
    part = SpatialPartitioner.from_batch(batch, world, width)
    block = batch.select(torch.arange(60)[IndexPartitioner(60, world).local_slice(rank)])
    try:
        sb = ShardedBatch(block, part)
    except ConfigurationError as exc:
        dist.barrier()
        return str(exc), []
    assert sb.owned_counts == IndexPartitioner(60, world).counts()
    sb.migrate()
    mine = sb.local_batch
    assert bool((part.owner_of(mine.positions) == rank).all())
    assert_batches_equal(sb.to_global(), expected(batch, part))
    return "", mine.atom_ids.tolist()


# ---------------------------------------------------------------- rebalance
def drift_and_rebalance() -> tuple[float, float, float, int, int]:
    """A balanced droplet drifts and spreads; migrate() keeps ownership right but
    not balance; rebalance() restores it. Returns (imbalance after scatter, after
    the drift, after rebalance, new partitioner fingerprint, atoms owned)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(71)
    n = 240
    pos = torch.randn(n, 3, generator=gen, dtype=torch.float64) * 3.0 + 15.0
    cell = torch.eye(3, dtype=torch.float64) * 50.0
    batch = Batch(pos, torch.ones(n, dtype=torch.int64), cell=cell, pbc=[True] * 3)
    part = SpatialPartitioner.from_batch(batch, world, 2.0, balance=BalanceMode.QUANTILE, skin=1.0)
    sb = ShardedBatch.from_batch(batch if rank == 0 else None, None, part)
    before = sb.imbalance
    local = sb.local_batch
    drifted = (local.positions - 15.0) * torch.tensor([2.5, 1.0, 0.5], dtype=torch.float64) + 27.0
    sb.update_from_batch(local.replace(positions=drifted))
    reference = expected(
        batch.replace(positions=(pos - 15.0) * torch.tensor([2.5, 1.0, 0.5]) + 27.0), part
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegeneratePartitionWarning)
        sb.migrate()
    drifted_imbalance = sb.imbalance
    stats = sb.rebalance(src=world - 1)
    new = sb.partitioner
    assert new is not part and new.balance is BalanceMode.QUANTILE and new.skin == 1.0
    mine = sb.local_batch
    assert bool((new.owner_of(mine.positions) == rank).all())
    assert_batches_equal(
        sb.to_global(), reference.replace(positions=new.wrap_positions(reference.positions))
    )
    assert stats.owned_counts == sb.owned_counts
    return before, drifted_imbalance, sb.imbalance, new.fingerprint(), sb.n_owned


# ------------------------------------------------- hysteresis across a face
def kept_across_periodic_face() -> list[float]:
    """An atom of rank 0 (box x in [0, 0.5)) drifts 0.1 A across the periodic face
    at x = 0. With hysteresis 0.3 A it stays on rank 0, and its position must be the
    image next to rank 0's box (x = -0.1), not the wrapped one (x = L - 0.1), or
    the halo (built around the owner's box) would miss its neighbours."""
    rank = dist.get_rank()
    cell = torch.diag(torch.tensor([10.0, 10.0, 10.0], dtype=torch.float64))
    pos = torch.tensor([[0.2, 5.0, 5.0], [7.0, 5.0, 5.0]], dtype=torch.float64)
    batch = Batch(pos, torch.tensor([18, 18]), cell=cell, pbc=[True, True, True])
    part = SpatialPartitioner(cell, [True, True, True], 2, 2.0, grid_dims=(2, 1, 1), skin=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegeneratePartitionWarning)
        sb = ShardedBatch.from_batch(batch if rank == 0 else None, None, part)
    local = sb.local_batch
    moved = local.positions.clone()
    moved[local.atom_ids == 0, 0] -= 0.3  # 0.2 -> -0.1: 0.1 A outside box 0, across x = 0
    sb.update_from_batch(local.replace(positions=moved))
    sb.migrate(hysteresis=0.3)
    mine = sb.local_batch
    return mine.positions[mine.atom_ids == 0, 0].tolist()
