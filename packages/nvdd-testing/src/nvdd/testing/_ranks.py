"""`run_ranks`: the test entry point to ``nvdd.core.spawn_ranks``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from nvdd.core import RankFailedError, RankTimeoutError, spawn_ranks

__all__ = ["RankFailedError", "RankTimeoutError", "run_ranks"]

T = TypeVar("T")


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh CPU ranks over gloo.

    Ranks are forked from a forkserver with torch (and warp) preloaded, get one
    intra-op thread each, a file rendezvous and ``timeout_s`` as the collective
    timeout. See :func:`nvdd.core.spawn_ranks` for the details.

    Raises
    ------
    RankFailedError
        With every failing rank's traceback (the first to arrive is the cause).
    RankTimeoutError
        When ranks were still running at ``timeout_s``; they are killed.
    """
    return spawn_ranks(fn, world_size, *args, timeout_s=timeout_s, backend=backend, **kwargs)
