"""The public surface: every exported name resolves, nothing public is a private module."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import nvdd.shardtensor as pkg
from nvdd.shardtensor import HaloLayout, SelfImageLayout


def test_every_name_in_all_resolves_and_is_unique() -> None:
    assert len(pkg.__all__) == len(set(pkg.__all__))
    for name in pkg.__all__:
        assert hasattr(pkg, name), name
    expected = {
        "DDContext",
        "HaloLayout",
        "Scope",
        "SelfImageLayout",
        "ShardTensor",
        "autograd_target",
        "current_dd_context",
        "dd_scope",
        "localize",
        "refresh_neighbors",
        "scatter_to_owners",
        "system_sum",
        "to_local",
    }
    assert expected <= set(pkg.__all__)


def test_modules_are_private_and_public_objects_are_documented() -> None:
    modules = [m.name for m in pkgutil.iter_modules(pkg.__path__)]
    assert modules and all(m.startswith("_") for m in modules), modules
    for name in pkg.__all__:
        if name == "__version__":
            continue
        obj = getattr(pkg, name)
        assert obj.__module__.startswith("nvdd.shardtensor._"), (name, obj.__module__)
        assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
        importlib.import_module(obj.__module__)


def test_collective_functions_say_so() -> None:
    for name in ("refresh_neighbors", "scatter_to_owners", "system_sum"):
        assert "**Collective**" in (getattr(pkg, name).__doc__ or ""), name
    assert "**Collective**" in (pkg.DDContext.validate.__doc__ or "")


def test_version_matches_the_changelog() -> None:
    changelog = Path(__file__).resolve().parents[1] / "CHANGELOG.md"
    assert re.search(rf"^## {re.escape(pkg.__version__)}\b", changelog.read_text(), re.M)


def test_self_image_layout_satisfies_the_protocol() -> None:
    layout = SelfImageLayout(2, torch.tensor([1]))
    assert isinstance(layout, HaloLayout)
    assert not isinstance(object(), HaloLayout)
    assert (layout.n_owned, layout.n_padded, layout.group) == (2, 3, None)


def test_with_positions_swaps_the_positions_and_checks_the_layout_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The runtime makes one context per halo plan and one per step with that
    step's positions: the layout is checked when the first is made, not again."""
    from nvdd.core import ConfigurationError
    from nvdd.shardtensor import DDContext, _context

    checked: list[object] = []
    real = _context.check_layout
    monkeypatch.setattr(_context, "check_layout", lambda lay: checked.append(lay) or real(lay))
    layout = SelfImageLayout(2, torch.tensor([1]))
    base = DDContext(layout=layout, n_systems=2, topology_version=5)
    pos = torch.zeros(3, 3)
    ctx = base.with_positions(pos)
    assert checked == [layout]  # (the base only)
    assert ctx.positions is pos and base.positions is None
    assert (ctx.layout, ctx.group, ctx.n_systems, ctx.topology_version) == (
        layout,
        base.group,
        2,
        5,
    )
    assert ctx.with_positions(None).positions is None
    with pytest.raises(ConfigurationError, match="must be a tensor or None"):
        base.with_positions([0.0])  # type: ignore[arg-type]
