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
