"""How an ``nvdd run`` job ends when it is stopped, or when its launcher dies.

Three processes deep: the ``nvdd`` launcher, torchrun (run through this module,
``python -m nvalchemi.distributed._stop ...``), and the ranks.

- **Tied to the parent.** torchrun and every rank ask the kernel for SIGTERM
  when their parent dies (Linux ``PR_SET_PDEATHSIG``), and give up at once if
  the parent is already gone. So a launcher killed by SIGKILL takes torchrun
  with it, torchrun stops its ranks, and a rank whose torchrun died hard stops
  too: nothing of the job runs on unsupervised.
- **A user's stop.** The launcher writes the signal's name into the file
  ``$NVDD_STOP_NOTE`` before it forwards SIGTERM or SIGINT to torchrun. A rank
  that gets SIGINT (Ctrl-C), or SIGTERM with that note, raises
  :class:`JobStopped` in its main thread; the job's code catches it (or a
  collective error that follows a peer's exit) and ends with one line and
  status ``128 + signal``. Any other SIGTERM (the launcher ending the job after
  a rank failed) keeps ``nvdd.core``'s behaviour: a note naming the failed
  rank, status 143.
- **A finished rank ends at once.** Once its job is done, its process group
  destroyed and its outputs closed, a rank of the ``nvdd`` command
  (``cli.console``) runs its exit handlers, flushes its
  streams and ends with ``os._exit``: the interpreter's finalisation, during
  which a daemon thread caught inside a native call aborts the process, is
  skipped (record 0091).
- **Quiet torchrun.** torchrun's own stop messages (its warnings and the
  traceback of its ``SignalException``) are left out; it exits ``128 + signal``.
  A signal torchrun gets (the launcher's death included) is noted as a stop,
  like the launcher's.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

__all__ = [
    "PARENT_ENV",
    "STOP_NOTE_ENV",
    "JobStopped",
    "die_with_parent",
    "end_finished_rank",
    "install_stop_handlers",
    "stop_signal",
    "torchrun_main",
]

#: The file the launcher writes the stop signal's name into.
STOP_NOTE_ENV = "NVDD_STOP_NOTE"
#: The pid a process of the job expects as its parent (set for torchrun by the
#: launcher, for the ranks by torchrun).
PARENT_ENV = "NVDD_PARENT_PID"

_PR_SET_PDEATHSIG = 1


class JobStopped(BaseException):
    """Raised in a rank's main thread by a user's SIGTERM or SIGINT.

    A ``BaseException``, as ``KeyboardInterrupt`` is: ``except Exception`` in a
    hook does not swallow it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def die_with_parent(expected_parent: int | str | None = None) -> bool:
    """Ask for SIGTERM when this process's parent dies (Linux; a no-op elsewhere).

    Returns False when the parent is already gone (``expected_parent`` is not
    the parent any more): the caller should end now.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if expected_parent in (None, ""):
        return True
    return os.getppid() == int(expected_parent)


def write_stop_note(path: str | None, signum: int) -> None:
    """The launcher's side: record that the user stopped the job (local)."""
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(signal.Signals(signum).name)


class _State:
    signum: int | None = None
    previous: dict[int, Any] = {}  # noqa: RUF012 - one per process


_state = _State()


def _noted_signal() -> int | None:
    note = os.environ.get(STOP_NOTE_ENV)
    if note:
        with contextlib.suppress(OSError, KeyError):
            return int(signal.Signals[Path(note).read_text().strip()])
    return None


def stop_signal() -> int | None:
    """The signal of a user's stop of this job, or None.

    Also known to a rank whose collective failed because a peer left after such
    a stop before its own signal arrived: the launcher's note says so.
    """
    return _state.signum if _state.signum is not None else _noted_signal()


def _on_stop(signum: int, frame: FrameType | None) -> None:
    if _state.signum is not None:
        return  # already stopping: a second signal does not cut the stop short
    if signum == signal.SIGINT or _noted_signal() is not None:
        _state.signum = signum
        raise JobStopped(signum)
    # A SIGTERM nobody noted: the launcher ends the job after a rank failed (or
    # died with the launcher). nvdd.core's handler names the failed rank.
    previous = _state.previous.get(signum)
    if callable(previous):
        previous(signum, frame)
    raise SystemExit(128 + signum)


def install_stop_handlers() -> None:
    """SIGINT, and SIGTERM after the launcher noted a user's stop, raise
    :class:`JobStopped` in the main thread; any other SIGTERM goes to the handler
    installed before (``nvdd.core``'s, after :func:`nvdd.core.init_distributed`,
    whose watcher also ends a rank stuck in native code). Local; main thread only.
    """
    for s in (signal.SIGTERM, signal.SIGINT):
        _state.previous[s] = signal.signal(s, _on_stop)


def end_finished_rank(status: int) -> NoReturn:
    """End this process now with ``status``: exit handlers first, streams flushed. Local.

    For a rank of ``nvdd run`` whose job is done: its process group destroyed
    (:func:`nvdd.core.shutdown_distributed`) and its outputs closed. The
    ``atexit`` handlers run as at a normal exit (a second teardown is a no-op),
    ``sys.stdout`` and ``sys.stderr`` are flushed, and the process ends with
    ``os._exit``, skipping the interpreter's finalisation and native static
    destructors. That is where a finished rank could still abort ("terminate
    called without an active exception", SIGABRT): a daemon thread inside a
    native call that releases the GIL (a store write, a tensor operation) is
    ended by the finalising interpreter when it takes the GIL back, from a
    C++ frame that may not unwind, and torchrun then counts a failed worker
    for a job that finished (record 0091). Non-daemon threads are not waited
    for; a rank of ``nvdd run`` starts none.
    """
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


class _QuietStop(logging.Filter):
    """Drops torchrun's 'death signal' / 'closing signal' warnings of a stop.

    torchrun logs 'Received <signal> death signal' before it signals the ranks:
    a signal from outside (the launcher, or its death through
    ``PR_SET_PDEATHSIG``) is a stop of the whole job, so it is noted first, as
    the launcher does (without that note a rank takes ``nvdd.core``'s slower
    path, which looks for a failed rank first).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if "death signal" in msg and isinstance(record.args, tuple) and record.args:
            with contextlib.suppress(Exception):
                if _noted_signal() is None:
                    sig: Any = record.args[0]
                    write_stop_note(os.environ.get(STOP_NOTE_ENV), int(sig))
        return "death signal" not in msg and "closing signal" not in msg


def torchrun_main(argv: Sequence[str]) -> int:
    """torchrun (``torch.distributed.run``), tied to its launcher, quiet when stopped."""
    if not die_with_parent(os.environ.get(PARENT_ENV)):
        return 128 + signal.SIGTERM  # the launcher is gone already
    os.environ[PARENT_ENV] = str(os.getpid())  # the ranks' parent
    for name in (
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.multiprocessing.api",
    ):
        logging.getLogger(name).addFilter(_QuietStop())
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    try:
        main(list(argv))
    except SignalException as exc:
        sigval: Any = exc.sigval
        return 128 + int(sigval)
    finally:  # the ranks are gone: the note (written here if the launcher died) too
        with contextlib.suppress(OSError, TypeError):
            os.unlink(os.environ.get(STOP_NOTE_ENV, ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(torchrun_main(sys.argv[1:]))
