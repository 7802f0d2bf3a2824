"""The public surface: every name in __all__ resolves, nothing else is public."""

from __future__ import annotations

import pkgutil

import nvdd.partition as pkg


def test_every_public_name_resolves() -> None:
    for name in pkg.__all__:
        assert getattr(pkg, name) is not None, name
    assert sorted(pkg.__all__) == sorted(set(pkg.__all__))
    assert pkg.__version__.count(".") == 2


def test_modules_other_than_the_package_are_private() -> None:
    for info in pkgutil.iter_modules(pkg.__path__):
        assert info.name.startswith("_"), f"nvdd.partition.{info.name} should be private"


def test_public_classes_come_from_the_package() -> None:
    public = [n for n in pkg.__all__ if not n.startswith("__")]
    assert set(public) == {
        "BalanceMode",
        "DegeneratePartitionWarning",
        "IndexPartitioner",
        "IndexShardedBatch",
        "MigrationStats",
        "ShardedBatch",
        "SpatialPartitioner",
        "graph_ghosts",
    }
