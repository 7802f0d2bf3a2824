"""Rank bodies of the fake-accelerator tests (module level: ranks import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from nvdd.core import comm_device
from nvdd.testing import DeviceMixingError, fake_accelerator


def collective_devices() -> tuple[str, float, str]:
    """An all-reduce on the fake device works; one on a CPU tensor is refused."""
    rank = dist.get_rank()
    with fake_accelerator() as dev:
        t = torch.full((3,), float(rank + 1), device=comm_device())
        dist.all_reduce(t)
        total = float(t.sum())
        try:
            dist.all_reduce(torch.ones(3))
            refused = "accepted"
        except DeviceMixingError as exc:
            refused = str(exc)
    return str(dev), total, refused
