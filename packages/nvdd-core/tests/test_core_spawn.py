"""spawn_ranks (through nvdd.testing.run_ranks): results, tracebacks, timeouts; the oracle helpers."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nvdd.core import RankFailedError, RankTimeoutError, spawn_ranks
from nvdd.testing import (
    assert_close_by_id,
    assert_same_ids,
    gather_by_id,
    run_ranks,
)

pytestmark = pytest.mark.gloo


def _sum_ranks(offset: int) -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_run_ranks_returns_every_rank_result(world_size: int) -> None:
    out = run_ranks(_sum_ranks, world_size, 10, timeout_s=60)
    expected = float(sum(range(world_size)) + 10 * world_size)
    assert out == [(r, world_size, expected) for r in range(world_size)]


def _env_and_threads() -> tuple[str, str, int]:
    return os.environ["RANK"], os.environ["WORLD_SIZE"], torch.get_num_threads()


def test_run_ranks_sets_torchrun_environment() -> None:
    assert run_ranks(_env_and_threads, 2, timeout_s=60) == [("0", "2", 1), ("1", "2", 1)]


def _fail_on_rank(bad: int) -> None:
    if dist.get_rank() == bad:
        raise KeyError(f"planted failure on rank {bad}")
    # The healthy ranks block in a collective the failed rank never joins.
    dist.barrier()


def test_failing_rank_traceback_reaches_parent_quickly() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(_fail_on_rank, 3, 1, timeout_s=60)
    assert time.monotonic() - start < 30, "a failing rank must not wait for the timeout"
    err = info.value
    assert err.rank == 1
    assert "planted failure on rank 1" in str(err)
    assert "_fail_on_rank" in err.tracebacks[1]
    assert isinstance(err.exception, KeyError)


def _hang_on_rank(bad: int) -> None:
    if dist.get_rank() == bad:
        time.sleep(3600)


def test_hanging_rank_is_killed_at_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"rank\(s\) \[0\]"):
        run_ranks(_hang_on_rank, 2, 0, timeout_s=5)
    assert time.monotonic() - start < 20


def _exit_hard() -> None:
    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()


def test_rank_dying_without_result_is_reported() -> None:
    with pytest.raises(RankFailedError, match="exited with code 7"):
        run_ranks(_exit_hard, 2, timeout_s=60)


def test_run_ranks_rejects_local_functions() -> None:
    def local() -> None:  # pragma: no cover - never runs
        pass

    with pytest.raises(ValueError, match="module-level"):
        run_ranks(local, 2)


class _Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * x


def _apply(module: torch.nn.Module) -> tuple[list[float], bool]:
    return module(torch.ones(2)).tolist(), isinstance(module, torch.jit.ScriptModule)


def test_torchscript_modules_travel_to_and_from_ranks() -> None:
    """Plain pickle refuses ScriptModules; spawn_ranks sends them through torch.jit.save."""
    scripted = torch.jit.script(_Scale())
    wrapper = torch.nn.Sequential(scripted)  # a Python module holding a scripted one
    for module in (scripted, wrapper):
        assert spawn_ranks(_apply, 2, module) == [([2.0, 2.0], module is scripted)] * 2
    (back,) = spawn_ranks(_identity, 1, scripted)
    assert isinstance(back, torch.jit.ScriptModule)
    assert back(torch.ones(1)).tolist() == [2.0]


def _identity(value: object) -> object:
    return value


def _threads() -> int:
    return torch.get_num_threads()


def test_spawn_ranks_threads_per_rank() -> None:
    assert spawn_ranks(_threads, 2, timeout_s=60, threads_per_rank=2) == [2, 2]


def test_a_rank_leaves_init_only_once_every_peer_is_up(tmp_path: Path) -> None:
    # A function without collectives (as _threads above) must not let a rank exit
    # while a peer is still connecting: each rank waits for all at the file store.
    from nvdd.core._spawn import _wait_for_peers

    rdzv = str(tmp_path / "rdzv")
    done: list[int] = []
    first = threading.Thread(target=lambda: (_wait_for_peers(rdzv, 0, 2, 30), done.append(0)))
    first.start()
    time.sleep(0.3)
    assert done == []  # rank 0 still waits for rank 1
    _wait_for_peers(rdzv, 1, 2, 30)
    first.join(timeout=30)
    assert done == [0]
    _wait_for_peers(rdzv, 0, 1, 0.01)  # one rank: nothing to wait for


def _gather_rows() -> tuple[list[int], list[float]]:
    r = dist.get_rank()
    ids = torch.tensor([10 - r, 20 + r])
    vals = ids.double() * 0.5
    gids, gvals = gather_by_id(ids, vals)
    return gids.tolist(), gvals.tolist()


def test_gather_by_id_sorts_rows_from_every_rank() -> None:
    out = run_ranks(_gather_rows, 3, timeout_s=60)
    expected = ([8, 9, 10, 20, 21, 22], [4.0, 4.5, 5.0, 10.0, 10.5, 11.0])
    assert out == [expected] * 3


def test_assert_close_by_id_matches_rows_by_id() -> None:
    ids = torch.tensor([3, 1, 2])
    a = torch.tensor([[3.0], [1.0], [2.0]])
    assert_close_by_id(ids, a, torch.tensor([1, 2, 3]), torch.tensor([[1.0], [2.0], [3.0]]), atol=0)
    with pytest.raises(AssertionError, match="worst id 2"):
        assert_close_by_id(
            ids, a, torch.tensor([1, 2, 3]), torch.tensor([[1.0], [2.5], [3.0]]), atol=1e-3
        )


def test_assert_same_ids_detects_loss_and_duplicates() -> None:
    with pytest.raises(AssertionError, match="only in first"):
        assert_same_ids(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]))
    with pytest.raises(AssertionError, match="duplicate"):
        assert_same_ids(torch.tensor([1, 2, 2]), torch.tensor([1, 2, 2]))
