"""resolve_cap and CapacityRegistry: grow-only, geometric, rounded, rank-agreed."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from padding_toys import raised_message

from nvdd.core import ConfigurationError
from nvdd.padding import (
    CapacityRegistry,
    GrowthEvent,
    default_registry,
    resolve_cap,
)
from nvdd.testing import RankFailedError, run_ranks


def test_capacity_covers_need_with_headroom_and_is_a_multiple() -> None:
    reg = CapacityRegistry()
    cap = resolve_cap("atoms", 100, 2, growth=1.25, multiple=8, registry=reg)
    # ceil(1.25 * 102) = 128, already a multiple of 8
    assert cap == 128
    assert resolve_cap("edges", 100, growth=1.1, multiple=32, registry=reg) == 128  # 110 -> 128
    assert resolve_cap("tiny", 0, registry=reg) == 8  # at least one granule
    assert reg.snapshot() == {"atoms": 128, "edges": 128, "tiny": 8}


def test_capacity_is_stable_while_the_count_drifts_within_it() -> None:
    reg = CapacityRegistry()
    first = resolve_cap("n", 40, registry=reg)
    caps = [resolve_cap("n", real, registry=reg) for real in (41, 39, 45, 50, first, 3, 0)]
    assert caps == [first] * len(caps)
    assert reg.n_growths("n") == 1 and reg.n_reshapes == 1


def test_capacities_never_shrink_and_grow_geometrically() -> None:
    reg = CapacityRegistry()
    growth = 1.5
    caps = []
    real = 10
    for _ in range(12):
        cap = resolve_cap("n", real, growth=growth, multiple=4, registry=reg)
        caps.append(cap)
        assert cap >= real and cap % 4 == 0
        real = cap + 1  # always just over capacity: every call grows
        resolve_cap("n", 0, registry=reg)  # a small count never shrinks it
        assert reg.get("n") == cap
    assert all(b >= growth * a for a, b in itertools.pairwise(caps))
    assert reg.n_growths("n") == 12
    # a linear drift of +1 per step over 1000 steps grows only O(log) times
    drift = CapacityRegistry()
    for real in range(10, 1010):
        resolve_cap("d", real, registry=drift)
    assert drift.n_growths() <= 20


def test_growth_events_and_listeners_report_every_change() -> None:
    reg = CapacityRegistry()
    seen: list[GrowthEvent] = []
    reg.add_listener(seen.append)
    resolve_cap("a", 5, registry=reg)
    resolve_cap("a", 6, registry=reg)  # fits, no event
    resolve_cap("a", 30, 2, registry=reg)
    reg.remove_listener(seen.append)
    resolve_cap("a", 1000, registry=reg)
    assert [(e.key, e.old, e.new, e.need, e.rank) for e in seen] == [
        ("a", 0, 8, 5, 0),
        ("a", 8, 40, 32, 0),
    ]
    assert reg.events[:2] == tuple(seen) and reg.n_growths() == 3 and reg.n_reshapes == 3
    assert "a" in reg and len(reg) == 1 and list(reg) == ["a"]
    reg.clear()
    assert reg.get("a") is None and reg.n_growths() == 0 and reg.n_reshapes == 0


def test_default_registry_is_used_without_an_explicit_one() -> None:
    key = "test_padding_cap.default"
    cap = resolve_cap(key, 17)
    assert default_registry().get(key) == cap == 24  # ceil(1.25 * 17) = 22 -> 24


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"real": -3}, "real must be >= 0, got -3"),
        ({"real": 2.5}, "real must be an int, got 2.5"),
        ({"real": True}, "real must be an int, got True"),
        ({"extra": -1}, "extra must be >= 0, got -1"),
        ({"growth": 0.9}, "growth must be a finite number >= 1, got 0.9"),
        ({"growth": float("inf")}, "growth must be a finite number >= 1, got inf"),
        ({"multiple": 0}, "multiple must be >= 1, got 0"),
        ({"key": ""}, "non-empty str, got ''"),
        ({"key": 3}, "non-empty str, got 3"),
    ],
)
def test_bad_arguments_raise_configuration_error_naming_the_value(
    kwargs: dict[str, object], match: str
) -> None:
    args: dict[str, object] = {"key": "k", "real": 4, **kwargs}
    reg = CapacityRegistry()
    with pytest.raises(ConfigurationError, match=f"rank 0: .*{match}"):
        resolve_cap(registry=reg, **args)  # type: ignore[arg-type]
    assert len(reg) == 0


def test_integer_like_counts_are_accepted() -> None:
    reg = CapacityRegistry()
    assert resolve_cap("t", torch.tensor(9), registry=reg) == 16
    assert resolve_cap("t", 10, torch.tensor(1), registry=reg) == 16


# ----------------------------------------------------------------- rank agreement
def _agree(reals: list[int]) -> tuple[int, int, int, int]:
    rank = dist.get_rank()
    reg = CapacityRegistry()
    a = resolve_cap("atoms", reals[rank], 1, group=dist.group.WORLD, registry=reg)
    e = resolve_cap("edges", 4 * reals[rank], multiple=32, group=dist.group.WORLD, registry=reg)
    # a second round where only the last rank grows past the capacity
    big = a * 2 if rank == dist.get_world_size() - 1 else 0
    a2 = resolve_cap("atoms", big, group=dist.group.WORLD, registry=reg)
    return a, e, a2, reg.n_growths()


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [2, 3])
def test_capacities_agree_across_ranks_with_different_counts(world_size: int) -> None:
    reals = [13, 40, 7][:world_size]
    out = run_ranks(_agree, world_size, reals, timeout_s=60)
    assert len(set(out)) == 1, out  # every rank: the same capacities and growth history
    a, e, a2, n_growths = out[0]
    oracle = CapacityRegistry()
    top = max(reals)
    assert a == resolve_cap("atoms", top, 1, registry=oracle)
    assert e == resolve_cap("edges", 4 * top, multiple=32, registry=oracle)
    assert a2 == resolve_cap("atoms", 2 * a, registry=oracle) > a
    assert n_growths == 3


def _one_rank_bad(bad_rank: int) -> str:
    reg = CapacityRegistry()
    real = -3 if dist.get_rank() == bad_rank else 5
    try:
        resolve_cap("atoms", real, group=dist.group.WORLD, registry=reg)
    except ConfigurationError as exc:
        dist.barrier()  # nobody is left hanging in a collective
        return f"{type(exc).__name__}: {exc} | stored={reg.get('atoms')}"
    return "no error"


@pytest.mark.gloo
def test_bad_count_on_one_rank_raises_on_every_rank() -> None:
    out = run_ranks(_one_rank_bad, 3, 1, timeout_s=60)
    assert out == ["ConfigurationError: rank 1: atoms: real must be >= 0, got -3 | stored=None"] * 3


def _mismatched_keys() -> str:
    key = "atoms" if dist.get_rank() == 0 else "edges"
    return raised_message(
        lambda: resolve_cap(key, 5, group=dist.group.WORLD, registry=CapacityRegistry()),
        ConfigurationError,
    )


@pytest.mark.gloo
def test_different_keys_on_different_ranks_are_detected_everywhere() -> None:
    out = run_ranks(_mismatched_keys, 2, timeout_s=60)
    assert "rank 0: capacity keys differ across ranks" in out[0] and "'atoms'" in out[0]
    assert "rank 1: capacity keys differ across ranks" in out[1] and "'edges'" in out[1]


def _raise_in_rank() -> None:
    resolve_cap("x", -1, group=dist.group.WORLD, registry=CapacityRegistry())


@pytest.mark.gloo
def test_rank_failure_reaches_the_parent_as_configuration_error() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(_raise_in_rank, 2, timeout_s=60)
    assert isinstance(info.value.exception, ConfigurationError)
    assert "rank 0: x: real must be >= 0, got -1; rank 1: x: real must be >= 0" in str(info.value)
