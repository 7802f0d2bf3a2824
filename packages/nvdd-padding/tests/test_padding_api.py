"""The public surface of nvdd.padding: __all__ is complete, resolves and is documented."""

from __future__ import annotations

import inspect
import types

import nvdd.padding as padding


def test_every_name_in_all_resolves_once() -> None:
    assert len(padding.__all__) == len(set(padding.__all__))
    for name in padding.__all__:
        assert getattr(padding, name) is not None, name


def test_nothing_public_is_left_out_of_all() -> None:
    public = {
        name
        for name, value in vars(padding).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(padding.__all__) - {"__version__"}


def test_public_objects_are_documented_and_collectives_say_so() -> None:
    for name in padding.__all__:
        obj = getattr(padding, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"
    collectives = [
        padding.resolve_cap,
        padding.COOPadder.pad,
        padding.DensePadder.pad,
        padding.DenseBatchPadder.pad,
        padding.GraphPadder.pad,
    ]
    for fn in collectives:
        assert "**Collective**" in (fn.__doc__ or ""), fn.__qualname__


def test_seed_api_names_exist() -> None:
    # the names users expect (shared/seed/distributed-api.txt, "Graph-parallel padding")
    for name in ("GraphPadder", "COOPadder", "DensePadder", "DenseBatchPadder", "resolve_cap"):
        assert name in padding.__all__
    assert padding.__version__ == "0.1.0"
