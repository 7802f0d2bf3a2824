"""`Watchdog`: name the rank that holds everybody up, well before the collective timeout.

When one rank stops (a deadlock, an endless loop, a frozen process, a node that
went away), every other rank waits in its next collective until the process
group's timeout (600 s by default), and nobody says who stopped. A
:class:`Watchdog` runs one background thread per rank that

- publishes this rank's progress (a counter and a label set by :meth:`beat`,
  how long ago that was, a heartbeat pulse and where the main thread is) to the
  process group's key-value store every few seconds;
- when this rank has made no progress for ``timeout_s``, reads every rank's
  entry, names the ranks that are behind (fewer beats), not responding (no
  heartbeat: frozen, dead or stuck in native code) or missing, prints that on
  stderr and ends the process, so the launcher (torchrun) tears the job down.

It works on any backend (gloo, NCCL): only the store is used, never a
collective. Beats are cheap (no I/O: a counter, a clock read).

Layers of nvdd-core's process supervision, each importing only those below it:
``_failures`` (failure reports) < ``_lifecycle`` (teardown, signals) < this
module (on top): a watchdog registers its ``stop`` with the teardown, itself with
the failure report (``watch_liveness``), and records why it ended its rank.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from nvdd.core._errors import ConfigurationError
from nvdd.core._failures import record_failure, watch_liveness
from nvdd.core._lifecycle import register_closer, unregister_closer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import Store

__all__ = ["DEFAULT_WATCHDOG_S", "WATCHDOG_ENV", "WATCHDOG_EXIT_CODE", "RankProgress", "Watchdog"]

#: Default seconds without progress before the watchdog reports.
DEFAULT_WATCHDOG_S = 120.0
#: Environment variable overriding the default timeout (seconds; 0 disables).
WATCHDOG_ENV = "NVDD_WATCHDOG_S"
#: Exit status of a process ended by its watchdog.
WATCHDOG_EXIT_CODE = 75

_generation = itertools.count()


class StepBeat:
    """Progress a loop records without calling the watchdog (a step beats at
    every hook stage: fields are cheaper than calls). The loop sets, in this
    order, ``step``, ``stage`` (a label), ``count += 1`` and last ``at =
    time.monotonic()``; the :class:`Watchdog` that holds it (``step_beat``)
    reads that as a :meth:`Watchdog.beat` labelled ``"step {step} {stage}"``
    (allowance: the timeout) whenever it is newer than the last ``beat``."""

    __slots__ = ("at", "count", "stage", "step")

    def __init__(self) -> None:
        self.at = -math.inf
        self.count = 0
        self.step = 0
        self.stage = ""


_current: list[Watchdog] = []
_LIBRARY_DIRS = (os.sep + "torch" + os.sep, os.sep + "threading.py")


@dataclass(frozen=True)
class RankProgress:
    """One rank's published progress.

    Attributes
    ----------
    rank:
        Global rank.
    beats:
        Calls of :meth:`Watchdog.beat` so far.
    label:
        The label of the last beat.
    idle_s:
        Seconds since the last beat, as of the publication.
    pulse:
        Publication counter (advances every interval while the process is alive).
    where:
        The main thread's innermost frames, ``"function (file:line)"``.
    finished:
        The rank stopped its watchdog (its part of the job is over).
    in_collective:
        The main thread was inside ``torch.distributed`` (waiting in a collective).
    """

    rank: int
    beats: int
    label: str
    idle_s: float
    pulse: int
    where: str
    finished: bool = False
    in_collective: bool = False


def resolve_timeout(timeout_s: float | None) -> float:
    """``timeout_s``, else ``$NVDD_WATCHDOG_S``, else :data:`DEFAULT_WATCHDOG_S`;
    0 (or less) means disabled (returned as 0.0)."""
    if timeout_s is None:
        raw = os.environ.get(WATCHDOG_ENV, "").strip()
        if raw:
            try:
                timeout_s = float(raw)
            except ValueError as exc:
                raise ConfigurationError(
                    f"{WATCHDOG_ENV}={raw!r} is not a number of seconds"
                ) from exc
        else:
            timeout_s = DEFAULT_WATCHDOG_S
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise ConfigurationError(f"watchdog timeout must be seconds, got {timeout_s!r}")
    if math.isnan(timeout_s):
        raise ConfigurationError("watchdog timeout is NaN")
    return max(0.0, float(timeout_s))


def _main_thread_where() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "?"
    inner = (
        f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"
    )
    f: Any = frame
    while f is not None and any(d in f.f_code.co_filename for d in _LIBRARY_DIRS):
        f = f.f_back
    if f is None or f is frame:
        return inner
    return f"{inner} <- {f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}:{f.f_lineno})"


def _main_thread_in_collective() -> bool:
    f: Any = sys._current_frames().get(threading.main_thread().ident or -1)
    marker = os.sep.join(("torch", "distributed", ""))
    while f is not None:
        if marker in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


class Watchdog:
    """Names the silent rank(s) when this rank makes no progress for ``timeout_s``.

    Every rank of ``group`` creates one (in the same order: entries are keyed by
    a per-process creation counter), calls :meth:`start`, then :meth:`beat` at
    every phase of its work, and :meth:`stop` at the end.
    ``DomainParallel`` does all of this itself, beating at every hook stage of
    every step.

    Parameters
    ----------
    timeout_s:
        Seconds without a beat before the report; default ``$NVDD_WATCHDOG_S``
        or :data:`DEFAULT_WATCHDOG_S` (120). 0 disables the watchdog.
    group:
        The ranks to watch (default: the world).
    on_timeout:
        Called with the report before the process ends (default: write it to
        stderr). The process then ends with :data:`WATCHDOG_EXIT_CODE`.
    store:
        The key-value store to publish to (default: the default process group's).
    """

    def __init__(
        self,
        timeout_s: float | None = None,
        *,
        group: ProcessGroup | None = None,
        on_timeout: Callable[[str], None] | None = None,
        store: Store | None = None,
    ) -> None:
        self.timeout_s = resolve_timeout(timeout_s)
        self._group = group
        self._on_timeout = on_timeout
        self._store = store
        self._gen = next(_generation)
        self._own_beats = 0
        self._own_label = "started"
        self._own_last = time.monotonic()
        self._own_allow = self.timeout_s
        #: Progress a step writes inline (see :class:`StepBeat`), read as a beat.
        self.step_beat = StepBeat()
        self._pulse = 0
        self._stopped = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ranks: list[int] = []
        self._rank = 0
        self._kv: Any = None

    # --------------------------------------------------------------- control
    @property
    def enabled(self) -> bool:
        """False when the timeout is 0 or there is no group of two or more ranks."""
        return (
            self.timeout_s > 0
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self._group) > 1
        )

    @property
    def running(self) -> bool:
        """Whether the background thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def interval_s(self) -> float:
        """Seconds between publications: a tenth of the timeout, within [0.05, 2]."""
        return min(2.0, max(0.05, self.timeout_s / 10.0))

    @classmethod
    def current(cls) -> Watchdog | None:
        """The most recently started watchdog of this process still running (or None):
        what a library layer beats without being handed the watchdog."""
        return _current[-1] if _current else None

    def start(self) -> Watchdog:
        """Publish this rank's first entry and start the thread (local; idempotent).

        A no-op when not :attr:`enabled`. Returns ``self``.
        """
        if self._thread is not None or not self.enabled:
            return self
        store = self._store if self._store is not None else _default_store()
        from torch.distributed.distributed_c10d import PrefixStore

        self._kv = PrefixStore(f"nvdd/watchdog/{self._gen}/", store)
        self._rank = dist.get_rank()
        self._ranks = (
            dist.get_process_group_ranks(self._group)
            if self._group
            else list(range(dist.get_world_size()))
        )
        self._own_last = time.monotonic()
        self._publish()
        self._thread = threading.Thread(
            target=self._run, name=f"nvdd-watchdog-{self._rank}", daemon=True
        )
        self._thread.start()
        _current.append(self)
        watch_liveness(self)
        register_closer(self.stop)
        return self

    def stop(self) -> None:
        """Stop the thread and publish that this rank finished (local; idempotent)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
            self._own_label, self._stopped = f"finished after {self._label!r}", True
            self._own_last = max(self._own_last, self.step_beat.at)
            with contextlib.suppress(Exception):
                self._publish()
        with contextlib.suppress(ValueError):
            _current.remove(self)
        unregister_closer(self.stop)

    def beat(self, label: str, *, allow_s: float | None = None) -> None:
        """Record progress: this rank reached ``label``.

        ``allow_s`` (default the timeout) is how long this rank may take to the
        next beat, for a phase known to be long (a first compiled forward).
        Cheap: no I/O, no collective.
        """
        self._own_beats += 1
        self._own_label = label
        self._own_allow = self.timeout_s if allow_s is None else max(self.timeout_s, float(allow_s))
        self._own_last = time.monotonic()

    # the newer of the last beat() and the step's inline beat (StepBeat)
    @property
    def _last(self) -> float:
        return max(self._own_last, self.step_beat.at)

    @property
    def _allow(self) -> float:
        return self.timeout_s if self.step_beat.at > self._own_last else self._own_allow

    @property
    def _label(self) -> str:
        b = self.step_beat
        return f"step {b.step} {b.stage}" if b.at > self._own_last else self._own_label

    @property
    def _beats(self) -> int:
        return self._own_beats + self.step_beat.count

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (
            f"Watchdog(timeout_s={self.timeout_s:g}, beats={self._beats}, "
            f"label={self._label!r}, running={self.running})"
        )

    # ------------------------------------------------------------ the thread
    def _entry(self) -> str:
        return json.dumps(
            {
                "beats": self._beats,
                "label": self._label,
                "idle_s": round(time.monotonic() - self._last, 3),
                "pulse": self._pulse,
                "where": _main_thread_where(),
                "finished": self._stopped,
                "in_collective": _main_thread_in_collective(),
            }
        )

    def _publish(self) -> None:
        self._pulse += 1
        self._kv.set(str(self._rank), self._entry())

    def progress(self) -> dict[int, RankProgress]:
        """Every watched rank's last published entry (ranks without one are left out).

        Reads the store only (no collective); valid after :meth:`start`.
        """
        if self._kv is None:
            return {}
        keys = [str(r) for r in self._ranks]
        out: dict[int, RankProgress] = {}
        for r, key in zip(self._ranks, keys, strict=True):
            if not self._kv.check([key]):
                continue
            data = json.loads(self._kv.get(key))
            out[r] = RankProgress(
                rank=r,
                beats=int(data["beats"]),
                label=str(data["label"]),
                idle_s=float(data["idle_s"]),
                pulse=int(data["pulse"]),
                where=str(data["where"]),
                finished=bool(data.get("finished", False)),
                in_collective=bool(data.get("in_collective", False)),
            )
        return out

    def silent_ranks(self, earlier: dict[int, RankProgress] | None = None) -> list[int]:
        """Ranks (other than this one) that stopped publishing: no entry, or a pulse
        that did not advance since ``earlier`` (a :meth:`progress` snapshot taken at
        least two intervals before), and not finished.

        Without ``earlier``, takes one and waits two intervals (blocks that long).
        """
        if self._kv is None:
            return []
        first = earlier
        if first is None:
            first = self.progress()
            time.sleep(2.0 * self.interval_s + 0.1)
        second = self.progress()
        out = []
        for r in self._ranks:
            if r == self._rank:
                continue
            p = second.get(r)
            if p is None or (not p.finished and r in first and first[r].pulse == p.pulse):
                out.append(r)
        return out

    def _run(self) -> None:
        first: dict[int, RankProgress] | None = None
        first_at = 0.0
        while not self._stop.is_set():
            idle = time.monotonic() - self._last
            deadline = self._allow
            wait = min(self.interval_s, max(0.01, deadline - idle))
            if self._stop.wait(wait):
                return
            with contextlib.suppress(Exception):  # the store may be gone with its host
                self._publish()
            idle = time.monotonic() - self._last
            if idle < deadline - 3 * self.interval_s:
                first = None
                continue
            if first is None:
                first, first_at = self._safe_progress(), time.monotonic()
            if idle >= deadline:
                # Peers publish every interval: two snapshots at least two intervals
                # apart tell a live peer (pulse advanced) from a frozen one.
                gap = 2.0 * self.interval_s - (time.monotonic() - first_at)
                if gap > 0 and self._stop.wait(gap):
                    return
                idle = time.monotonic() - self._last
                if idle < self._allow or self._alone_and_busy():
                    first = None  # progress meanwhile, or nobody waits for this rank
                    continue
                self._fire(idle, first)
                return

    def _alone_and_busy(self) -> bool:
        """Every other rank finished and this rank is not in a collective: it works
        on its own (rank 0 writing its outputs), which nobody waits for."""
        others = [p for r, p in self._safe_progress().items() if r != self._rank]
        if len(others) < len(self._ranks) - 1 or not all(p.finished for p in others):
            return False
        return not _main_thread_in_collective()

    def _safe_progress(self) -> dict[int, RankProgress]:
        try:
            return self.progress()
        except Exception:
            return {}

    def _fire(self, idle: float, first: dict[int, RankProgress]) -> None:
        reachable = False
        try:
            second = self.progress()
            reachable = True
            message = self.report(idle, first, second)
        except Exception as exc:  # the store is unreachable: still say what we know
            message = (
                f"nvdd watchdog: rank {self._rank} made no progress for {idle:.1f} s "
                f"(timeout {self.timeout_s:g} s) at {self._label!r}; the process group's "
                f"store is unreachable ({type(exc).__name__}: {exc}), so the rank that hosts "
                "it (rank 0 without torchrun) or the launcher may be gone"
            )
        if reachable:  # the others, stopped by the launcher, name this as the cause
            silent = self.holding_up(first, second)
            record_failure(
                f"nvdd watchdog: no progress for {idle:.1f} s at {self._label!r}"
                + (f"; silent rank(s): {silent}" if silent else "")
            )
        try:
            if self._on_timeout is not None:
                self._on_timeout(message)
            else:
                sys.stderr.write(message + "\n")
                sys.stderr.flush()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            os._exit(WATCHDOG_EXIT_CODE)

    def holding_up(
        self, first: dict[int, RankProgress], second: dict[int, RankProgress]
    ) -> list[int]:
        """The ranks :meth:`report` names as holding the job up (missing, not
        responding, behind, or stuck outside the collective the others wait in)."""
        missing, frozen, behind, stuck, _, _ = self._classify(first, second)
        return sorted(set(missing) | set(frozen) | set(behind) | set(stuck))

    def _classify(
        self, first: dict[int, RankProgress], second: dict[int, RankProgress]
    ) -> tuple[list[int], list[int], list[int], list[int], dict[int, RankProgress], int]:
        """``(missing, frozen, behind, stuck, seen, most)`` of two snapshots."""
        missing = [r for r in self._ranks if r not in second]
        frozen = [
            r
            for r in self._ranks
            if r in second and r in first and second[r].pulse == first[r].pulse
        ]
        seen = {r: p for r, p in second.items() if r not in frozen}
        most = max((p.beats for p in second.values()), default=self._beats)
        behind = sorted(r for r, p in seen.items() if p.beats < most)
        stuck: list[int] = []
        # in a collective in either snapshot: a rank that waits in one can be seen
        # outside it for a moment (the 2-core CI host once caught a waiting rank's
        # main thread in linecache), which must not name it as the culprit
        waiting = {
            r for r, p in seen.items() if p.in_collective or (r in first and first[r].in_collective)
        }
        if not behind and waiting:
            # Same progress everywhere, but some ranks wait in a collective that the
            # others never entered: those others hold the job up.
            stuck = sorted(r for r in seen if r not in waiting)
        return missing, frozen, behind, stuck, seen, most

    def report(
        self,
        idle: float,
        first: dict[int, RankProgress],
        second: dict[int, RankProgress],
    ) -> str:
        """The report for two snapshots of :meth:`progress` taken a few intervals apart.

        Names the ranks that are missing (no entry), not responding (their pulse
        did not advance between the snapshots) and behind (fewer beats than the
        furthest rank).
        """
        me = self._rank
        lines = [
            f"nvdd watchdog: rank {me} made no progress for {idle:.1f} s "
            f"(timeout {self.timeout_s:g} s) at {self._label!r} (beat {self._beats})."
        ]
        missing, frozen, behind, stuck, seen, most = self._classify(first, second)
        for r in missing:
            lines.append(f"  rank {r}: missing: it never published (not started, or dead)")
        for r in frozen:
            p = second[r]
            lines.append(
                f"  rank {r}: not responding: no heartbeat for at least {self.interval_s * 2:.1f} s "
                f"(frozen, dead, or holding the GIL in native code); last at {p.label!r} "
                f"(beat {p.beats}), main thread at {p.where}"
            )
        for r in behind:
            p = seen[r]
            lines.append(
                f"  rank {r}: behind: last progress {p.label!r} {p.idle_s:.1f} s ago "
                f"(beat {p.beats} of {most}), main thread at {p.where}"
            )
        for r in stuck:
            p = seen[r]
            lines.append(
                f"  rank {r}: stuck outside the collective the others wait in: at {p.label!r} "
                f"for {p.idle_s:.1f} s, main thread at {p.where}"
            )
        silent = sorted(set(missing) | set(frozen) | set(behind) | set(stuck))
        if silent:
            lines.append(f"silent rank(s): {silent}.")
        else:
            at = sorted({p.label for p in second.values()})
            lines.append(
                f"no rank is behind: all are at beat {most} ({', '.join(map(repr, at))}) and "
                "alive, so they all wait in a collective that does not complete (a network or "
                "NCCL problem) or in one long phase; main threads at: "
                + "; ".join(f"rank {r}: {p.where}" for r, p in sorted(second.items()))
            )
        lines.append(
            f"Ending rank {me} (exit status {WATCHDOG_EXIT_CODE}) so the launcher stops the job; "
            f"raise the timeout with {WATCHDOG_ENV} or watchdog_s= if a phase is legitimately "
            "this long."
        )
        return "\n".join(lines)


def _default_store() -> Store:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
