"""Rank bodies of the device-placement guard (module level: ranks import them).

Each body runs the same partition / migrate / gather / rebalance sequence twice:
on the CPU and on the fake accelerator of :mod:`nvdd.testing` (real values,
CUDA-like device checks), and returns both results for the test to compare.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from partition_testlib import make_batch

from nvdd.core import Batch
from nvdd.partition import BalanceMode, DegeneratePartitionWarning, ShardedBatch, SpatialPartitioner
from nvdd.testing import fake_accelerator


def _displace(batch: Batch, seed: int, scale: float) -> torch.Tensor:
    """The same random displacement for each atom id on every rank and device."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(400_000, 3, generator=gen, dtype=torch.float64) * scale
    step = table[batch.atom_ids.cpu() % 400_000].to(batch.positions)
    return batch.positions + step


def _sequence(batch: Batch, kind: str) -> dict[str, torch.Tensor]:
    """Scatter, migrate twice, rebalance, gather and to_global; the results on the CPU."""
    rank, world = dist.get_rank(), dist.get_world_size()
    part = SpatialPartitioner.from_batch(batch, world, 2.0, balance=BalanceMode.QUANTILE, skin=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegeneratePartitionWarning)
        sb = ShardedBatch.from_batch(batch if rank == 0 else None, None, part)
        for step in range(2):
            local = sb.local_batch
            sb.update_from_batch(local.replace(positions=_displace(local, 40 + step, 1.5)))
            sb.migrate(0.3)
        counts = torch.tensor(
            part.owned_counts(
                sb.local_batch.positions, sb.local_batch.system_index, cell=sb.local_batch.cell
            ).tolist()
        )
        keep = part.keeps_owner(
            sb.local_batch.positions,
            sb.local_batch.system_index,
            torch.full_like(sb.local_batch.system_index, rank),
            0.3,
            cell=sb.local_batch.cell,
        )
        sb.rebalance(hysteresis=0.3)
        reasons = sb.partitioner.degeneracies(list(sb.owned_counts), cell=sb.local_batch.cell)
    whole = sb.to_global()
    gathered = sb.gather(world - 1)
    out = {
        "ids": whole.atom_ids.cpu(),
        "positions": whole.positions.cpu(),
        "velocities": whole.velocities.cpu(),
        "counts": counts,
        "keep": keep.cpu(),
        "reasons": torch.tensor([len(reasons)]),
        "device_ok": torch.tensor(
            [
                whole.positions.device == batch.positions.device,
                sb.local_batch.cell.device == batch.device,
            ]
        ),
    }
    if gathered is not None:
        out["gathered_ids"] = gathered.atom_ids.cpu()
    return out


def cpu_and_fake(
    kind: str, n_systems: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    batch = make_batch(60, kind, seed=3, n_systems=n_systems)
    cpu = _sequence(batch, kind)
    with fake_accelerator() as dev:
        fake = _sequence(batch.to(dev), kind)
    return cpu, fake
