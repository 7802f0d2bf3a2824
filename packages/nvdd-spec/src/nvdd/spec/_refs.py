"""Names of Python objects as ``module:qualname`` strings, resolved under a trust rule.

Specs are stored as JSON. A callable or patch target is stored by name, never
pickled. Loading a name never imports anything unless the caller said
``trust=True``: a name whose module is not imported yet raises, naming the module.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from nvdd.core import ConfigurationError

__all__ = ["NamedRef", "name_of", "resolve_name", "split_name"]


def split_name(name: str) -> tuple[str, str]:
    """``"pkg.mod:Class.attr"`` -> ``("pkg.mod", "Class.attr")``; raises on bad form."""
    module, sep, qualname = name.partition(":")
    if not sep or not module or not qualname or " " in name:
        raise ConfigurationError(f"expected a name of the form 'module:qualname', got {name!r}")
    return module, qualname


def resolve_name(name: str, *, trust: bool) -> Any:
    """The object named ``module:qualname``.

    The module is imported only when ``trust`` is true; otherwise it must already
    be in ``sys.modules`` (it is, whenever the object was created by this process).

    Raises
    ------
    ConfigurationError
        If the module is not imported and ``trust`` is false (the message names the
        module), or the name does not resolve.
    """
    module, qualname = split_name(name)
    mod = sys.modules.get(module)
    if mod is None:
        if not trust:
            raise ConfigurationError(
                f"resolving {name!r} would import module {module!r}; pass trust=True to allow "
                "importing code named by a stored spec"
            )
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            raise ConfigurationError(
                f"cannot import module {module!r} for {name!r}: {exc}"
            ) from exc
    obj: Any = mod
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ConfigurationError(f"{name!r} does not resolve: no attribute {part!r}") from exc
    return obj


def name_of(obj: Any, what: str) -> str:
    """The ``module:qualname`` of ``obj``, checked to resolve back to ``obj``.

    Raises
    ------
    ConfigurationError
        For lambdas, local functions and anything else that cannot be named (a
        stored spec must never turn such an object into a silent no-op).
    """
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise ConfigurationError(
            f"{what} {obj!r} has no __module__/__qualname__; it cannot be stored"
        )
    if "<" in qualname:
        raise ConfigurationError(
            f"{what} {module}:{qualname} is a lambda or local object; only module-level objects "
            "can be stored in a spec"
        )
    name = f"{module}:{qualname}"
    try:
        back = resolve_name(name, trust=False)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{what} {name} cannot be stored: {exc}") from exc
    if back is not obj and getattr(back, "__wrapped__", None) is not obj:
        raise ConfigurationError(
            f"{what} {name} resolves to a different object ({back!r}); it cannot be stored by name"
        )
    return name


class NamedRef:
    """A reference to an object, by ``module:qualname`` name where it has one.

    A ref made from an object that cannot be named (a lambda, a local function)
    works in this process but raises at :meth:`stored_name`, so a spec holding it
    fails at ``to_dict`` instead of silently losing it. Two refs are equal when
    their names are equal (or, unnamed, when they hold the same object), so a spec
    built in code and the same spec loaded from JSON compare equal.
    """

    __slots__ = ("_obj", "_unnamed_reason", "name", "trust")

    def __init__(
        self,
        name: str | None,
        obj: Any = None,
        *,
        trust: bool = False,
        unnamed_reason: str | None = None,
    ) -> None:
        if name is not None:
            split_name(name)
        elif obj is None:
            raise ConfigurationError("NamedRef needs a name or an object")
        self.name = name
        self._obj = obj
        self.trust = trust
        self._unnamed_reason = unnamed_reason

    @classmethod
    def to(cls, obj_or_name: Any, what: str) -> NamedRef:
        """A ref to ``obj_or_name`` (an object, a ``module:qualname`` string, or a ref)."""
        if isinstance(obj_or_name, NamedRef):
            return obj_or_name
        if isinstance(obj_or_name, str):
            return cls(obj_or_name, trust=True)  # named in code by the programmer
        try:
            return cls(name_of(obj_or_name, what), obj_or_name, trust=True)
        except ConfigurationError as exc:
            return cls(None, obj_or_name, trust=True, unnamed_reason=str(exc))

    def stored_name(self) -> str:
        """The name to store; raises :class:`ConfigurationError` for unnamed objects."""
        if self.name is None:
            raise ConfigurationError(self._unnamed_reason or f"{self._obj!r} cannot be named")
        return self.name

    def resolve(self) -> Any:
        """The object (resolved once, under this ref's trust flag)."""
        if self._obj is None:
            assert self.name is not None  # guaranteed by __init__
            self._obj = resolve_name(self.name, trust=self.trust)
        return self._obj

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NamedRef):
            return False
        if self.name is None or other.name is None:
            return self.name is None and other.name is None and self._obj is other._obj
        return other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name) if self.name is not None else id(self._obj)

    def __repr__(self) -> str:
        return f"NamedRef({self.name or repr(self._obj)})"
