"""Every DomainConfig validation error names the field and the value."""

from __future__ import annotations

import math

import pytest

from nvdd.core import ConfigurationError
from nvdd.dynamics import DomainConfig
from nvdd.spec import StrategyKind

BAD = [
    ({"cutoff": 0.0}, r"cutoff must be > 0, got 0\.0"),
    ({"cutoff": -2.0}, r"cutoff must be > 0, got -2\.0"),
    ({"cutoff": math.nan}, r"cutoff must be a finite number, got nan"),
    ({"cutoff": "5"}, r"cutoff must be a finite number, got '5'"),
    ({"cutoff": 5.0, "skin": -0.1}, r"skin must be >= 0, got -0\.1"),
    (
        {"cutoff": 5.0, "skin": 1.0, "ghost_width": 5.5},
        r"ghost_width must be >= cutoff \+ skin = 6\.0, got 5\.5",
    ),
    ({"cutoff": 5.0, "strategy": "halo"}, r"strategy must be a StrategyKind, got 'halo'"),
    ({"cutoff": 5.0, "compile": 1}, r"compile must be a bool, got 1"),
    ({"cutoff": 5.0, "mesh_dim": ""}, r"mesh_dim must be a non-empty string, got ''"),
    ({"cutoff": 5.0, "grid_dims": (2, 2)}, r"grid_dims must be three integers >= 1, got \(2, 2\)"),
    (
        {"cutoff": 5.0, "grid_dims": (2, 0, 1)},
        r"grid_dims must be three integers >= 1, got \(2, 0, 1\)",
    ),
    (
        {"cutoff": 5.0, "skin": 0.5, "migration_hysteresis": 0.5},
        r"migration_hysteresis must be >= 0 and < skin = 0\.5, got 0\.5",
    ),
    (
        {"cutoff": 5.0, "skin": 0.5, "migration_hysteresis": -0.1},
        r"migration_hysteresis must be >= 0 and < skin = 0\.5, got -0\.1",
    ),
    (
        {"cutoff": 5.0, "strategy": StrategyKind.GRAPH_PARTITION, "grid_dims": (2, 1, 1)},
        r"grid_dims applies to StrategyKind.HALO only",
    ),
    (
        {"cutoff": 5.0, "strategy": StrategyKind.GRAPH_PARTITION, "load_balance": True},
        r"load_balance applies to StrategyKind.HALO only",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_each_validation_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=f"DomainConfig.{message}"):
        DomainConfig(**kwargs)


def test_defaults_and_derived_values() -> None:
    c = DomainConfig(cutoff=5.0, skin=1.0)
    assert c.resolved_ghost_width() == 6.0 and c.resolved_ghost_width(extra=2.0) == 8.0
    assert c.hysteresis == 0.25 and c.strategy is StrategyKind.HALO
    assert DomainConfig(cutoff=5.0, skin=0.0).hysteresis == 0.0
    assert DomainConfig(cutoff=5.0, skin=0.0, migration_hysteresis=0.0).hysteresis == 0.0
    assert DomainConfig(cutoff=5.0, ghost_width=9.0).resolved_ghost_width() == 9.0
    assert DomainConfig(cutoff=5.0, grid_dims=[2, 1, 1]).grid_dims == (2, 1, 1)  # type: ignore[arg-type]
