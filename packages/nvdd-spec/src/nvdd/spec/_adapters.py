"""Adapters: scoped, reversible patches that make opaque kernels DD-aware.

An adapter is a frozen declaration (what to patch, with what); installing it is
done by :class:`~nvdd.spec.AdapterRegistry` inside a distributed scope, never at
import. Every adapter stores its targets and callables by ``module:qualname``
name, so a spec holding it round-trips through JSON.
"""

from __future__ import annotations

import functools
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from nvdd.core import ConfigurationError
from nvdd.spec._dd import all_reduce_identity_backward, refresh, scatter, shard_layout, to_local
from nvdd.spec._patching import Patch, apply_patch
from nvdd.spec._refs import NamedRef, resolve_name, split_name

__all__ = [
    "Adapter",
    "FunctionAdapter",
    "JitAdapter",
    "MethodAdapter",
    "OpAdapter",
    "PythonAdapter",
    "adapter_from_dict",
]


def _owner_and_attr(target: str, trust: bool) -> tuple[Any, str]:
    module, qualname = split_name(target)
    parent, _, attr = qualname.rpartition(".")
    owner = resolve_name(f"{module}:{parent}", trust=trust) if parent else None
    if owner is None:
        mod = sys.modules.get(module)
        if mod is None:
            resolve_name(target, trust=trust)  # imports (if trusted) or raises naming the module
            mod = sys.modules[module]
        owner = mod
    if not hasattr(owner, attr):
        raise ConfigurationError(f"adapter target {target!r} does not exist")
    return owner, attr


@dataclass(frozen=True)
class Adapter(ABC):
    """Base of every adapter.

    Attributes
    ----------
    optional:
        When the target's module is not installed, record the adapter as not
        applied (with the reason) instead of failing the scope. Use for adapters
        of third-party packages a model may run without.
    declared_in:
        Where the adapter was declared (a preset or model name), for reports.
    """

    optional: bool = field(default=False, kw_only=True)
    declared_in: str | None = field(default=None, kw_only=True, compare=False)

    kind: ClassVar[str] = "Adapter"

    @property
    @abstractmethod
    def target(self) -> str:
        """The ``module:qualname`` this adapter patches."""

    @abstractmethod
    def key(self) -> Hashable:
        """Identity used to deduplicate adapters and reference-count patches."""

    @abstractmethod
    def install(self) -> list[Patch]:
        """Apply the patches; return them for the registry to restore."""

    @abstractmethod
    def _fields_to_dict(self) -> dict[str, Any]: ...

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; raises ConfigurationError for callables without a name."""
        return {
            "type": self.kind,
            **self._fields_to_dict(),
            "optional": self.optional,
            "declared_in": self.declared_in,
        }


def _calling(body: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        return body(original, *args, **kwargs)

    return patched


def _ref(value: Any, what: str) -> NamedRef:
    return NamedRef.to(value, what)


@dataclass(frozen=True)
class MethodAdapter(Adapter):
    """Wrap a class method: ``wrapper(original, self, *args, **kwargs)`` runs instead.

    Parameters
    ----------
    method:
        ``"module:Class.method"``.
    wrapper:
        A callable (or its ``module:qualname``) receiving the original bound
        method's function first. Decorate it with :func:`distributed_method` when it
        should only diverge under domain decomposition.
    """

    method: str = ""
    wrapper: NamedRef | Callable[..., Any] | str = ""
    kind: ClassVar[str] = "MethodAdapter"

    def __post_init__(self) -> None:
        split_name(self.method)
        object.__setattr__(self, "wrapper", _ref(self.wrapper, "MethodAdapter wrapper"))

    @property
    def target(self) -> str:
        """The wrapped method, ``module:Class.method``."""
        return self.method

    def key(self) -> Hashable:
        """``(kind, method, wrapper)``: the same wrapper on the same method is one patch."""
        assert isinstance(self.wrapper, NamedRef)
        return (self.kind, self.method, self.wrapper)

    def install(self) -> list[Patch]:
        """Replace the method on its class by one that calls ``wrapper(original, self, ...)``."""
        assert isinstance(self.wrapper, NamedRef)
        owner, attr = _owner_and_attr(self.method, self.wrapper.trust)
        original = getattr(owner, attr)
        body = self.wrapper.resolve()

        @functools.wraps(original)
        def patched(self_: Any, *args: Any, **kwargs: Any) -> Any:
            return body(original, self_, *args, **kwargs)

        return [apply_patch(owner, attr, patched, self.key())]

    def _fields_to_dict(self) -> dict[str, Any]:
        assert isinstance(self.wrapper, NamedRef)
        return {"method": self.method, "wrapper": self.wrapper.stored_name()}


@dataclass(frozen=True)
class FunctionAdapter(Adapter):
    """Adapt a module-level function named by the real function object.

    ``replacement(original, *args, **kwargs)`` runs instead of ``function`` where it
    is defined (``function.__module__``). Modules that copied the function with
    ``from m import f`` before the scope opened keep their copy: list them in
    ``also_patch`` (``"module:attr"``).
    """

    function: NamedRef | Callable[..., Any] | str = ""
    replacement: NamedRef | Callable[..., Any] | str = ""
    also_patch: tuple[str, ...] = ()
    kind: ClassVar[str] = "FunctionAdapter"

    def __post_init__(self) -> None:
        object.__setattr__(self, "function", _ref(self.function, "FunctionAdapter function"))
        object.__setattr__(
            self, "replacement", _ref(self.replacement, "FunctionAdapter replacement")
        )
        for name in self.also_patch:
            split_name(name)

    @property
    def target(self) -> str:
        """The adapted function's ``module:qualname`` (its repr when it has no name)."""
        assert isinstance(self.function, NamedRef)
        return self.function.name or repr(self.function)

    def key(self) -> Hashable:
        """``(kind, function, replacement, also_patch)``."""
        return (self.kind, self.function, self.replacement, self.also_patch)

    def install(self) -> list[Patch]:
        """Wrap the function where it is defined and at every ``also_patch`` location.

        Each location's current value is wrapped, so two adapters of one function
        stack.
        """
        assert isinstance(self.function, NamedRef) and isinstance(self.replacement, NamedRef)
        function = self.function.resolve()
        body = self.replacement.resolve()
        name = self.function.name or f"{function.__module__}:{function.__qualname__}"
        patches = []
        for loc in (name, *self.also_patch):
            owner, attr = _owner_and_attr(loc, self.function.trust)
            # Wrap what is there now, so a second adapter on the same function stacks.
            patches.append(
                apply_patch(owner, attr, _calling(body, getattr(owner, attr)), (self.key(), loc))
            )
        return patches

    def _fields_to_dict(self) -> dict[str, Any]:
        assert isinstance(self.function, NamedRef) and isinstance(self.replacement, NamedRef)
        return {
            "function": self.function.stored_name(),
            "replacement": self.replacement.stored_name(),
            "also_patch": list(self.also_patch),
        }


@dataclass(frozen=True)
class PythonAdapter(Adapter):
    """Replace a plain-Python module-level attribute outright with ``replacement``."""

    attribute: str = ""
    replacement: NamedRef | Any = None
    kind: ClassVar[str] = "PythonAdapter"

    def __post_init__(self) -> None:
        split_name(self.attribute)
        object.__setattr__(self, "replacement", _ref(self.replacement, "PythonAdapter replacement"))

    @property
    def target(self) -> str:
        """The replaced attribute, ``module:qualname``."""
        return self.attribute

    def key(self) -> Hashable:
        """``(kind, attribute, replacement)``."""
        return (self.kind, self.attribute, self.replacement)

    def install(self) -> list[Patch]:
        """Set the attribute to ``replacement``."""
        assert isinstance(self.replacement, NamedRef)
        owner, attr = _owner_and_attr(self.attribute, self.replacement.trust)
        return [apply_patch(owner, attr, self.replacement.resolve(), self.key())]

    def _fields_to_dict(self) -> dict[str, Any]:
        assert isinstance(self.replacement, NamedRef)
        return {"attribute": self.attribute, "replacement": self.replacement.stored_name()}


@dataclass(frozen=True)
class JitAdapter(Adapter):
    """Let a ShardTensor cross a ``@torch.jit.script`` module-level helper.

    The scripted function only accepts plain tensors. Under the adapter its
    ShardTensor arguments are replaced by their local tensors, and the outputs at
    ``rewrap_outputs`` are re-wrapped with the layout of the first ShardTensor
    argument (they must keep its ``[owned | ghost]`` rows). A custom
    ``replacement(original, *args)`` may be given instead.
    """

    function: str = ""
    rewrap_outputs: tuple[int, ...] = (0,)
    replacement: NamedRef | Callable[..., Any] | str | None = None
    kind: ClassVar[str] = "JitAdapter"

    def __post_init__(self) -> None:
        split_name(self.function)
        if self.replacement is not None:
            object.__setattr__(
                self, "replacement", _ref(self.replacement, "JitAdapter replacement")
            )

    @property
    def target(self) -> str:
        """The scripted helper, ``module:qualname``."""
        return self.function

    def key(self) -> Hashable:
        """``(kind, function, rewrap_outputs, replacement)``."""
        return (self.kind, self.function, self.rewrap_outputs, self.replacement)

    def install(self) -> list[Patch]:
        """Replace the helper by one that unwraps ShardTensor arguments and re-wraps outputs.

        With a ``replacement``, ``replacement(original, *args, **kwargs)`` runs instead.
        """
        trust = self.replacement.trust if isinstance(self.replacement, NamedRef) else True
        owner, attr = _owner_and_attr(self.function, trust)
        original = getattr(owner, attr)
        if isinstance(self.replacement, NamedRef):
            body = self.replacement.resolve()

            def patched(*args: Any, **kwargs: Any) -> Any:
                return body(original, *args, **kwargs)
        else:
            rewrap = self.rewrap_outputs

            def patched(*args: Any, **kwargs: Any) -> Any:
                layout = next((shard_layout(a) for a in args if shard_layout(a) is not None), None)
                out = original(
                    *[to_local(a) for a in args], **{k: to_local(v) for k, v in kwargs.items()}
                )
                if layout is None:
                    return out
                return _rewrap(out, rewrap, layout)

        return [apply_patch(owner, attr, patched, self.key())]

    def _fields_to_dict(self) -> dict[str, Any]:
        rep = self.replacement.stored_name() if isinstance(self.replacement, NamedRef) else None
        return {
            "function": self.function,
            "rewrap_outputs": list(self.rewrap_outputs),
            "replacement": rep,
        }


def _rewrap(out: Any, indices: tuple[int, ...], layout: Any) -> Any:
    from nvdd.spec._dd import as_shard

    if isinstance(out, torch.Tensor):
        return as_shard(out, layout) if 0 in indices else out
    if isinstance(out, tuple):
        return tuple(as_shard(o, layout) if i in indices else o for i, o in enumerate(out))
    return out


@dataclass(frozen=True)
class OpAdapter(Adapter):
    """Make a ``torch.library`` custom op ShardTensor-aware.

    Under the adapter, ``torch.ops.<ns>.<name>`` (and every ``also_patch``
    location, e.g. the module attribute holding a ``@custom_op`` object) calls the
    op on plain tensors after preparing its inputs, then combines its outputs:

    Parameters
    ----------
    op:
        ``"namespace::name"``.
    refresh_inputs:
        Positional inputs whose ghost rows are refreshed first (per-node tensors the
        kernel reads at neighbours).
    owned_inputs:
        Positional inputs sliced to owned rows (the kernel must see owned atoms only).
    fold_outputs:
        Outputs holding per-node partial sums on ``[owned | ghost]`` rows: ghost
        rows are folded into their owners (then refreshed).
    all_reduce_outputs:
        Outputs holding per-rank partials of a replicated quantity: all-reduced,
        with an identity backward.
    """

    op: str = ""
    refresh_inputs: tuple[int, ...] = ()
    owned_inputs: tuple[int, ...] = ()
    fold_outputs: tuple[int, ...] = ()
    all_reduce_outputs: tuple[int, ...] = ()
    also_patch: tuple[str, ...] = ()
    kind: ClassVar[str] = "OpAdapter"

    def __post_init__(self) -> None:
        ns, sep, name = self.op.partition("::")
        if not sep or not ns or not name:
            raise ConfigurationError(f"OpAdapter.op must be 'namespace::name', got {self.op!r}")
        both = set(self.refresh_inputs) & set(self.owned_inputs)
        if both:
            raise ConfigurationError(
                f"OpAdapter({self.op}): inputs {sorted(both)} both refreshed and sliced"
            )
        for name_ in self.also_patch:
            split_name(name_)

    @property
    def target(self) -> str:
        """The custom op, ``namespace::name``."""
        return self.op

    def key(self) -> Hashable:
        """The kind, the op and every input and output rule (and ``also_patch``)."""
        return (
            self.kind,
            self.op,
            self.refresh_inputs,
            self.owned_inputs,
            self.fold_outputs,
            self.all_reduce_outputs,
            self.also_patch,
        )

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        spec = self

        def patched(*args: Any, **kwargs: Any) -> Any:
            layouts = [shard_layout(a) for a in args]
            layout = next((lay for lay in layouts if lay is not None), None)
            prepared = []
            for i, a in enumerate(args):
                if i in spec.refresh_inputs:
                    a = refresh(a)
                local = to_local(a)
                if i in spec.owned_inputs and layouts[i] is not None:
                    local = local[: layouts[i].n_owned]
                prepared.append(local)
            out = original(*prepared, **{k: to_local(v) for k, v in kwargs.items()})
            single = isinstance(out, torch.Tensor)
            outs = [out] if single else list(out)
            for i in spec.fold_outputs:
                outs[i] = scatter(outs[i], layout)
            for i in spec.all_reduce_outputs:
                outs[i] = all_reduce_identity_backward(outs[i])
            return outs[0] if single else type(out)(outs)

        return patched

    def install(self) -> list[Patch]:
        """Wrap ``torch.ops.<ns>.<name>`` and every ``also_patch`` location.

        Raises
        ------
        ConfigurationError
            When no op of that name is registered.
        """
        ns, _, name = self.op.partition("::")
        namespace = getattr(torch.ops, ns)
        try:
            original = getattr(namespace, name)
        except (AttributeError, RuntimeError) as exc:
            raise ConfigurationError(f"OpAdapter: no registered op {self.op!r}") from exc
        patches = [apply_patch(namespace, name, self._wrap(original), (self.key(), "torch.ops"))]
        for loc in self.also_patch:
            owner, attr = _owner_and_attr(loc, True)
            patches.append(
                apply_patch(owner, attr, self._wrap(getattr(owner, attr)), (self.key(), loc))
            )
        return patches

    def _fields_to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "refresh_inputs": list(self.refresh_inputs),
            "owned_inputs": list(self.owned_inputs),
            "fold_outputs": list(self.fold_outputs),
            "all_reduce_outputs": list(self.all_reduce_outputs),
            "also_patch": list(self.also_patch),
        }


_TYPES: dict[str, type[Adapter]] = {
    cls.kind: cls for cls in (MethodAdapter, FunctionAdapter, PythonAdapter, JitAdapter, OpAdapter)
}
_TUPLES = (
    "also_patch",
    "rewrap_outputs",
    "refresh_inputs",
    "owned_inputs",
    "fold_outputs",
    "all_reduce_outputs",
)
_REFS = ("wrapper", "function", "replacement")


def adapter_from_dict(data: dict[str, Any], *, trust: bool) -> Adapter:
    """Rebuild an adapter from :meth:`Adapter.to_dict`; names resolve under ``trust``."""
    data = dict(data)
    kind = data.pop("type", None)
    cls = _TYPES.get(str(kind))
    if cls is None:
        raise ConfigurationError(f"unknown adapter type {kind!r}; known: {sorted(_TYPES)}")
    for key in _TUPLES:
        if key in data:
            data[key] = tuple(data[key])
    for key in _REFS:
        if isinstance(data.get(key), str) and not (cls is JitAdapter and key == "function"):
            data[key] = NamedRef(data[key], trust=trust)
    try:
        return cls(**data)
    except TypeError as exc:
        raise ConfigurationError(f"bad {kind} record {data}: {exc}") from exc
