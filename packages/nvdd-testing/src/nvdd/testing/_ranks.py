"""`run_ranks`: the test entry point to ``nvdd.core.spawn_ranks``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from nvdd.core import RankFailedError, RankTimeoutError, spawn_ranks
from nvdd.testing._pool import run_pooled, use_pool

__all__ = ["RankFailedError", "RankTimeoutError", "run_ranks"]

T = TypeVar("T")

#: ``spawn_ranks`` keywords that are not ``fn``'s.
_SPAWN_ONLY = ("env", "start_method", "threads_per_rank")


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    backend: str = "gloo",
    fresh: bool = False,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` CPU ranks over gloo.

    Ranks are forked from a forkserver with torch (and warp) preloaded and get
    one intra-op thread each (see :func:`nvdd.core.spawn_ranks`). By default the
    call runs in a *pooled world* of ``world_size`` ranks that earlier calls
    formed: its group is already up and its ranks have put back the state a
    fresh rank starts with (environment, working directory, torch's dtype,
    threads, grad mode and RNG, warning filters; nvdd's watchdogs stopped).
    A world is retired after any failure or timeout, or when ``fn`` destroyed
    the default group. Fresh ranks (a new file rendezvous, ``timeout_s`` as
    the collective timeout) are used instead with ``fresh=True``, with
    ``NVDD_FRESH_RANKS=1``, a ``timeout_s`` under 30 s, a backend other than
    gloo, or any of ``spawn_ranks``' ``env``, ``start_method`` or
    ``threads_per_rank`` given: tests that set environment variables for
    their ranks, initialise their own group, or expect a hang.

    Raises
    ------
    RankFailedError
        With every failing rank's traceback (the first to arrive is the cause).
    RankTimeoutError
        When ranks were still running at ``timeout_s``; they are killed.
    """
    if not fresh and use_pool(world_size, backend, timeout_s, kwargs):
        fn_kwargs = {k: v for k, v in kwargs.items() if k not in _SPAWN_ONLY}
        return run_pooled(fn, world_size, args, fn_kwargs, timeout_s)
    return spawn_ranks(fn, world_size, *args, timeout_s=timeout_s, backend=backend, **kwargs)
