"""Plans and exchanges on a device: the fake accelerator of nvdd.testing checks, on
the CPU, that nothing mixes the atoms' device with the CPU (or hands a CPU tensor
to an NCCL-like collective, or a CPU array to a Warp launch on the device)."""

from __future__ import annotations

import pytest
import torch
from halo_rankfns import device_rank

from nvdd.testing import run_ranks


@pytest.mark.gloo
@pytest.mark.parametrize(("name", "world"), [("slab2_cubic", 2), ("two_systems", 2)])
def test_plan_and_exchanges_on_a_device_match_the_cpu(name: str, world: int) -> None:
    for cpu, fake in run_ranks(device_rank, world, name):
        assert fake["devices"] == ["meta"], "a result left the atoms' device"
        assert cpu["devices"] == ["cpu"]
        for key in ("ghost_ids", "ghost", "folded", "grad", "moved"):
            assert torch.equal(cpu[key], fake[key]), key


def test_a_warp_launch_on_the_device_refuses_cpu_arrays() -> None:
    from nvdd.halo import _kernels
    from nvdd.testing import DeviceMixingError, fake_accelerator

    pos = torch.rand(8, 3, dtype=torch.float64)
    system = torch.zeros(8, dtype=torch.int64)
    inv = torch.eye(3, dtype=torch.float64)[None]
    with fake_accelerator() as dev:
        frac, bad = _kernels.compute_fractional(pos.to(dev), system.to(dev), inv.to(dev))
        assert frac.device == dev
        torch.testing.assert_close(frac.cpu(), pos, rtol=0, atol=0)
        assert int(bad) == 0
        out = torch.empty(8, 3, dtype=torch.float64, device=dev)
        flag = torch.zeros(1, dtype=torch.int32, device=dev)
        with pytest.raises(DeviceMixingError, match="made from CPU tensors"):
            _kernels._launch(
                _kernels.compute_fractional_kernel,
                8,
                [pos.to(dev), system, inv.to(dev), out, flag],  # system left on the CPU
                dev,
            )
