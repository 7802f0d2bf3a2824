"""`distributed_method` and `neighbor_refresh_adapters`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from nvdd.core import ConfigurationError
from nvdd.spec._adapters import MethodAdapter
from nvdd.spec._dd import dd_active, refresh
from nvdd.spec._refs import name_of, split_name

__all__ = ["distributed_method", "neighbor_refresh_adapters", "refresh_forward_output"]

F = TypeVar("F", bound=Callable[..., Any])


def distributed_method(body: F) -> F:
    """Decorate a ``MethodAdapter`` body that only diverges under domain decomposition.

    The decorated ``body(original, self, *args, **kwargs)`` runs when a DD context
    is active; otherwise the original method runs unchanged, so the same adapter
    is harmless in single-process use.
    """

    @functools.wraps(body)
    def dispatch(original: Callable[..., Any], self_: Any, *args: Any, **kwargs: Any) -> Any:
        if dd_active():
            return body(original, self_, *args, **kwargs)
        return original(self_, *args, **kwargs)

    dispatch.__nvdd_distributed_method__ = True  # type: ignore[attr-defined]
    return dispatch  # type: ignore[return-value]


@distributed_method
def refresh_forward_output(
    original: Callable[..., Any], self_: Any, *args: Any, **kwargs: Any
) -> Any:
    """MethodAdapter body: run ``forward``, then refresh the ghost rows of its output.

    A tensor output is refreshed; for a tuple or list, every tensor in it is. The
    output rows must be the module's per-node ``[owned | ghost]`` rows.
    """
    out = original(self_, *args, **kwargs)
    if isinstance(out, torch.Tensor):
        return refresh(out)
    if isinstance(out, tuple | list):
        return type(out)(refresh(o) if isinstance(o, torch.Tensor) else o for o in out)
    raise ConfigurationError(
        f"refresh_forward_output: {type(self_).__name__}.forward returned {type(out).__name__}; "
        "expected a per-node tensor or a tuple of them"
    )


def neighbor_refresh_adapters(
    *modules: type | str, method: str = "forward"
) -> tuple[MethodAdapter, ...]:
    """Adapters that refresh the ghost rows of each module's per-node ``forward`` output.

    For a message-passing layer class whose output feeds the next layer's neighbour
    gathers: after each call its ghost rows are made current (the per-layer refresh
    that keeps the ghost width at one cutoff).

    Parameters
    ----------
    modules:
        Classes or ``"module:Class"`` names.
    method:
        The method to wrap (default ``forward``).
    """
    out = []
    for m in modules:
        name = m if isinstance(m, str) else name_of(m, "neighbor_refresh_adapters class")
        split_name(name)
        out.append(
            MethodAdapter(
                f"{name}.{method}", refresh_forward_output, declared_in="neighbor_refresh_adapters"
            )
        )
    return tuple(out)
