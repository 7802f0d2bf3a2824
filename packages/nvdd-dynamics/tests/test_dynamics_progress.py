"""The heartbeat BaseDynamics gives a watchdog, and adopting a ShardedBatch."""

from __future__ import annotations

import pytest
import torch
from ckpt_ranks import gas
from dyn_models import SoftPair

from nvdd.core import ConfigurationError, shutdown_distributed
from nvdd.dynamics import DomainConfig, DomainParallel, HookStage, VelocityVerlet
from nvdd.partition import ShardedBatch, SpatialPartitioner


def test_heartbeat_sees_every_stage_of_every_step() -> None:
    dyn = VelocityVerlet(SoftPair(), gas(n=12), dt_fs=1.0)
    seen: list[tuple[int, str]] = []
    dyn.heartbeat = lambda step, phase: seen.append((step, phase))
    dyn.register_hook(HookStage.AFTER_COMPUTE, lambda ctx: None, every=2)
    dyn.run(2)
    order = [s.value for s in HookStage if s is not HookStage.ON_CONVERGE]
    step0 = [(0, s) for s in order[:-1]] + [(1, order[-1])]
    step1 = [(1, s) for s in order[:-1]] + [(2, order[-1])]
    step0.insert(order.index("after_compute") + 1, (0, "after_compute hooks done"))
    assert seen == step0 + step1  # the hook is due at step 0 only


def test_partition_adopts_a_sharded_batch_only_with_the_model_ghost_width() -> None:
    batch = gas(n=20)
    dyn = VelocityVerlet(SoftPair(), batch, dt_fs=1.0)
    dp = DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=0.4), watchdog_s=0)
    wrong = SpatialPartitioner.from_batch(batch, 1, 1.0)
    with pytest.raises(ConfigurationError, match=r"ghost width 1\.0"):
        dp.partition(sharded=ShardedBatch(batch, wrong))
    right = SpatialPartitioner.from_batch(batch, 1, dp.model.ghost_width)
    try:
        with dp:
            sharded = dp.partition(sharded=ShardedBatch(batch, right))
            assert sharded.partitioner is right and dp.watchdog.timeout_s == 0
            dp.run(2)
            assert torch.isfinite(dp.gather(0).forces).all()  # type: ignore[union-attr]
    finally:
        shutdown_distributed()  # the world of one this process created


def test_domain_parallel_steps_beat_its_watchdog_inline() -> None:
    """Every hook stage of a decomposed step beats the watchdog through its
    ``step_beat`` fields (no call into the watchdog): the label names the step
    and stage reached, one beat per stage."""
    dyn = VelocityVerlet(SoftPair(), gas(n=12), dt_fs=1.0)
    dp = DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=0.4), watchdog_s=0)
    try:
        with dp:
            dp.partition()
            assert dp.step_state is not None and dp.step_state.progress is dp.watchdog.step_beat
            dp.run(2)
            beat = dp.watchdog.step_beat
            stages = [s for s in HookStage if s is not HookStage.ON_CONVERGE]
            assert (beat.step, beat.stage, beat.count) == (2, "after_step", 2 * len(stages))
            assert dp.watchdog._label == "step 2 after_step"
    finally:
        shutdown_distributed()  # the world of one this process created
