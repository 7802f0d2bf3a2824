"""Bad input: a clear error naming the rank and the value, on every rank together."""

from __future__ import annotations

import math
import re

import pytest
import torch
from halo_cases import grid_boxes, make_case
from halo_rankfns import bad_exchange_rank, bad_plan_rank, config_of

from nvdd.core import ConfigurationError, ValidationError
from nvdd.halo import ParticleHaloConfig, build_halo_plan
from nvdd.testing import run_ranks

INF = math.inf


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("fault", "expect"),
    [
        ("nan", r"ValidationError: rank 1: positions\[1\] = \[.*nan\] is not finite"),
        ("singular", "ValidationError: rank 1: cell of system 0 is singular"),
        ("shape", r"ValidationError: rank 1: positions has shape \(\d+, 2\)"),
        ("system", r"ValidationError: rank 1: system_index holds 5"),
        ("capacity", r"CapacityOverflowError: rank 0: \d+ ghost rows to send exceed max_ghost"),
        ("huge", "CapacityOverflowError: rank 0: ghost_width 1000000.0 needs more periodic"),
    ],
)
def test_bad_plan_input_raises_on_every_rank(fault: str, expect: str) -> None:
    out = run_ranks(bad_plan_rank, 3, "slab3_uneven_triclinic", fault, 1, timeout_s=120)
    assert len(set(out)) == 1, out  # the same error everywhere, and nobody hung
    assert re.search(expect, out[0]), out[0]


@pytest.mark.gloo
def test_bad_exchange_input_with_sync_checks_raises_everywhere() -> None:
    out = run_ranks(bad_exchange_rank, 2, 0, timeout_s=120)
    assert len(set(out)) == 1, out
    assert "ValidationError: rank 0: forward input has shape" in out[0]


def test_local_exchange_check_names_rank_and_shape() -> None:
    case = make_case("single_periodic")
    rows = torch.arange(case.positions.shape[0])
    plan = build_halo_plan(
        config_of(case), case.positions, case.atom_ids[rows], case.system_index, case.cell
    )
    with pytest.raises(ValidationError, match=r"rank 0: reverse input has shape \(3, 3\)"):
        plan.reverse(torch.zeros(3, 3, dtype=torch.float64))
    with pytest.raises(ValidationError, match=r"cell has shape \(3, 3\)"):
        plan.ghost_positions(case.positions, case.cell[0])
    with pytest.raises(ValidationError, match="refresh input"):
        plan.refresh(case.positions)


def test_config_world_mismatch_is_a_configuration_error() -> None:
    case = make_case("slab2_cubic")  # boxes for two ranks, no process group here
    with pytest.raises(ConfigurationError, match="boxes for 2 ranks, the group has 1"):
        build_halo_plan(
            config_of(case), case.positions, case.atom_ids, case.system_index, case.cell
        )


PBC = torch.tensor([[True, True, False]])


def _cfg(boxes: torch.Tensor, pbc: torch.Tensor = PBC, gw: float = 1.0) -> ParticleHaloConfig:
    return ParticleHaloConfig(boxes=boxes, pbc=pbc, ghost_width=gw)


def test_config_accepts_grids_bisection_and_open_cuts_anywhere() -> None:
    cfg = _cfg(grid_boxes([[0.3], [0.5, 0.9], [-2.0, 7.5]], [True, True, False])[None])
    assert cfg.world_size == 18 and cfg.n_systems == 1 and cfg.boxes.dtype == torch.float64
    bis = torch.tensor(
        [
            [[0, 0, -INF], [0.5, 1, INF]],
            [[0.5, 0, -INF], [1, 0.3, 0.2]],
            [[0.5, 0, 0.2], [1, 0.3, INF]],
            [[0.5, 0.3, -INF], [1, 1, INF]],
        ],
        dtype=torch.float64,
    )
    assert _cfg(bis[None]).world_size == 4
    two = torch.stack(
        [grid_boxes([[0.5], [], []], [True] * 3), grid_boxes([[], [], [0.1]], [True] * 3)]
    )
    assert _cfg(two, torch.ones(2, 3, dtype=torch.bool)).n_systems == 2


@pytest.mark.parametrize(
    ("gw", "match"),
    [(0.0, "ghost_width must be > 0"), (-1.0, "> 0"), (math.nan, "finite"), (math.inf, "finite")],
)
def test_config_rejects_bad_ghost_width(gw: float, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        _cfg(grid_boxes([[], [], []], [True, True, False])[None], gw=gw)


def _boxes(*rows: tuple[list[float], list[float]]) -> torch.Tensor:
    return torch.tensor([list(r) for r in rows], dtype=torch.float64)[None]


@pytest.mark.parametrize(
    ("boxes", "match"),
    [
        (  # gap along x between 0.4 and 0.5
            _boxes(([0, 0, -INF], [0.4, 1, INF]), ([0.5, 0, -INF], [1, 1, INF])),
            "along axis 0|leave a gap",
        ),
        (  # gap inside: a bisection with a hole
            _boxes(
                ([0, 0, -INF], [0.5, 1, INF]),
                ([0.5, 0, -INF], [1, 0.3, INF]),
                ([0.5, 0.4, -INF], [1, 1, INF]),
            ),
            "leave a gap",
        ),
        (  # overlap
            _boxes(([0, 0, -INF], [0.6, 1, INF]), ([0.5, 0, -INF], [1, 1, INF])),
            "overlap: rank 0",
        ),
        (  # open axis not covering the whole line
            _boxes(([0, 0, 0.0], [1, 1, INF])),
            r"axis 2 \(open",
        ),
        (  # periodic axis outside [0, 1]
            _boxes(([-0.1, 0, -INF], [0.5, 1, INF]), ([0.5, 0, -INF], [1, 1, INF])),
            "axis 0 is periodic but rank 0",
        ),
        (_boxes(([0, 0, -INF], [0, 1, INF]), ([0, 0, -INF], [1, 1, INF])), "is empty along axis 0"),
        (_boxes(([0, 0, -INF], [math.nan, 1, INF])), "holds NaN"),
    ],
)
def test_config_rejects_boxes_that_do_not_tile(boxes: torch.Tensor, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match) as info:
        _cfg(boxes)
    assert "system 0" in str(info.value)


def test_config_rejects_bad_shapes() -> None:
    good = grid_boxes([[], [], []], [True, True, False])[None]
    with pytest.raises(ConfigurationError, match="expected \\(n_systems, world_size, 2, 3\\)"):
        _cfg(good[0])
    with pytest.raises(ConfigurationError, match="pbc has shape"):
        _cfg(good, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ConfigurationError, match="pbc must be a bool"):
        _cfg(good, torch.ones(1, 3))
    with pytest.raises(ConfigurationError, match="max_ghost_rows"):
        ParticleHaloConfig(boxes=good, pbc=PBC, ghost_width=1.0, max_ghost_rows=-1)
