"""`RecordedKernel`: recorded Warp launches that follow new arguments exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

wp: Any = pytest.importorskip("warp")

from nvdd.core import EmulatedStepGraph, RecordedKernel  # noqa: E402

wp.config.quiet = True


@wp.kernel
def _axpy(
    x: wp.array(dtype=Any),  # type: ignore[valid-type]
    y: wp.array(dtype=Any),  # type: ignore[valid-type]
    a: Any,
    shift: wp.float64,
    n_add: int,
    out: wp.array(dtype=Any),  # type: ignore[valid-type]
) -> None:
    i = wp.tid()
    v = a * x[i] + y[i]
    for _ in range(n_add):
        v = v + type(v)(shift)
    out[i] = v


@wp.kernel
def _grid(out: wp.array2d(dtype=wp.int32)) -> None:  # type: ignore[valid-type]
    i, j = wp.tid()
    out[i, j] = wp.int32(10 * i + j)


_KERNEL = RecordedKernel(_axpy, floats=(2,), doubles=(3,))
_KERNEL.declare_overloads()


def _expected(x: torch.Tensor, y: torch.Tensor, a: float, shift: float, n: int) -> torch.Tensor:
    v = a * x + y
    for _ in range(n):
        v = v + shift
    return v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_calls_replay_one_record_and_follow_every_change(dtype: torch.dtype) -> None:
    """New tensors, a new length, a strided view and new scalars each give the
    fresh result, from the one launch recorded for the signature."""
    k = RecordedKernel(_axpy, floats=(2,), doubles=(3,))
    g = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    cases = [(50, 1.5, 0.25, 0), (50, 1.5, 0.25, 2), (7, -2.0, 1.0, 1), (50, 0.5, -0.5, 3)]
    for n, a, shift, n_add in cases:
        x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
        y = torch.randn(n, 2, generator=g, dtype=torch.float64).to(dtype)[:, 1]  # strided
        out = torch.full((n,), float("nan"), dtype=dtype)
        k(n, [x, y, a, shift, n_add, out], cpu, dtype)
        tol = 1e-6 if dtype == torch.float32 else 1e-14
        ref = _expected(x.double(), y.double(), a, shift, n_add)
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
        assert k.recorded == 1
    assert not y.is_contiguous()


def test_a_repeated_call_casts_only_the_scalars_that_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scalars are cast to Warp's types when a launch is recorded and when they
    change, not on every call (the host work of a steady step)."""
    k = RecordedKernel(_axpy, floats=(2,), doubles=(3,))
    cast, seen = k._cast_one, []

    def spy(wp: Any, i: int, a: object, dtype: torch.dtype | None) -> object:
        seen.append(i)
        return cast(wp, i, a, dtype)

    monkeypatch.setattr(k, "_cast_one", spy)
    x, out, cpu = torch.ones(4), torch.zeros(4), torch.device("cpu")
    k(4, [x, x, 2.0, 0.0, 1, out], cpu, torch.float32)
    assert seen == [0, 1, 2, 3, 4, 5]  # the record: every argument
    seen.clear()
    k(4, [x, x, 2.0, 0.0, 1, out], cpu, torch.float32)
    assert seen == [] and torch.equal(out, torch.full((4,), 3.0))
    k(4, [x, x, 2.0, 0.5, 1, out], cpu, torch.float32)
    assert seen == [3] and torch.equal(out, torch.full((4,), 3.5))


def test_a_new_dtype_or_role_records_its_own_launch() -> None:
    k = RecordedKernel(_axpy, floats=(2,), doubles=(3,))
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.float64, torch.float32):
        x = torch.ones(4, dtype=dtype)
        out = torch.zeros(4, dtype=dtype)
        k(4, [x, x, 2.0, 0.0, 0, out], cpu, dtype)
        assert torch.equal(out, torch.full((4,), 3.0, dtype=dtype))
    assert k.recorded == 2
    x = torch.ones(4)
    outs = [torch.zeros(4), torch.zeros(4)]
    for role, out in ((0, outs[0]), (1, outs[1]), (0, outs[0])):
        k(4, [x, x, 1.0 + role, 0.0, 0, out], cpu, torch.float32, role=role)
    assert k.recorded == 4
    assert torch.equal(outs[0], torch.full((4,), 2.0)) and torch.equal(
        outs[1], torch.full((4,), 3.0)
    )


def test_tuple_dims_zero_dims_and_a_missing_dtype() -> None:
    k = RecordedKernel(_grid)
    out = torch.full((3, 4), -1, dtype=torch.int32)
    k((3, 4), [out], torch.device("cpu"))
    assert torch.equal(out, 10 * torch.arange(3)[:, None].int() + torch.arange(4).int())
    untouched = torch.full((0, 4), -1, dtype=torch.int32)
    k((0, 4), [untouched], torch.device("cpu"))  # nothing runs
    assert k.recorded == 1
    x = torch.ones(3)
    with pytest.raises(TypeError, match="no dtype was given"):
        _KERNEL(3, [x, x, 1.0, 0.0, 0, torch.zeros(3)], torch.device("cpu"))


def test_an_emulated_capture_replays_the_launch_with_the_tensors_of_the_call() -> None:
    k = RecordedKernel(_axpy, floats=(2,), doubles=(3,))
    x, y, out = torch.ones(5), torch.zeros(5), torch.zeros(5)
    graph = EmulatedStepGraph()
    graph.capture(lambda: k(5, [x, y, 2.0, 0.0, 0, out], torch.device("cpu"), torch.float32))
    assert graph.n_ops == 1 and torch.equal(out, torch.full((5,), 2.0))
    x.fill_(4.0)  # the replay reads the captured tensors' current values
    graph.replay()
    assert torch.equal(out, torch.full((5,), 8.0))


def test_a_fake_accelerator_gets_plain_launches_that_its_checks_see() -> None:
    testing = pytest.importorskip("nvdd.testing")
    k = RecordedKernel(_axpy, floats=(2,), doubles=(3,))
    with testing.fake_accelerator() as dev:
        x = torch.ones(6).to(dev)
        out = torch.zeros(6).to(dev)
        k(6, [x, x, 3.0, 0.5, 2, out], dev, torch.float32)
        assert torch.equal(out.cpu(), torch.full((6,), 5.0))
        assert k.recorded == 0  # (no record: every call converts its arguments)
        with pytest.raises(RuntimeError, match="made from CPU tensors"):
            k(6, [x, torch.ones(6), 3.0, 0.5, 2, out], dev, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_launches_follow_new_tensors() -> None:
    k = RecordedKernel(_axpy, floats=(2,), doubles=(3,))
    dev = torch.device("cuda")
    for n in (100, 100, 33):
        x = torch.randn(n, device=dev)
        y = torch.randn(n, device=dev)
        out = torch.empty(n, device=dev)
        k(n, [x, y, 0.5, 0.25, 1, out], dev, torch.float32)
        torch.testing.assert_close(out, 0.5 * x + y + 0.25)
    assert k.recorded == 1


def test_a_record_keeps_no_replaced_tensor_alive() -> None:
    """After a later call with new tensors, the first call's tensors are free
    (a record must not pin a halo rebuild's old buffers)."""
    import gc
    import weakref

    k = RecordedKernel(_axpy, floats=(2,), doubles=(3,))
    cpu = torch.device("cpu")
    first = [torch.ones(8), torch.ones(8), torch.zeros(8)]
    refs = [weakref.ref(t) for t in first]
    k(8, [first[0], first[1], 1.0, 0.0, 0, first[2]], cpu, torch.float32)
    second = [torch.ones(8), torch.ones(8), torch.zeros(8)]
    k(8, [second[0], second[1], 1.0, 0.0, 0, second[2]], cpu, torch.float32)
    del first
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]
    assert torch.equal(second[2], torch.full((8,), 2.0))
