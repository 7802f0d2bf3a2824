"""Who ends the process group, and how many threads a CPU rank uses.

A process that leaves the interpreter with a live gloo or NCCL process group may
abort in the C++ destructors (``terminate called without an active exception``,
SIGABRT); torchrun then reads a failed worker and kills the others, rank 0
included, possibly while it writes its outputs. :func:`install_teardown` makes
nvdd own the teardown instead: at interpreter exit (normal, after an uncaught
exception, or after SIGTERM / SIGINT) the watchdogs stop and the process group
is destroyed before the interpreter goes away.

Layers of nvdd-core's process supervision, each importing only those below it:
``_failures`` (failure reports) < this module (teardown, signals) < ``_watchdog``
(which registers its ``stop`` here as a closer).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch.distributed as dist

from nvdd.core._failures import install_failure_report, reporting_failure, termination_note

__all__ = ["cpu_threads_per_rank", "install_teardown"]

#: Seconds a rank may take to exit after SIGTERM before it is ended hard.
DEFAULT_EXIT_GRACE_S = 10.0

_lock = threading.Lock()
_atexit_done = False
_signals_done = False
_closers: list[Callable[[], None]] = []
_meshes: weakref.WeakSet[Any] = weakref.WeakSet()


def track_mesh(mesh: Any) -> None:
    """Let the teardown drop ``mesh``'s references to its process groups."""
    with contextlib.suppress(TypeError):
        _meshes.add(mesh)


def register_closer(fn: Callable[[], None]) -> None:
    """Run ``fn`` at teardown, before the process group is destroyed (LIFO)."""
    with _lock:
        _closers.append(fn)


def unregister_closer(fn: Callable[[], None]) -> None:
    """Forget a closer registered with :func:`register_closer` (no error if absent)."""
    with _lock, contextlib.suppress(ValueError):
        _closers.remove(fn)


def teardown() -> None:
    """Stop registered closers, then destroy the default process group (local, idempotent).

    gloo stops its worker threads only when the process group object is freed,
    and a worker that still runs while the interpreter finalises aborts the
    process (it cannot take the GIL any more). So beyond
    ``destroy_process_group``, the references that device meshes built by
    :func:`nvdd.core.make_mesh` hold are dropped, and the objects are collected
    here, while the interpreter is whole.
    """
    with _lock:
        closers = list(reversed(_closers))
        _closers.clear()
    for fn in closers:
        with contextlib.suppress(Exception):
            fn()
    if not (dist.is_available() and dist.is_initialized()):
        return
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    for mesh in list(_meshes):
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
    _meshes.clear()
    gc.collect()


def install_teardown(*, signals: bool = True, grace_s: float = DEFAULT_EXIT_GRACE_S) -> None:
    """Make nvdd destroy the process group when this process ends. Idempotent; local.

    - at interpreter exit (``atexit``; also after an uncaught exception): the
      watchdogs stop, then ``destroy_process_group`` runs, so no gloo or NCCL
      thread outlives the interpreter and aborts the process;
    - with ``signals`` (from the main thread only, and only where the handler
      is still the default): SIGTERM raises ``SystemExit(143)`` in the main
      thread, so ``finally`` blocks, atomic writers and the teardown run; if the
      main thread is stuck in native code and the process has not ended
      ``grace_s`` seconds after the signal, it ends with status 143 regardless.
      SIGINT keeps Python's ``KeyboardInterrupt``, which unwinds the same way;
    - after an uncaught exception, one more line names the rank whose failure
      ended the job (see ``nvdd.core._failures``).

    :func:`nvdd.core.init_distributed` calls it; so does ``DomainParallel``.
    """
    global _atexit_done
    with _lock:
        if not _atexit_done:
            atexit.register(teardown)
            _atexit_done = True
    install_failure_report()
    if signals:
        _install_signal_handlers(grace_s)


def _install_signal_handlers(grace_s: float) -> None:
    global _signals_done
    if _signals_done or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # somebody else handles SIGTERM: leave it to them
    signal.signal(signal.SIGTERM, _on_sigterm)
    _signals_done = True
    _start_grace_watcher(grace_s)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # A process that is already failing (an exception unwinds through ``finally``
    # and ``__exit__`` blocks, or is being reported) ends by itself in a moment;
    # replacing its exception with SystemExit would hide the cause. The grace
    # watcher still ends it if it does not.
    if reporting_failure.is_set() or sys.exc_info()[1] is not None:
        return
    # Nothing failed here: the launcher may be stopping this rank because another
    # one died. Say which (a few seconds at most, within the grace) before exiting;
    # a second SIGTERM meanwhile does not cut the note short.
    reporting_failure.set()
    try:
        note = termination_note()
    except Exception:  # never block the exit
        note = None
    if note:
        with contextlib.suppress(Exception):
            sys.stderr.write(note + "\n")
            sys.stderr.flush()
    raise SystemExit(128 + signum)


def _start_grace_watcher(grace_s: float) -> None:
    """A thread that ends the process ``grace_s`` after SIGTERM, even when the main
    thread is blocked in native code (where Python signal handlers cannot run).

    It learns about the signal through ``signal.set_wakeup_fd``, which the
    interpreter writes to from its C-level handler; skipped when another
    component already owns the wakeup fd (an asyncio loop, say).
    """
    if not grace_s > 0:
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):  # pragma: no cover - not the main thread / unsupported
        os.close(r)
        os.close(w)
        return
    if previous != -1:  # someone else's: give it back
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
        return

    def watch() -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:  # pragma: no cover - pipe closed
                return
            if not data:  # pragma: no cover
                return
            if signal.SIGTERM in data:
                time.sleep(grace_s)
                with contextlib.suppress(Exception):
                    sys.stderr.write(
                        f"nvdd: rank {os.environ.get('RANK', '?')} did not exit within "
                        f"{grace_s:g} s of SIGTERM (stuck in native code); ending it\n"
                    )
                    sys.stderr.flush()
                os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="nvdd-sigterm-grace", daemon=True).start()


def cpu_threads_per_rank(local_world_size: int | None = None) -> int:
    """Intra-op threads for one CPU rank: the cores this process may use, shared
    evenly by the ranks of this node (at least 1).

    ``local_world_size`` defaults to ``LOCAL_WORLD_SIZE`` from the launcher's
    environment, else ``WORLD_SIZE``, else 1. Cores: the CPU affinity of this
    process where the platform reports it, else ``os.cpu_count()``.
    """
    if local_world_size is None:
        for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
            value = os.environ.get(name, "")
            if value.isdigit() and int(value) > 0:
                local_world_size = int(value)
                break
        else:
            local_world_size = 1
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        cores = os.cpu_count() or 1
    return max(1, cores // local_world_size)
