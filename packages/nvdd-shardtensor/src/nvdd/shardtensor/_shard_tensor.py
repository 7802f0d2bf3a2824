"""ShardTensor: a per-atom tensor whose rows are ``[owned | ghost]`` on this rank."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from nvdd.core import ConfigurationError, ValidationError, get_rank
from nvdd.shardtensor._dispatch import torch_function
from nvdd.shardtensor._protocol import HaloLayout, check_layout
from nvdd.shardtensor._rules import layout_of, plain, wrap

__all__ = ["ShardTensor"]

#: Dynamo traces the dispatch correctly from torch 2.13 on. With older versions
#: (2.11 was seen folding scatters wrongly inside compiled graphs, and failing
#: internally when resuming after a graph break) the dispatch refuses to be
#: traced, so compiling code that runs on ShardTensors fails loudly with the
#: error below instead of computing a wrong graph.
_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
DISPATCH_TRACEABLE = _TORCH >= (2, 13)


def _refuse_tracing(
    cls: type[torch.Tensor],
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
) -> Any:
    if torch.compiler.is_compiling():
        raise ConfigurationError(
            f"rank {get_rank()}: ShardTensor under torch.compile needs torch >= 2.13, this is "
            f"{torch.__version__}: upgrade torch, or keep ShardTensors out of the compiled "
            "region"
        )
    return torch_function(cls, func, args, kwargs)


_dispatch = torch_function if DISPATCH_TRACEABLE else _refuse_tracing


class ShardTensor(torch.Tensor):
    """A per-atom tensor of ``shape (n_padded, ...)`` carrying its halo layout.

    Rows ``0 .. n_owned-1`` are this rank's owned atoms, the rest are ghosts:
    read-only copies of atoms owned elsewhere. The layout is carried
    explicitly (:attr:`halo_layout`), never inferred from a row count. A
    ShardTensor is a view of its local tensor: same storage, same autograd
    graph.

    Invariant kept by the dispatch: ghost rows equal their owners' values.
    Row-local operations keep it; scatters along the rows fold the ghost
    contributions into their owners and refresh; gathers along the rows need
    no communication because of it. See ``nvdd.shardtensor._dispatch`` for the
    rules and which results stay ShardTensors.

    Create one with :meth:`from_local`; get the plain local tensor back with
    :meth:`to_local` (or :func:`nvdd.shardtensor.to_local`).
    """

    @classmethod
    def from_local(cls, local: torch.Tensor, layout: HaloLayout) -> ShardTensor:
        """Wrap ``local`` (``shape (layout.n_padded, ...)``) as a ShardTensor.

        The result shares ``local``'s storage and stays in its autograd graph
        (a gradient taken with respect to either reaches the other). No
        communication: the ghost rows are taken as they are.

        Raises
        ------
        ValidationError
            If ``layout`` is not a :class:`HaloLayout` or ``local``'s rows differ
            from ``layout.n_padded`` (a local check; see the package README on
            rank-consistent validation).
        """
        layout = check_layout(layout)
        if not isinstance(local, torch.Tensor):
            raise ValidationError(
                f"rank {get_rank()}: ShardTensor.from_local needs a tensor, got "
                f"{type(local).__name__}"
            )
        if local.ndim == 0 or local.shape[0] != layout.n_padded:
            raise ValidationError(
                f"rank {get_rank()}: ShardTensor.from_local needs shape (n_padded="
                f"{layout.n_padded}, ...), got shape {tuple(local.shape)}"
            )
        if isinstance(local, ShardTensor):
            local = plain(local)
        return wrap(cls, local, layout)

    @property
    def halo_layout(self) -> HaloLayout:
        """The :class:`HaloLayout` of the rows (``torch.Tensor.layout`` is the memory layout)."""
        return layout_of(self)

    @property
    def n_owned(self) -> int:
        """Number of owned rows (they come first)."""
        return layout_of(self).n_owned

    @property
    def n_padded(self) -> int:
        """Owned plus ghost rows."""
        return layout_of(self).n_padded

    def to_local(self) -> torch.Tensor:
        """The plain local tensor, ``shape (n_padded, ...)``: a view, in the autograd graph."""
        return plain(self)

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Any = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return _dispatch(cls, func, tuple(args), kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        layout = layout_of(self)
        return (
            f"ShardTensor(n_owned={layout.n_owned}, n_padded={layout.n_padded}, "
            f"layout={type(layout).__name__}, local={plain(self)!r})"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardTensor:
        """Copies the values; the layout (shared plan, process group) is shared."""
        if id(self) in memo:
            found: ShardTensor = memo[id(self)]
            return found
        local = copy.deepcopy(plain(self), memo)
        out = wrap(type(self), local, layout_of(self))
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"rank {get_rank()}: a ShardTensor is tied to its halo layout (process group, "
            "plan) and cannot be pickled; pickle to_local(x) and the layout's own description"
        )
