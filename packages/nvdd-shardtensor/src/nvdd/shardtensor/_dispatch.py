"""ShardTensor's ``__torch_function__``: which operations do what.

Rules, in the order they are tried:

1. **Scatters along the rows into a ShardTensor** (``index_add(_)``,
   ``scatter_add(_)``, ``scatter_reduce(_)``, ``index_put(_)`` with
   ``accumulate=True``): the contribution is folded into its owners; see
   ``_scatter``.
2. **Gathers along the rows of a ShardTensor** (``index_select`` / ``gather`` on
   dim 0, indexing dim 0 with a tensor or list): run on the local tensor with
   no communication (ghost rows are already current, an invariant every rule
   keeps); the result is a plain tensor (its rows follow the index, not the
   atoms).
3. **Row-mixing operations** (sort, flip, roll, cumulative ops, nonzero, take,
   unique, masked_select): plain result, whatever the dim.
4. **In-place operations on a ShardTensor** (``add_``, ``mul_``, ``copy_``,
   ``x[i] = v``, ``x += y``, ...): run on a plain alias of the same storage;
   the ShardTensor object itself is returned. (Running them on the subclass
   object loses the subclass inside ``torch.compile`` with torch 2.13, see
   the ShardTensor notes in ``docs/design.md``.)
5. **Everything else** runs on the local tensors; a tensor result whose dim 0
   has ``n_padded`` rows becomes a ShardTensor with the same layout, anything
   else is a plain tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nvdd.shardtensor._protocol import HaloLayout
from nvdd.shardtensor._rules import (
    Handler,
    bind,
    find_layout,
    norm_dim,
    plain,
    rewrap,
    run_inplace,
    run_plain,
)
from nvdd.shardtensor._scatter import SCATTER_HANDLERS

__all__ = ["torch_function"]

# In-place operations that change metadata (shape, storage, autograd flags) rather
# than values: they must act on the object itself, not on an alias.
_METADATA_INPLACE = frozenset(
    {
        "requires_grad_",
        "retain_grad",
        "resize_",
        "resize_as_",
        "set_",
        "as_strided_",
        "squeeze_",
        "unsqueeze_",
        "transpose_",
        "t_",
        "swapdims_",
        "swapaxes_",
        "detach_",
        "share_memory_",
        "rename_",
        "record_stream",
        "_resize_output_",
        "resize_as_sparse_",
        "sparse_resize_",
        "sparse_resize_and_clear_",
        "_coalesced_",
        "_mkldnn_transpose_",
    }
)
_INPLACE_DUNDERS = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__imatmul__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
    }
)


def _is_value_inplace(name: str) -> bool:
    if name in _INPLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.endswith("__") and name not in _METADATA_INPLACE


def _inplace(
    cls: type[torch.Tensor],
    layout: HaloLayout | None,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Value-changing in-place op: act on a plain alias, return the ShardTensor itself."""
    return run_inplace(cls, func, args, kwargs)


def _plain_result(
    cls: type[torch.Tensor],
    layout: HaloLayout | None,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run on plain tensors and return the result as it is, never rewrapped:
    ``.grad``, ``._base``, ``as_subclass`` and the row-mixing operations."""
    return run_plain(func, args, kwargs)


_ADVANCED = (torch.Tensor, list, tuple)


def _is_advanced(part: Any) -> bool:
    return isinstance(part, _ADVANCED)


def _rows_indexed(key: Any, ndim: int) -> bool:
    """True when ``x[key]`` indexes dim 0 of ``x`` with a tensor or a list."""
    parts = key if isinstance(key, tuple) else (key,)
    for part in parts:
        if part is None:
            continue
        if part is Ellipsis:
            n_indexing = sum(1 for p in parts if p is not None and p is not Ellipsis)
            if n_indexing >= ndim:
                continue  # the ellipsis spans no dims; the next part indexes dim 0
            return False
        return _is_advanced(part)
    return False


def _gather_rule(names: tuple[str, ...], defaults: dict[str, Any]) -> Handler:
    def handler(
        cls: type[torch.Tensor],
        layout: HaloLayout | None,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        out = run_plain(func, args, kwargs)
        if layout is None:
            return out
        b = bind(args, kwargs, names, defaults)
        src = b["input"]
        if isinstance(src, cls):
            rows = (
                _rows_indexed(b["key"], src.ndim)
                if "key" in b
                else norm_dim(b["dim"], src.ndim) == 0
            )
            if rows:
                return out
        return rewrap(cls, out, layout)

    return handler


_ROW_MIXING: tuple[str, ...] = (
    "sort",
    "argsort",
    "msort",
    "flip",
    "flipud",
    "roll",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "logcumsumexp",
    "nonzero",
    "argwhere",
    "take",
    "take_along_dim",
    "unique",
    "unique_consecutive",
    "masked_select",
)


def _table() -> dict[Callable[..., Any], Handler]:
    # Every decision is one dict lookup keyed by the torch function: Dynamo traces
    # that, while it cannot trace string tests on ``func.__name__``.
    table: dict[Callable[..., Any], Handler] = {}
    for owner in (torch.Tensor, torch):
        for name in dir(owner):
            if _is_value_inplace(name) and callable(getattr(owner, name, None)):
                table[getattr(owner, name)] = _inplace
    table.update(SCATTER_HANDLERS)
    for func in torch.overrides.get_default_nowrap_functions():
        table[func] = _plain_result
    table[torch.Tensor.as_subclass] = _plain_result
    for func in (torch.Tensor.index_select, torch.index_select, torch.Tensor.gather, torch.gather):
        table[func] = _gather_rule(("input", "dim", "index"), {})
    table[torch.Tensor.__getitem__] = _gather_rule(("input", "key"), {})
    for name in _ROW_MIXING:
        for owner in (torch, torch.Tensor):
            if hasattr(owner, name):
                table[getattr(owner, name)] = _plain_result
    return table


_HANDLERS: dict[Callable[..., Any], Handler] = _table()


def torch_function(
    cls: type[torch.Tensor],
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
) -> Any:
    """The body of ``ShardTensor.__torch_function__`` (see the module docstring)."""
    kwargs = kwargs or {}
    layout = find_layout(cls, func, args, kwargs)
    handler = _HANDLERS.get(func)
    if handler is not None:
        return handler(cls, layout, func, args, kwargs)
    out = run_plain(func, args, kwargs)
    if out is NotImplemented:
        # torch's Python-level operators (``__pow__``, ``__rsub__``, ...) traced by
        # Dynamo (torch 2.13) under DisableTorchFunctionSubclass come back as
        # NotImplemented; called on plain aliases they trace. Eager never gets here
        # for operands torch accepts.
        out = func(*(plain(a) if isinstance(a, cls) else a for a in args), **kwargs)
    if layout is None:
        return out
    return rewrap(cls, out, layout)
