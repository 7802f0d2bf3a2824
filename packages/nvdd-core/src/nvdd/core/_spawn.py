"""Run a function on N fresh ranks over gloo (or NCCL) with a file rendezvous.

Used by ``nvdd.testing.run_ranks`` (for the calls that need fresh ranks; the
others reuse pooled worlds, decision 0076) and by tools that validate a model on
a few CPU ranks from one process (``trace_and_validate``).

Ranks are forked from a forkserver that has torch (and, when installed, warp)
preloaded, so a rank starts in tens of milliseconds instead of re-importing
torch; each call gets fresh processes and a fresh process group.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import io
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from functools import cache
from multiprocessing.context import BaseContext
from typing import Any, TypeVar

from nvdd.core._errors import NvddError

__all__ = ["RankFailedError", "RankTimeoutError", "spawn_ranks"]

T = TypeVar("T")

#: Seconds the other ranks get to report their own errors after one rank failed.
_GRACE_S = 3.0


class RankFailedError(NvddError, RuntimeError):
    """A rank raised; carries its rank, traceback text and (if picklable) exception.

    Attributes
    ----------
    rank:
        The rank whose failure arrived first (usually the root cause: the others
        often fail only because a peer left a collective).
    exception:
        That rank's exception object, or None if it could not be pickled.
    tracebacks:
        ``{rank: traceback text}`` for every rank that failed, in arrival order.
    """

    def __init__(self, tracebacks: dict[int, str], exception: BaseException | None) -> None:
        self.tracebacks = dict(tracebacks)
        self.rank = next(iter(self.tracebacks))
        self.exception = exception
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in self.tracebacks.items()]
        super().__init__(f"rank(s) {list(self.tracebacks)} failed:\n" + "\n".join(parts))


class RankTimeoutError(NvddError, TimeoutError):
    """Some ranks did not finish within the timeout; they were killed."""


#: Environment variable naming extra modules the rank forkserver imports once.
PRELOAD_ENV = "NVDD_SPAWN_PRELOAD"


def _load_script_module(blob: bytes) -> Any:
    import torch

    return torch.jit.load(io.BytesIO(blob))  # type: ignore[no-untyped-call]


class _Pickler(pickle.Pickler):
    """Pickles TorchScript modules too (``torch.jit.save`` bytes): plain pickle
    refuses them, and models hold them (a scripted layer, e3nn's kernels)."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.jit.ScriptModule):
            buf = io.BytesIO()
            torch.jit.save(obj, buf)
            return _load_script_module, (buf.getvalue(),)
        return NotImplemented


def _dumps(value: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf).dump(value)
    return buf.getvalue()


@cache
def _context(start_method: str) -> BaseContext:
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        preload = ["torch", "torch.distributed"]
        if importlib.util.find_spec("warp") is not None:
            preload.append("warp")
        # Slow-to-import modules a test suite's ranks all need (comma-separated):
        # imported once by the forkserver instead of once per rank.
        extra = os.environ.get(PRELOAD_ENV, "")
        preload += [m.strip() for m in extra.split(",") if m.strip()]
        ctx.set_forkserver_preload(preload)
    return ctx


def _resolve(module: str, file: str | None, qualname: str) -> Callable[..., Any]:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        if file is None:
            raise
        sys.path.insert(0, os.path.dirname(file))
        mod = importlib.import_module(module)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _wait_for_peers(rdzv: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Return once every rank has come back from ``init_process_group``.

    A count in a file store beside the rendezvous, not a collective (so it shows in
    no collective count). Without it a rank whose function needs no collective can
    finish and close its sockets while a peer is still inside gloo's full-mesh
    connect, which then fails with "Connection closed by peer".
    """
    if world_size == 1:
        return
    from torch.distributed import FileStore  # type: ignore[attr-defined]

    store = FileStore(f"{rdzv}.joined", world_size)
    store.set(f"rank{rank}", "1")
    store.wait([f"rank{r}" for r in range(world_size)], datetime.timedelta(seconds=timeout_s))


def _rank_main(
    rank: int,
    world_size: int,
    rdzv: str,
    backend: str,
    timeout_s: float,
    fn_ref: tuple[str, str | None, str],
    payload: bytes,
    results: Any,
    env: dict[str, str],
    threads: int | None,
    parent_path: list[str],
) -> None:
    os.environ.update(env)
    # The parent's import path (test directories pytest added, say), so pickled
    # arguments whose classes live there can be unpickled here.
    sys.path.extend(p for p in parent_path if p not in sys.path)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    import torch
    import torch.distributed as dist

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend=backend,
            init_method=f"file://{rdzv}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch.device("cuda", rank) if backend == "nccl" else None,
        )
        _wait_for_peers(rdzv, rank, world_size, timeout_s)
        fn = _resolve(*fn_ref)
        args, kwargs = pickle.loads(payload)
        value = fn(*args, **kwargs)
        results.put((rank, "ok", _dumps(value)))
    except BaseException as exc:
        tb = traceback.format_exc()
        try:
            blob = pickle.dumps(exc)
        except Exception:
            blob = b""
        results.put((rank, "err", (tb, blob)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    backend: str = "gloo",
    start_method: str = "forkserver",
    env: dict[str, str] | None = None,
    threads_per_rank: int | None = 1,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; return the results.

    Each rank has the default process group initialised (``backend``, file
    rendezvous in a private temporary directory, ``timeout_s`` as the collective
    timeout) and ``torch.set_num_threads(threads_per_rank)`` (unless None); ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK`` are set as torchrun would. ``fn`` must be importable by module
    and qualified name (a module-level function); arguments and results are
    pickled (TorchScript modules among them through ``torch.jit.save``).

    Returns
    -------
    list
        ``fn``'s return value on every rank, indexed by rank.

    Raises
    ------
    RankFailedError
        If any rank raised: the message holds every failing rank's traceback; the
        other ranks are killed after a short grace period.
    RankTimeoutError
        If some rank had not finished after ``timeout_s`` seconds; every rank
        still alive is killed first.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    module, file, qualname = _target(fn)
    payload = _dumps((args, kwargs))
    ctx = _context(start_method)
    tmp = tempfile.mkdtemp(prefix="nvdd-ranks-")
    results = ctx.Queue()
    procs = [
        ctx.Process(  # type: ignore[attr-defined]
            target=_rank_main,
            args=(
                r,
                world_size,
                os.path.join(tmp, "rdzv"),
                backend,
                timeout_s,
                (module, file, qualname),
                payload,
                results,
                dict(env or {}),
                threads_per_rank,
                list(sys.path),
            ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    values: dict[int, Any] = {}
    errors: dict[int, tuple[str, bytes]] = {}
    try:
        for p in procs:
            p.start()

        def receive(timeout: float) -> tuple[int, str, Any]:
            rank, status, data = results.get(timeout=timeout)
            return rank, status, data

        values, errors = _collect(receive, procs, world_size, timeout_s)
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive() and (errors or len(values) < world_size):
                p.kill()
        for p in procs:
            if p.pid is None:  # never started (start() itself failed)
                continue
            p.join(timeout=10)
            if p.is_alive():  # pragma: no cover - last resort
                p.kill()
                p.join(timeout=5)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return _outcome(values, errors, world_size, timeout_s)


def _target(fn: Callable[..., Any]) -> tuple[str, str | None, str]:
    """``fn``'s module, file and qualified name, as a rank resolves it."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if module is None or qualname is None or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"spawn_ranks needs a module-level function, got {fn!r}")
    return module, getattr(sys.modules.get(module), "__file__", None), qualname


def _collect(
    receive: Callable[[float], tuple[int, str, Any] | None],
    procs: Sequence[Any],
    world_size: int,
    timeout_s: float,
) -> tuple[dict[int, Any], dict[int, tuple[str, bytes]]]:
    """Gather every rank's ``(rank, status, data)`` report until all ranks have
    answered, ``timeout_s`` has passed, or a short grace period after the first
    error. ``receive(timeout)`` raises ``queue.Empty`` when nothing came and may
    return None for a message to ignore. A rank whose process died without
    reporting counts as an error. Returns (pickled values, errors) by rank."""
    values: dict[int, Any] = {}
    errors: dict[int, tuple[str, bytes]] = {}
    deadline = time.monotonic() + timeout_s
    first_error_at: float | None = None
    dead_since: dict[int, float] = {}
    while len(values) + len(errors) < world_size:
        now = time.monotonic()
        if now > deadline:
            break
        if first_error_at is not None and now > first_error_at + _GRACE_S:
            break
        try:
            got = receive(0.05)
        except queue.Empty:
            # A rank that died without reporting (segfault, os._exit) is an error,
            # once its result had time to arrive through the queue.
            for r, p in enumerate(procs):
                if r in values or r in errors or p.is_alive():
                    continue
                dead_since.setdefault(r, now)
                if now - dead_since[r] > 1.0:
                    errors[r] = (
                        f"rank {r} exited with code {p.exitcode} without reporting a result",
                        b"",
                    )
                    first_error_at = first_error_at or now
            continue
        if got is None:
            continue
        rank, status, data = got
        if status == "ok":
            values[rank] = data
        else:
            errors[rank] = data
            first_error_at = first_error_at or time.monotonic()
    return values, errors


def _outcome(
    values: dict[int, Any], errors: dict[int, tuple[str, bytes]], world_size: int, timeout_s: float
) -> list[Any]:
    """Every rank's unpickled value in rank order, or the first failure raised."""
    if errors:
        first = next(iter(errors))
        exc: BaseException | None = None
        if errors[first][1]:
            try:
                exc = pickle.loads(errors[first][1])
            except Exception:
                exc = None
        raise RankFailedError({r: tb for r, (tb, _) in errors.items()}, exc)
    if len(values) < world_size:
        missing = [r for r in range(world_size) if r not in values]
        raise RankTimeoutError(
            f"rank(s) {missing} of {world_size} did not finish within {timeout_s} s; killed"
        )
    return [pickle.loads(values[r]) for r in range(world_size)]
