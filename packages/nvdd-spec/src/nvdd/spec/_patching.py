"""Reversible attribute patches with exact restoration.

A patch replaces ``owner.attr`` (a module or class attribute) and remembers what
was there: the owner's own value, or that the attribute was inherited / absent,
in which case restoring deletes it again. The same patch key installed twice
(nested scopes, two instances of one model) is reference counted; different
patches of one attribute stack and must be removed in reverse order.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from nvdd.core import NvddError

__all__ = ["AdapterError", "Patch", "active_patches", "apply_patch", "remove_patch"]


class AdapterError(NvddError, RuntimeError):
    """An adapter could not be installed or restored."""


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


@dataclass
class Patch:
    """One installed replacement of ``owner.attr``."""

    owner: Any
    attr: str
    previous: Any
    value: Any
    key: Hashable
    count: int = 1


_ACTIVE: dict[tuple[int, str], list[Patch]] = {}


def _own_value(owner: Any, attr: str) -> Any:
    d = getattr(owner, "__dict__", None)
    if d is not None and attr in d:
        return d[attr]
    return _MISSING


def apply_patch(owner: Any, attr: str, value: Any, key: Hashable) -> Patch:
    """Set ``owner.attr = value`` (or add a reference if ``key`` is already installed)."""
    stack = _ACTIVE.setdefault((id(owner), attr), [])
    for p in stack:
        if p.key == key:
            p.count += 1
            return p
    patch = Patch(owner=owner, attr=attr, previous=_own_value(owner, attr), value=value, key=key)
    try:
        setattr(owner, attr, value)
    except (AttributeError, TypeError) as exc:
        if not stack:
            _ACTIVE.pop((id(owner), attr), None)
        raise AdapterError(f"cannot patch {owner!r}.{attr}: {exc}") from exc
    stack.append(patch)
    return patch


def remove_patch(patch: Patch) -> None:
    """Drop one reference; at zero, restore exactly what was there before."""
    loc = (id(patch.owner), patch.attr)
    stack = _ACTIVE.get(loc, [])
    if patch not in stack:
        raise AdapterError(f"patch of {patch.owner!r}.{patch.attr} is not installed")
    if patch.count > 1:
        patch.count -= 1
        return
    if stack[-1] is not patch:
        raise AdapterError(
            f"patches of {patch.owner!r}.{patch.attr} restored out of order: close the scope that "
            "installed the newer one first"
        )
    stack.pop()
    if not stack:
        del _ACTIVE[loc]
    patch.count = 0
    if patch.previous is _MISSING:
        delattr(patch.owner, patch.attr)
    else:
        setattr(patch.owner, patch.attr, patch.previous)


def active_patches() -> list[Patch]:
    """Every installed patch (for diagnostics and tests)."""
    return [p for stack in _ACTIVE.values() for p in stack]
