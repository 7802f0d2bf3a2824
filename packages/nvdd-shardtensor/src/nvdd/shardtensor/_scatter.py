"""Dispatch rules for scatters into a ShardTensor along its rows.

A model scatters messages into receiver rows. After the local scatter, the
ghost rows of the destination hold this rank's *partial* contributions for
atoms owned elsewhere, so the contribution is folded (ghost partials summed
into their owners across ranks, then refreshed) before it is added:

``x_new = x + fold(scatter(zeros_like(x), index, src))``

Only the *contribution* is folded, never ``x`` itself: ``x``'s ghost rows are
copies of their owners, and folding them would count the old value once per
copy. The result keeps the invariant (ghost rows equal their owners) and each
global edge is counted once, whether its receiver is an owned or a ghost row,
provided every global edge is present on exactly one rank.

Non-sum ``scatter_reduce`` (``prod``, ``mean``, ``amax``, ``amin``) cannot be
folded with a sum; it is applied locally and then refreshed, which is exact when
every edge's receiver is an owned row (the halo message-passing contract).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from nvdd.shardtensor._protocol import HaloLayout
from nvdd.shardtensor._rules import (
    Handler,
    bind,
    layout_of,
    norm_dim,
    plain,
    rewrap,
    run_inplace,
    run_plain,
)
from nvdd.shardtensor._rules import wrap as wrap_as

__all__ = ["SCATTER_HANDLERS"]


def _default(
    cls: type[torch.Tensor],
    layout: HaloLayout | None,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    inplace: bool,
) -> Any:
    """Not a row scatter into a ShardTensor: run on plain tensors, rewrap."""
    if inplace:
        return run_inplace(cls, func, args, kwargs)
    out = run_plain(func, args, kwargs)
    return out if layout is None else rewrap(cls, out, layout)


def _finish(
    cls: type[torch.Tensor],
    dest: torch.Tensor,
    new_local: torch.Tensor,
    inplace: bool,
    out: torch.Tensor | None,
) -> Any:
    """Write ``new_local`` into ``dest`` (in place) or ``out``, or return it as a new
    ShardTensor."""
    target = dest if inplace else out
    if target is None:
        return wrap_as(cls, new_local, layout_of(dest))
    with DisableTorchFunctionSubclass():
        plain(target).copy_(new_local)
    return target


def _add_folded(
    cls: type[torch.Tensor],
    dest: torch.Tensor,
    delta: torch.Tensor,
    inplace: bool,
    out: torch.Tensor | None,
) -> Any:
    """``dest + fold(delta)``, in place or as a new ShardTensor."""
    folded = layout_of(dest).fold(delta)
    local = plain(dest)
    with DisableTorchFunctionSubclass():
        if inplace:
            local.add_(folded)
            return dest
        new_local = local + folded
    return _finish(cls, dest, new_local, False, out)


def _scatter_rule(
    names: tuple[str, ...], defaults: dict[str, Any], inplace: bool, kind: str
) -> Handler:
    """A handler for one scatter flavour (``kind``), in place or not."""

    def handler(
        cls: type[torch.Tensor],
        layout: HaloLayout | None,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        b = bind(args, kwargs, names, defaults)
        dest = b["input"]
        out = b.get("out")
        if not isinstance(dest, cls):
            return _default(cls, layout, func, args, kwargs, inplace)
        if kind == "index_put":
            if not b["accumulate"]:
                return _default(cls, layout, func, args, kwargs, inplace)
        elif norm_dim(b["dim"], dest.ndim) != 0:
            return _default(cls, layout, func, args, kwargs, inplace)
        local = plain(dest)
        with DisableTorchFunctionSubclass():
            zeros = torch.zeros_like(local)
            if kind == "index_add":
                delta = zeros.index_add_(0, b["index"], b["source"], alpha=b["alpha"])
            elif kind == "scatter_add":
                delta = zeros.scatter_add_(0, b["index"], b["src"])
            elif kind == "index_put":
                delta = zeros.index_put_(tuple(b["indices"]), b["values"], accumulate=True)
            elif b["reduce"] == "sum":
                delta = zeros.scatter_add_(0, b["index"], b["src"])
                if not b["include_self"]:
                    return _replace_touched(cls, dest, delta, b, inplace, out)
            else:
                # On a copy: ``dest`` is overwritten below, and amax/prod save their input.
                new_local = local.clone().scatter_reduce(
                    0, b["index"], b["src"], b["reduce"], include_self=b["include_self"]
                )
                return _finish(cls, dest, layout_of(dest).refresh(new_local), inplace, out)
        return _add_folded(cls, dest, delta, inplace, out)

    return handler


def _replace_touched(
    cls: type[torch.Tensor],
    dest: torch.Tensor,
    delta: torch.Tensor,
    b: dict[str, Any],
    inplace: bool,
    out: torch.Tensor | None,
) -> Any:
    """``scatter_reduce(sum, include_self=False)``: elements touched on any rank
    become the folded sum, the others keep ``dest``."""
    layout = layout_of(dest)
    with DisableTorchFunctionSubclass():
        src = b["src"]
        hits = torch.zeros_like(delta).scatter_add_(0, b["index"], torch.ones_like(src))
    folded, touched = layout.fold(delta), layout.fold(hits)
    with DisableTorchFunctionSubclass():
        new_local = torch.where(touched != 0, folded, plain(dest))
    return _finish(cls, dest, new_local, inplace, out)


_INDEX_ADD = (("input", "dim", "index", "source"), {"alpha": 1, "out": None})
_SCATTER_ADD = (("input", "dim", "index", "src"), {"out": None})
_SCATTER_REDUCE = (
    ("input", "dim", "index", "src", "reduce"),
    {"include_self": True, "out": None},
)
_INDEX_PUT = (("input", "indices", "values", "accumulate"), {"accumulate": False})


def _table() -> dict[Callable[..., Any], Handler]:
    rules: list[tuple[Callable[..., Any], tuple[tuple[str, ...], dict[str, Any]], bool, str]] = [
        (torch.Tensor.index_add_, _INDEX_ADD, True, "index_add"),
        (torch.Tensor.index_add, _INDEX_ADD, False, "index_add"),
        (torch.index_add, _INDEX_ADD, False, "index_add"),
        (torch.Tensor.scatter_add_, _SCATTER_ADD, True, "scatter_add"),
        (torch.Tensor.scatter_add, _SCATTER_ADD, False, "scatter_add"),
        (torch.scatter_add, _SCATTER_ADD, False, "scatter_add"),
        (torch.Tensor.scatter_reduce_, _SCATTER_REDUCE, True, "scatter_reduce"),
        (torch.Tensor.scatter_reduce, _SCATTER_REDUCE, False, "scatter_reduce"),
        (torch.scatter_reduce, _SCATTER_REDUCE, False, "scatter_reduce"),
        (torch.Tensor.index_put_, _INDEX_PUT, True, "index_put"),
        (torch.Tensor.index_put, _INDEX_PUT, False, "index_put"),
        (torch.index_put_, _INDEX_PUT, True, "index_put"),
        (torch.index_put, _INDEX_PUT, False, "index_put"),
    ]
    return {
        func: _scatter_rule(names, defaults, inplace, kind)
        for func, (names, defaults), inplace, kind in rules
    }


#: The scatter-family handlers, keyed by torch function.
SCATTER_HANDLERS: dict[Callable[..., Any], Handler] = _table()
