"""One force provider class per mode; `distributed_model_for` picks it."""

from __future__ import annotations

import pytest
from dyn_models import PairSum, SoftPair

from nvdd.core import ConfigurationError
from nvdd.dynamics import (
    DistributedModel,
    DistributedPipelineModel,
    DomainConfig,
    WholeBatchModel,
    distributed_model_for,
)
from nvdd.dynamics._provider import ProviderBase


@pytest.mark.parametrize(
    ("world_size", "halo_on_one_rank", "pipeline", "expected"),
    [
        (1, False, False, WholeBatchModel),
        (1, True, False, DistributedModel),
        (2, False, False, DistributedModel),
        (None, False, False, DistributedModel),  # (no world size: the halo, as before)
        (1, False, True, DistributedPipelineModel),  # (components always on padded rows)
    ],
)
def test_distributed_model_for_picks_the_mode(
    world_size: int | None, halo_on_one_rank: bool, pipeline: bool, expected: type
) -> None:
    config = DomainConfig(cutoff=2.5, halo_on_one_rank=halo_on_one_rank)
    model = PairSum([SoftPair()], cutoff=2.5) if pipeline else SoftPair()
    provider = distributed_model_for(model, config, world_size=world_size)
    assert type(provider) is expected and isinstance(provider, ProviderBase)


def test_the_whole_batch_mode_has_no_plan_and_the_base_is_abstract() -> None:
    config = DomainConfig(cutoff=2.5)
    with pytest.raises(ConfigurationError, match="has no halo plan"):
        _ = WholeBatchModel(SoftPair(), config).plan
    with pytest.raises(TypeError, match="abstract"):
        ProviderBase(SoftPair(), config)  # type: ignore[abstract]
