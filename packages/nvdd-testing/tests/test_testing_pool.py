"""run_ranks' pooled worlds: reused ranks start each call as fresh ones would."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist

from nvdd.testing import RankFailedError, run_ranks
from nvdd.testing._pool import FRESH_RANKS_ENV, use_pool

pytestmark = pytest.mark.gloo


def _state() -> dict[str, object]:
    """What a call finds, then disturbs every part of it for the next call."""
    import numpy as np

    found = {
        "pid": os.getpid(),
        "env": os.environ.get("NVDD_POOL_PROBE"),
        "cwd": os.getcwd(),
        "dtype": str(torch.get_default_dtype()),
        "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "rand": torch.rand(3).tolist(),
        "py_rand": random.random(),
        "np_rand": float(np.random.rand()),
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": _all_reduce_one(),
    }
    os.environ["NVDD_POOL_PROBE"] = "left by an earlier call"
    os.chdir("/")
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    return found


def _all_reduce_one() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item())


def _fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    return os.getpid()


def _destroy_group() -> int:
    dist.destroy_process_group()
    return os.getpid()


def _pid() -> int:
    _all_reduce_one()
    return os.getpid()


def test_a_pooled_world_is_reused_and_each_call_starts_as_a_fresh_rank_would() -> None:
    first = run_ranks(_state, 2)
    second = run_ranks(_state, 2)
    assert [s["pid"] for s in first] == [s["pid"] for s in second]  # the same processes
    fresh = run_ranks(_state, 2, fresh=True)
    assert {s["pid"] for s in fresh}.isdisjoint(s["pid"] for s in first)
    for a, b, c in zip(first, second, fresh, strict=True):
        pid_a, pid_b, pid_c = a.pop("pid"), b.pop("pid"), c.pop("pid")
        assert pid_a == pid_b != pid_c
        assert a == b  # env, cwd, dtype, threads, grad mode, every RNG: put back
        # a fresh rank's `random` and NumPy are seeded from the OS (at fork, at
        # import); torch's generator and the rest start as the forkserver's
        del a["py_rand"], a["np_rand"], c["py_rand"], c["np_rand"]
        assert a == c
    assert [s["rank"] for s in first] == [0, 1]
    assert {s["sum"] for s in first} == {2.0}
    assert first[0]["env"] is None and first[0]["threads"] == 1


def test_a_failing_call_retires_its_world_and_the_next_call_gets_new_ranks() -> None:
    before = run_ranks(_pid, 2)
    with pytest.raises(RankFailedError, match="rank 1 fails on purpose") as info:
        run_ranks(_fail_on_rank_one, 2)
    assert isinstance(info.value.exception, ValueError)
    after = run_ranks(_pid, 2)
    assert set(after).isdisjoint(before)
    assert run_ranks(_pid, 2) == after  # and that new world is reused


def test_a_call_that_destroys_the_group_retires_its_world() -> None:
    pids = run_ranks(_destroy_group, 2)
    after = run_ranks(_pid, 2)
    assert set(after).isdisjoint(pids)


def test_worlds_of_different_sizes_are_kept_apart() -> None:
    two = run_ranks(_pid, 2)
    three = run_ranks(_pid, 3)
    assert len(set(three)) == 3 and set(two).isdisjoint(three)
    assert run_ranks(_pid, 2) == two


def test_calls_that_need_a_pristine_process_get_fresh_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert use_pool(2, "gloo", 180.0, {})
    assert not use_pool(2, "gloo", 5.0, {})  # expects a hang
    assert not use_pool(2, "nccl", 180.0, {})
    assert not use_pool(2, "gloo", 180.0, {"env": {"X": "1"}})
    assert not use_pool(2, "gloo", 180.0, {"start_method": "spawn"})
    assert not use_pool(2, "gloo", 180.0, {"threads_per_rank": 2})
    assert use_pool(2, "gloo", 180.0, {"env": {}, "threads_per_rank": 1})
    monkeypatch.setenv(FRESH_RANKS_ENV, "1")
    assert not use_pool(2, "gloo", 180.0, {})
    pooled = run_ranks(_pid, 2, fresh=True)
    assert run_ranks(_pid, 2) != pooled  # fresh ranks every time under the variable
