"""Device placement: partition metadata lives on the CPU, atoms on their device.

Every crossing between the two is explicit. The fake accelerator of
``nvdd.testing`` runs the same code with CUDA-like device checks on the CPU, so a
mix (a CUDA cell next to CPU boxes, a CPU flag in an NCCL collective) fails here,
in CI, instead of on the first multi-GPU run.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from partition_device_ranks import cpu_and_fake
from partition_testlib import KINDS, make_batch

from nvdd.partition import DegeneratePartitionWarning, SpatialPartitioner
from nvdd.testing import fake_accelerator, run_ranks


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_functions_take_a_cell_on_the_atoms_device(kind: str) -> None:
    batch = make_batch(40, kind, seed=1, n_systems=2)
    part = SpatialPartitioner.from_batch(batch, 2, 6.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegeneratePartitionWarning)
        want = part.degeneracies(cell=batch.cell)
        frac = part.ghost_frac(batch.cell)
        with fake_accelerator() as dev:
            fake = batch.to(dev)
            # The multi-GPU crash of issue 12: a device cell next to CPU boxes.
            assert part.degeneracies(cell=fake.cell) == want
            got = part.ghost_frac(fake.cell)
            assert got.device.type == "cpu"  # metadata stays on the CPU
            assert torch.equal(got, frac)
            owner = part.owner_of(fake.positions, fake.system_index, cell=fake.cell)
            assert owner.device == dev  # per-atom results stay with the atoms
            wrapped = part.wrap_positions(fake.positions, fake.system_index, cell=fake.cell)
            assert wrapped.device == dev
    assert torch.equal(owner.cpu(), part.owner_of(batch.positions, batch.system_index))
    assert torch.equal(wrapped.cpu(), part.wrap_positions(batch.positions, batch.system_index))


def test_scattered_rows_land_on_each_ranks_current_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``from_batch`` puts a rank's rows (``landing_device``): the device
    asked for; on ``src`` the device of the batch it sent; elsewhere ``src``'s
    device type, and for CUDA this rank's current GPU (not GPU 0: each rank of a
    node has its own), the branch a CPU scatter never takes."""
    from nvdd.partition._scatter import landing_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert landing_device(None, None, "cuda") == torch.device("cuda", 3)
    assert landing_device("cpu", None, "cuda") == torch.device("cpu")
    assert landing_device(torch.device("cuda", 1), None, "cuda") == torch.device("cuda", 1)
    batch = make_batch(8)
    assert landing_device(None, batch, "cuda") == batch.device == torch.device("cpu")
    assert landing_device(None, None, "meta") == torch.device("meta")
    assert landing_device(None, None, "cpu") == torch.device("cpu")


def test_domain_copies_on_a_device_are_reused_and_never_pickled() -> None:
    """``domain_cell`` copies the domain and pbc to a cell's device once (a copy
    from the host each step makes a GPU wait); a pickled partitioner (sent to
    another rank) carries only its state, not this process's device copies."""
    import pickle

    from nvdd.testing import record_host_syncs

    batch = make_batch(40, "mixed", seed=1, n_systems=2)
    part = SpatialPartitioner.from_batch(batch, 2, 6.5)
    want = part.domain_cell(batch.cell)
    with fake_accelerator() as dev:
        cell = batch.cell.to(dev)
        first = part.domain_cell(cell)
        with record_host_syncs() as log:
            again = part.domain_cell(cell)
        assert log == [], log  # the second call copies nothing from the host
        assert first.device == again.device == dev
        assert torch.equal(again.cpu(), want)
        copy = pickle.loads(pickle.dumps(part))
    assert part._on_device and not copy._on_device
    assert torch.equal(copy.domain_cell(batch.cell), want)
    assert copy.fingerprint() == part.fingerprint()


@pytest.mark.gloo
@pytest.mark.parametrize(("world", "kind", "n_systems"), [(2, "periodic", 2), (3, "mixed", 1)])
def test_scatter_migrate_rebalance_gather_on_a_device(
    world: int, kind: str, n_systems: int
) -> None:
    out = run_ranks(cpu_and_fake, world, kind, n_systems)
    for cpu, fake in out:
        assert set(cpu) == set(fake)
        for name, t in cpu.items():
            assert torch.equal(t, fake[name]), f"{name} differs between the CPU and the device run"
        assert bool(fake["device_ok"].all())
    assert "gathered_ids" in out[-1][1]
