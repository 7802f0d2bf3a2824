"""The step-capture primitives: the CPU emulation replays what a CUDA graph would."""

from __future__ import annotations

import pytest
import torch

from nvdd.core import (
    CaptureError,
    EmulatedStepGraph,
    after_replay,
    can_capture,
    capturing,
    emulated_capture,
    make_step_graph,
    record_launch,
)


def test_a_replay_reruns_the_device_work_on_the_same_tensors() -> None:
    x = torch.arange(4, dtype=torch.float64)
    y = torch.zeros(4, dtype=torch.float64)
    held: dict[str, torch.Tensor] = {}

    def body() -> None:
        z = x * 2.0 + 1.0  # a fresh tensor: kept at its address by the replays
        y.copy_(z)
        held["z"] = z

    graph = EmulatedStepGraph()
    assert graph.capture(body) == []
    assert torch.equal(y, 2.0 * torch.arange(4.0, dtype=torch.float64) + 1.0)  # it executed
    z = held["z"]
    x.add_(10.0)  # in place: the replay sees it
    graph.replay()
    assert torch.equal(y, 2.0 * (torch.arange(4.0, dtype=torch.float64) + 10.0) + 1.0)
    assert held["z"] is z and torch.equal(z, y)
    assert graph.n_ops >= 3


def test_a_tensor_rebound_after_the_capture_is_not_seen() -> None:
    """As with a CUDA graph: the capture holds the tensor, not the Python name."""
    holder = {"x": torch.ones(3)}
    out = torch.zeros(3)
    graph = EmulatedStepGraph()
    graph.capture(lambda: out.copy_(holder["x"] * 3.0))
    holder["x"] = torch.full((3,), 5.0)
    graph.replay()
    assert torch.equal(out, torch.full((3,), 3.0))


@pytest.mark.parametrize(
    "read",
    [
        lambda t: float(t.sum()),
        lambda t: t.nonzero(),
        lambda t: bool(t.any()),
    ],
    ids=["float", "nonzero", "bool"],
)
def test_host_reads_inside_a_capture_raise(read) -> None:  # type: ignore[no-untyped-def]
    t = torch.ones(3)
    with pytest.raises(CaptureError, match="host"):
        EmulatedStepGraph().capture(lambda: read(t))
    assert not capturing()


def test_callbacks_and_external_launches_are_recorded() -> None:
    launches: list[int] = []
    seen: list[bool] = []

    def body() -> None:
        assert capturing()
        launches.append(1)  # the "launch" at capture time
        record_launch(lambda: launches.append(1))
        after_replay(lambda: seen.append(True) or True)

    graph = EmulatedStepGraph()
    callbacks = graph.capture(body)
    assert len(callbacks) == 1 and launches == [1]
    graph.replay()
    graph.replay()
    assert launches == [1, 1, 1]
    assert callbacks[0]() is True and seen == [True]


def test_capture_misuse_raises() -> None:
    with pytest.raises(CaptureError, match="outside"):
        after_replay(lambda: True)
    record_launch(lambda: None)  # outside a capture: nothing to record, no error
    graph = EmulatedStepGraph()
    with pytest.raises(CaptureError, match="already"):
        graph.capture(lambda: EmulatedStepGraph().capture(lambda: None))


def test_the_backend_follows_the_device_and_the_emulation_switch() -> None:
    cpu = torch.device("cpu")
    assert make_step_graph(cpu) is None and not can_capture(cpu)
    assert can_capture(torch.device("cuda", 0))
    with emulated_capture():
        assert isinstance(make_step_graph(cpu), EmulatedStepGraph) and can_capture(cpu)
    assert make_step_graph(cpu) is None and not can_capture(cpu)


def _collectives_replayed() -> list[list[float]]:
    import torch.distributed as dist

    from nvdd.core import all_reduce, all_to_all_single

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((world,), float(rank))
    got = torch.zeros(world)
    total = torch.zeros(1)

    def body() -> None:  # an exchange and a reduction, as a halo step makes them
        all_to_all_single(got, x)
        total.copy_(got.sum().reshape(1))
        all_reduce(total, "sum")

    graph = EmulatedStepGraph()
    graph.capture(body)
    seen = [got.tolist() + total.tolist()]
    for k in range(1, 3):
        x.fill_(10.0 * k + rank)  # new values in place: each replay must move them
        graph.replay()
        seen.append(got.tolist() + total.tolist())
    return seen


@pytest.mark.gloo
def test_a_replay_reruns_recorded_collectives_and_waits_for_them() -> None:
    """Collectives (gloo) inside an emulated capture are recorded like any
    operation; a replay reruns them and waits for each before the next
    operation reads its output (a CUDA graph orders them on the stream).
    Oracle: the unsharded sums computed here."""
    from nvdd.testing import run_ranks

    world = 3
    for rank, seen in enumerate(run_ranks(_collectives_replayed, world, timeout_s=60)):
        for k, row in enumerate(seen):
            sent = [10.0 * k + r if k else float(r) for r in range(world)]
            assert row[:world] == sent, (rank, k, row)  # rank r sent its value to all
            assert row[world] == world * sum(sent), (rank, k, row)
