"""The fake accelerator: device mixing raises on the CPU as it would on a GPU."""

from __future__ import annotations

import pytest
import torch
from testing_fake_ranks import collective_devices

from nvdd.core import Batch
from nvdd.testing import (
    FAKE_DEVICE,
    DeviceMixingError,
    FakeDeviceTensor,
    fake_accelerator,
    record_host_syncs,
    run_ranks,
    to_fake,
)


def test_values_are_real_and_devices_are_tracked() -> None:
    with fake_accelerator() as dev:
        x = torch.arange(6, dtype=torch.float64, device=dev).reshape(2, 3)
        y = (x * 2 + torch.tensor(1.0)).sum(dim=1)  # a CPU 0-dim scalar is allowed
        assert isinstance(y, FakeDeviceTensor)
        assert y.device == FAKE_DEVICE
        assert y.tolist() == [9.0, 27.0]
        assert float(y[1]) == 27.0
        host = y.cpu()
        assert type(host) is torch.Tensor
        assert host.device.type == "cpu"
        assert torch.equal(host, torch.tensor([9.0, 27.0], dtype=torch.float64))
        # Operators whose names end in "_" without working in place (__rshift__).
        k = torch.tensor([256, 1024], device=dev)
        assert ((k >> 8) ^ 1).tolist() == [0, 5]


def test_mixing_with_a_cpu_tensor_raises() -> None:
    with fake_accelerator() as dev:
        x = torch.ones(4, 3, device=dev)
        with pytest.raises(DeviceMixingError, match="same device"):
            _ = x + torch.ones(4, 3)
        with pytest.raises(DeviceMixingError, match="same device"):
            torch.cat([x, torch.zeros(1, 3)])
        with pytest.raises(DeviceMixingError, match="same device"):
            x.index_select(0, torch.tensor([0, 1]))
        with pytest.raises(DeviceMixingError, match="numpy"):
            x.numpy()


def test_cpu_indices_lists_and_data_reach_the_device_intact() -> None:
    with fake_accelerator() as dev:
        x = torch.arange(12.0, device=dev).reshape(4, 3)
        assert x[torch.tensor([3, 0])].tolist() == [[9.0, 10.0, 11.0], [0.0, 1.0, 2.0]]
        assert x[1, [0, 2]].tolist() == [3.0, 5.0]
        x[[0, 1]] = torch.zeros(2, 3, device=dev)
        assert x.sum().item() == sum(range(6, 12))
        t = torch.tensor([[1, 2], [3, 4]], device=dev)
        assert isinstance(t, FakeDeviceTensor)
        assert t.tolist() == [[1, 2], [3, 4]]
        assert torch.as_tensor(True, device=dev).item() is True


def test_autograd_and_in_place_updates() -> None:
    with fake_accelerator() as dev:
        x = torch.tensor([1.0, 2.0, 3.0], device=dev, requires_grad=True)
        (x * x).sum().backward()
        assert x.grad is not None
        assert x.grad.device == FAKE_DEVICE
        assert x.grad.tolist() == [2.0, 4.0, 6.0]
        y = torch.zeros(3, device=dev)
        y.add_(x.detach(), alpha=2.0)
        assert y.tolist() == [2.0, 4.0, 6.0]


def test_batches_move_to_the_fake_device() -> None:
    batch = Batch(torch.rand(5, 3, dtype=torch.float64), torch.full((5,), 18))
    with fake_accelerator():
        fake = to_fake(batch)
        assert fake.positions.device == FAKE_DEVICE
        assert fake.cell.device == FAKE_DEVICE
        assert torch.equal(fake.positions.cpu(), batch.positions)
    with pytest.raises(TypeError, match="tensor or a Batch"):
        to_fake([1, 2])


@pytest.mark.gloo
def test_collectives_take_device_tensors_only() -> None:
    out = run_ranks(collective_devices, 2)
    for dev, total, refused in out:
        assert dev == "meta"
        assert total == 9.0  # (1 + 2) * 3
        assert "CPU tensors of shapes [(3,)]" in refused


def test_record_host_syncs_logs_what_would_make_a_gpu_wait() -> None:
    with fake_accelerator() as dev:
        t = to_fake(torch.tensor([1.0, -2.0, 3.0]))
        host = torch.tensor([4.0, 5.0, 6.0])
        with record_host_syncs() as log:
            u = (t * 2 + 1).abs().sum(dim=0)  # device work only: nothing logged
            assert log == []
            float(u)
            t.cpu()
            host.to(dev)
            t[t > 0]
            t.nonzero()
            t.tolist()
            host * 2  # host work only: nothing logged
        kinds = [entry.split(" at ")[0] for entry in log]
        assert kinds == [
            "scalar read",
            "device-to-host copy of 3 values",
            "host-to-device copy of 3 values",
            "boolean-mask indexing (data-dependent shape)",
            "aten::nonzero (data-dependent shape)",
            "tolist",
        ]
        with record_host_syncs() as outside_nvdd:
            t.sum().item()
        assert outside_nvdd == ["scalar read at ?"]  # no nvdd frame on the stack
    t.sum()  # (after the block: plain CPU again, nothing recorded anywhere)
