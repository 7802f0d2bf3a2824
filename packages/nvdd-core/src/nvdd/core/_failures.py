"""Name the rank whose failure ended the job.

When one rank raises (a model error, a full disk), the others usually fail a
moment later in a collective, with an error that names a peer's address, not a
rank (``Connection reset by peer``), or hang. With many ranks printing
tracebacks it is hard to tell the cause from the consequences.

:func:`install_failure_report` (part of :func:`nvdd.core.install_teardown`)
wraps ``sys.excepthook``: after the usual traceback, a rank records its failure
in the process group's store (an ordered counter, the exception type and
message, whether it is a collective failure) and prints one line:

- ``nvdd: rank 1 failed: ValueError: ...`` for a failure of its own;
- ``nvdd: rank 0 failed in a collective because rank 1 failed first: ...``
  when another rank recorded a failure of its own;
- ``nvdd: rank 0 failed in a collective; rank(s) [2] stopped responding ...``
  when no rank recorded one but a watchdog saw ranks go silent (killed,
  crashed in native code).

A rank that was outside any collective when a peer died gets no error of its
own: the launcher stops it with SIGTERM first. Its SIGTERM handler
(``nvdd.core._lifecycle``) prints :func:`termination_note` before it exits:
``nvdd: rank 0 was stopped by SIGTERM after rank 1 failed: ...`` or ``nvdd: rank
0 was stopped by SIGTERM; rank(s) [1] stopped responding ...``. A watchdog that
ends its rank records why (:func:`record_failure`), so the others name it as the
first failure rather than as a rank that went silent.

Layers of nvdd-core's process supervision, each importing only those below it:
this module (failure reports, the bottom) < ``_lifecycle`` (teardown, signals)
< ``_watchdog`` (on top). The report reads the watchdog's liveness through the
:class:`Liveness` protocol, which the watchdog registers (:func:`watch_liveness`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any, Protocol

import torch.distributed as dist

from nvdd.core._errors import CommunicationError

__all__ = [
    "Liveness",
    "failure_note",
    "install_failure_report",
    "record_failure",
    "reporting_failure",
    "termination_note",
    "watch_liveness",
]

#: Seconds a rank whose collective failed waits for the culprit's record.
WAIT_FOR_CAUSE_S = 3.0
_PREFIX = "nvdd/failures/"
_installed = False
_lock = threading.Lock()

#: Set while an uncaught exception is being reported: SIGTERM then only marks the
#: process for exit (it is exiting anyway) instead of cutting the report short
#: (``_lifecycle``'s handler reads it).
reporting_failure = threading.Event()


class Liveness(Protocol):
    """What the report reads of a watchdog (:class:`nvdd.core.Watchdog` is one):
    its publication interval and the ranks' published progress entries."""

    @property
    def interval_s(self) -> float: ...

    def progress(self) -> dict[int, Any]: ...

    def silent_ranks(self, earlier: dict[int, Any] | None = None) -> list[int]: ...


_liveness: list[Liveness] = []  # the last watchdog started, running or not


def watch_liveness(source: Liveness) -> None:
    """Make ``source`` the watchdog the report reads (each watchdog calls it when
    it starts). It stays so after it stopped: an exception that ends a
    ``DomainParallel`` block stops its watchdog before the failure is reported,
    and its store entries still tell which ranks went silent. Local."""
    _liveness[:] = [source]


def _store() -> Any:
    from torch.distributed.distributed_c10d import PrefixStore, _get_default_store

    return PrefixStore(_PREFIX, _get_default_store())


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a collective (a consequence, not a cause)."""
    if isinstance(exc, CommunicationError):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    marker = os.sep.join(("torch", "distributed", ""))
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and marker in last


def _summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:297] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def failure_note(exc: BaseException, *, wait_s: float = WAIT_FOR_CAUSE_S) -> str | None:
    """Record this rank's failure in the store and say which rank caused the job's end.

    Returns the one-line note (None without an initialised process group or a
    reachable store). Reads and writes the store only: no collective.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank = dist.get_rank()
    world = dist.get_world_size()
    consequence = is_collective_failure(exc)
    try:
        store = _store()
        order = int(store.add("count", 1))
        record = {"order": order, "what": _summary(exc), "collective": consequence}
        store.set(str(rank), json.dumps(record))
    except Exception:
        return None
    if not consequence:
        return f"nvdd: rank {rank} failed: {record['what']}"
    watch = _Liveness()
    deadline = time.monotonic() + wait_s
    while True:
        causes = _causes(store, world, rank)
        if causes or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if causes:
        first_rank, first = min(causes.items(), key=lambda kv: kv[1]["order"])
        return (
            f"nvdd: rank {rank} failed in a collective because rank {first_rank} failed first: "
            f"{first['what']}"
        )
    silent = watch.silent()
    if silent:
        return f"nvdd: rank {rank} failed in a collective; {_silent_text(silent)}"
    return (
        f"nvdd: rank {rank} failed in a collective ({record['what']}); no rank reported an "
        "error of its own: see the launcher's report for a rank that died"
    )


def record_failure(what: str) -> None:
    """Record a failure of this rank's own (not a collective's) in the store, as
    the failure report does for an exception: what a watchdog that ends its rank
    leaves for the others. Local; silent when the store is unreachable."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    with contextlib.suppress(Exception):
        store = _store()
        order = int(store.add("count", 1))
        record = {"order": order, "what": what, "collective": False}
        store.set(str(dist.get_rank()), json.dumps(record))


def termination_note() -> str | None:
    """Why another rank made the launcher stop this one, for a SIGTERM that found
    this rank with no failure of its own (None when nothing is known: a plain
    stop, or a world of one).

    Reads the store only (no collective): a failure some rank recorded (it exits
    after recording, and only then does the launcher send SIGTERM), else the
    ranks the last watchdog sees go silent, which takes two of its publication
    intervals (at most 4.1 s).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    if world < 2:
        return None
    rank = dist.get_rank()
    try:
        store = _store()
        watch = _Liveness()
        causes = _causes(store, world, rank)
    except Exception:
        return None
    if causes:
        first_rank, first = min(causes.items(), key=lambda kv: kv[1]["order"])
        return (
            f"nvdd: rank {rank} was stopped by SIGTERM after rank {first_rank} failed: "
            f"{first['what']}"
        )
    silent = watch.silent()
    if silent:
        return f"nvdd: rank {rank} was stopped by SIGTERM; {_silent_text(silent)}"
    return None


def _silent_text(silent: list[int]) -> str:
    return (
        f"rank(s) {silent} stopped responding without reporting an error (killed, out of "
        "memory, or crashed in native code)"
    )


def _causes(store: Any, world: int, me: int) -> dict[int, dict[str, Any]]:
    out = {}
    for r in range(world):
        if r == me or not store.check([str(r)]):
            continue
        rec = json.loads(store.get(str(r)))
        if not rec.get("collective"):
            out[r] = rec
    return out


class _Liveness:
    """Two snapshots of the running watchdog's progress entries, two publication
    intervals apart: the first taken now, the second by :meth:`silent`."""

    def __init__(self) -> None:
        self.wd = _liveness[0] if _liveness else None
        self.t0 = time.monotonic()
        self.first: dict[int, Any] = {}
        if self.wd is not None:
            with contextlib.suppress(Exception):
                self.first = self.wd.progress()

    def silent(self) -> list[int]:
        if self.wd is None or not self.first:
            return []
        time.sleep(max(0.0, 2.0 * self.wd.interval_s + 0.1 - (time.monotonic() - self.t0)))
        with contextlib.suppress(Exception):
            return self.wd.silent_ranks(self.first)
        return []


def install_failure_report() -> None:
    """Wrap ``sys.excepthook`` to print :func:`failure_note` after the traceback (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous(exc_type, exc, tb)
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            return
        # The launcher stops the other ranks with SIGTERM as soon as one fails:
        # let it wait the few seconds it takes to name the culprit.
        reporting_failure.set()
        try:
            note = failure_note(exc)
        except Exception:  # never hide the original error
            note = None
            traceback.print_exc()
        if note:
            sys.stderr.write(note + "\n")
            sys.stderr.flush()

    sys.excepthook = hook
