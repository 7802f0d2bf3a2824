"""Helpers shared by the dispatch rules: wrapping, unwrapping, argument binding.

Everything here is written so that ``torch.compile`` (Dynamo) can trace it:
plain Python control flow on ints, ``isinstance`` checks, ``as_subclass`` and
``torch._C.DisableTorchFunctionSubclass``; no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

import torch
from torch._C import DisableTorchFunctionSubclass

from nvdd.core import ValidationError, get_rank
from nvdd.shardtensor._protocol import HaloLayout, describe_layout

__all__ = [
    "LAYOUT_ATTR",
    "Handler",
    "bind",
    "find_layout",
    "func_name",
    "layout_of",
    "norm_dim",
    "plain",
    "rewrap",
    "run_inplace",
    "run_plain",
    "wrap",
]

T = TypeVar("T", bound=torch.Tensor)

#: Instance attribute that holds a ShardTensor's layout.
LAYOUT_ATTR = "_nvdd_layout"
_SEQUENCES = (list, tuple)

#: ``handler(cls, layout, func, args, kwargs) -> result`` for one torch function.
Handler: TypeAlias = Callable[
    [type[torch.Tensor], HaloLayout | None, Callable[..., Any], tuple[Any, ...], dict[str, Any]],
    Any,
]


def layout_of(x: torch.Tensor) -> HaloLayout:
    """The layout a ShardTensor carries."""
    layout: HaloLayout = getattr(x, LAYOUT_ATTR)
    return layout


def wrap(cls: type[T], local: torch.Tensor, layout: HaloLayout) -> T:
    """``local`` viewed as ``cls`` carrying ``layout`` (shares storage and autograd)."""
    out = local.as_subclass(cls)
    setattr(out, LAYOUT_ATTR, layout)
    return out


def plain(x: torch.Tensor) -> torch.Tensor:
    """A plain ``torch.Tensor`` alias of ``x`` (same storage, stays in the autograd graph).

    In-place writes to the alias are writes to ``x``. (A same-shape ``view``:
    unlike ``as_subclass(torch.Tensor)`` it is traceable by Dynamo.)
    """
    with DisableTorchFunctionSubclass():
        return x.view(x.shape)


def func_name(func: Callable[..., Any]) -> str:
    """``func.__name__`` or ``repr(func)``, for messages and in-place detection."""
    name = getattr(func, "__name__", None)
    return name if isinstance(name, str) else repr(func)


def _mismatch(func: Callable[..., Any], a: HaloLayout, b: HaloLayout) -> ValidationError:
    return ValidationError(
        f"rank {get_rank()}: {func_name(func)} mixes ShardTensors of two different layouts "
        f"({describe_layout(a)} and {describe_layout(b)}); refresh or rebuild them from one "
        "halo plan"
    )


def find_layout(
    cls: type[torch.Tensor],
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> HaloLayout | None:
    """The layout shared by every ``cls`` instance among the arguments.

    Looks at positional and keyword arguments and one level into lists and
    tuples (``torch.cat([a, b])``). Raises :class:`ValidationError` when two
    ShardTensors carry different layout objects (a local, rank-uniform
    programming error: every rank runs the same program on layouts of one plan).
    """
    found: HaloLayout | None = None
    values = (*args, *kwargs.values()) if kwargs else args
    for value in values:
        if isinstance(value, cls):
            found = _same_layout(func, found, value)
        elif isinstance(value, _SEQUENCES):
            for item in value:
                if isinstance(item, cls):
                    found = _same_layout(func, found, item)
    return found


def _same_layout(func: Callable[..., Any], found: HaloLayout | None, x: torch.Tensor) -> HaloLayout:
    """``x``'s layout, which must be ``found`` unless nothing was found yet."""
    layout = layout_of(x)
    if found is not None and layout is not found:
        raise _mismatch(func, found, layout)
    return layout


def rewrap(cls: type[torch.Tensor], out: Any, layout: HaloLayout) -> Any:
    """Turn per-atom results back into ``cls``.

    A tensor result whose dim 0 has ``layout.n_padded`` rows becomes a
    ShardTensor with ``layout``; other tensors (per-edge, per-system, scalars)
    stay plain. Lists and tuples (including ``torch.return_types``) are mapped.
    """
    if isinstance(out, torch.Tensor):
        if isinstance(out, cls) or out.ndim == 0 or out.shape[0] != layout.n_padded:
            return out
        return wrap(cls, out, layout)
    if isinstance(out, _SEQUENCES):
        return type(out)(rewrap(cls, o, layout) for o in out)
    return out


def run_plain(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` with every ShardTensor seen as a plain tensor."""
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def run_inplace(
    cls: type[torch.Tensor],
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A value-changing in-place ``func`` whose destination is ``args[0]``.

    A ``cls`` destination is written through a plain alias of its storage and
    returned itself; any other call is :func:`run_plain`.
    """
    if args and isinstance(args[0], cls):
        dest = args[0]
        run_plain(func, (plain(dest), *args[1:]), kwargs)
        return dest
    return run_plain(func, args, kwargs)


def bind(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    names: tuple[str, ...],
    defaults: dict[str, Any],
) -> dict[str, Any]:
    """Map positional ``args`` onto ``names``, then apply ``kwargs`` over ``defaults``."""
    bound = dict(defaults)
    for name, value in zip(names, args, strict=False):
        bound[name] = value
    bound.update(kwargs)
    return bound


def norm_dim(dim: Any, ndim: int) -> int:
    """``dim`` as a non-negative index into ``ndim`` dims; -1 for a non-int ``dim``."""
    if not isinstance(dim, int):
        return -1
    return dim + max(ndim, 1) if dim < 0 else dim
