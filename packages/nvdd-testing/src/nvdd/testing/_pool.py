"""Reused rank worlds for :func:`nvdd.testing.run_ranks`.

Forking ranks and forming a gloo group costs a few tenths of a second per call,
and each fresh rank then imports the test's modules and loads their Warp
kernels again; a suite calls ``run_ranks`` hundreds of times. A *pooled world*
is a set of ranks, forked once from the preloaded forkserver, whose default
process group stays up: each ``run_ranks`` call sends its function to every
rank, which runs it and waits for the next one.

Between calls each rank puts back what a fresh rank would have: the
environment, working directory and ``sys.path``; torch's default dtype,
thread count, grad mode and RNG state (and ``random``'s and NumPy's); the
warning filters. It runs and forgets nvdd's closers (the watchdogs a
``DomainParallel`` or ``init_distributed`` started) and resets TorchDynamo.
A world is retired, and the next call forms a new one, after any rank failed
or timed out, and after a function left the default group destroyed or
replaced. Calls that need a pristine process get fresh ranks instead (see
:func:`use_pool`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import os
import pickle
import random
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from nvdd.core._spawn import _collect, _context, _dumps, _outcome, _resolve, _target

__all__ = ["FRESH_RANKS_ENV", "close_pools", "run_pooled", "use_pool"]

#: Set to ``1`` to give every ``run_ranks`` call fresh ranks (no pooled worlds).
FRESH_RANKS_ENV = "NVDD_FRESH_RANKS"

#: A call with a shorter timeout expects a hang or a collective timeout: fresh ranks.
_MIN_POOLED_TIMEOUT_S = 30.0
#: The collective timeout of a pooled world's group (each call's own deadline
#: still ends it: its ranks are killed at ``timeout_s``).
_POOL_PG_TIMEOUT_S = 600.0
#: At most this many ranks stay alive in pooled worlds (the least recently used
#: world is closed first): idle ranks hold their memory.
_MAX_POOLED_RANKS = 10


def use_pool(world_size: int, backend: str, timeout_s: float, spawn_kwargs: dict[str, Any]) -> bool:
    """Whether a ``run_ranks`` call may run in a pooled world.

    Fresh ranks for: ``NVDD_FRESH_RANKS=1``; a backend other than gloo; a
    ``timeout_s`` under 30 s (the call expects something to hang); any
    ``env``, ``start_method`` or ``threads_per_rank`` other than the default;
    more than 10 ranks.
    """
    if os.environ.get(FRESH_RANKS_ENV) == "1":
        return False
    if backend != "gloo" or timeout_s < _MIN_POOLED_TIMEOUT_S or world_size > _MAX_POOLED_RANKS:
        return False
    if spawn_kwargs.get("env"):
        return False
    if spawn_kwargs.get("start_method", "forkserver") != "forkserver":
        return False
    return bool(spawn_kwargs.get("threads_per_rank", 1) == 1)


# --------------------------------------------------------------------- rank side


class _Baseline:
    """What a fresh rank starts with; put back before every call."""

    def __init__(self) -> None:
        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.rng = torch.get_rng_state()
        self.py_rng = random.getstate()
        self.np_rng: Any = None
        if "numpy" in sys.modules:
            self.np_rng = sys.modules["numpy"].random.get_state()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.filters = list(warnings.filters)

    def restore(self, parent_path: list[str]) -> None:
        import torch

        _close_nvdd_closers()
        if "torch._dynamo" in sys.modules:
            with contextlib.suppress(Exception):
                torch._dynamo.reset()
        os.environ.clear()
        os.environ.update(self.environ)
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        sys.path[:] = self.path + [p for p in parent_path if p not in self.path]
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_grad_enabled(True)
        if torch.are_deterministic_algorithms_enabled() != self.deterministic:
            # (the call itself costs seconds: only when a function changed it)
            torch.use_deterministic_algorithms(self.deterministic)
        torch.set_rng_state(self.rng)
        random.setstate(self.py_rng)
        if self.np_rng is not None:
            sys.modules["numpy"].random.set_state(self.np_rng)
        warnings.filters[:] = self.filters  # type: ignore[index]
        warnings._filters_mutated()  # type: ignore[attr-defined]


def _close_nvdd_closers() -> None:
    """Stop what nvdd registered to run at teardown (watchdogs), keep the group."""
    from nvdd.core import _lifecycle

    with _lifecycle._lock:
        closers = list(reversed(_lifecycle._closers))
        _lifecycle._closers.clear()
    for fn in closers:
        with contextlib.suppress(Exception):
            fn()


def _pool_rank_main(
    rank: int,
    world_size: int,
    rdzv: str,
    tasks: Any,
    results: Any,
    parent_path: list[str],
) -> None:
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    sys.path.extend(p for p in parent_path if p not in sys.path)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend="gloo",
            init_method=f"file://{rdzv}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=_POOL_PG_TIMEOUT_S),
        )
    except BaseException:
        results.put((-1, rank, "err", (traceback.format_exc(), b""), False))
        return
    world = dist.group.WORLD
    baseline = _Baseline()
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn_ref, payload, call_path = task
        data: Any
        baseline.restore(call_path)
        try:
            fn = _resolve(*fn_ref)
            args, kwargs = pickle.loads(payload)
            value = fn(*args, **kwargs)
            status, data = "ok", _dumps(value)
            del value
        except BaseException as exc:
            tb = traceback.format_exc()
            try:
                blob = pickle.dumps(exc)
            except Exception:
                blob = b""
            status, data = "err", (tb, blob)
        intact = dist.is_initialized() and dist.group.WORLD is world
        results.put((task_id, rank, status, data, intact))
        if not intact:
            break
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# ------------------------------------------------------------------- parent side


class _World:
    def __init__(self, world_size: int) -> None:
        ctx = _context("forkserver")
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix="nvdd-pool-")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(  # type: ignore[attr-defined]
                target=_pool_rank_main,
                args=(
                    r,
                    world_size,
                    os.path.join(self.tmp, "rdzv"),
                    self.tasks[r],
                    self.results,
                    list(sys.path),
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def close(self, *, kill: bool) -> None:
        if not kill:
            for q in self.tasks:
                with contextlib.suppress(Exception):
                    q.put(None)
            end = time.monotonic() + 5.0
            for p in self.procs:
                p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                p.kill()
        for p in self.procs:
            if p.pid is not None:
                p.join(timeout=10)
        for q in (*self.tasks, self.results):
            with contextlib.suppress(Exception):
                q.close()
                q.cancel_join_thread()
        shutil.rmtree(self.tmp, ignore_errors=True)


_worlds: OrderedDict[int, _World] = OrderedDict()
_task_ids = itertools.count()


def close_pools() -> None:
    """Close every pooled world (their ranks exit; called at interpreter exit)."""
    while _worlds:
        _, world = _worlds.popitem()
        world.close(kill=False)


atexit.register(close_pools)


def _world(world_size: int) -> _World:
    world = _worlds.pop(world_size, None)
    if world is not None and not all(p.is_alive() for p in world.procs):
        world.close(kill=True)
        world = None
    if world is None:
        while _worlds and sum(w.world_size for w in _worlds.values()) + world_size > (
            _MAX_POOLED_RANKS
        ):
            _, old = _worlds.popitem(last=False)
            old.close(kill=True)
        world = _World(world_size)
    _worlds[world_size] = world  # most recently used last
    return world


def run_pooled(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout_s: float,
) -> list[Any]:
    """``spawn_ranks``' contract, on the pooled world of ``world_size`` ranks."""
    module, file, qualname = _target(fn)
    payload = _dumps((args, kwargs))
    world = _world(world_size)
    task_id = next(_task_ids)
    for q in world.tasks:
        q.put((task_id, (module, file, qualname), payload, list(sys.path)))
    intact = True

    def receive(timeout: float) -> tuple[int, str, Any] | None:
        nonlocal intact
        got_id, rank, status, data, ok = world.results.get(timeout=timeout)
        if got_id not in (task_id, -1):
            return None  # a late answer to a call that was already given up
        intact = intact and ok and got_id == task_id
        return rank, status, data

    values: dict[int, Any] = {}
    errors: dict[int, tuple[str, bytes]] = {}
    try:
        values, errors = _collect(receive, world.procs, world_size, timeout_s)
    finally:
        if errors or not intact or len(values) < world_size:
            _worlds.pop(world_size, None)
            world.close(kill=True)
    return _outcome(values, errors, world_size, timeout_s)
