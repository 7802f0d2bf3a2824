"""Non-finite detection without a host synchronisation per step.

A multi-rank step reads one all-reduced flag anyway (the rebuild decision) and
carries the non-finite check in it. A step that needs no decision (one rank, the
whole batch) should not stall the host on the device just to look for NaN:
:class:`LazyFiniteCheck` computes the flag on the device every step, copies it to
pinned host memory without blocking, and reads it once the copy has landed (on
CUDA, polled with an event; on the CPU at once). A NaN is therefore reported at
most a few steps late, always before :meth:`flush` returns (``DomainParallel``
flushes at the end of every ``run`` and before every gather).

The flag (:func:`~nvdd.dynamics._step.nonfinite_flag`) and the step's one
shared decision that carries it (``decision_code``, ``read_decision``) live in
:mod:`nvdd.dynamics._step`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from nvdd.core import Batch, after_replay, capturing
from nvdd.dynamics._step import nonfinite_flag

__all__ = ["DivergenceFlag", "LazyFiniteCheck"]


class LazyFiniteCheck:
    """Device flags read by the host once they are ready (see the module notes)."""

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.Tensor, Any]] = deque()

    def push(self, batch: Batch) -> None:
        """Queue this step's flag (no synchronisation)."""
        self.push_flag(nonfinite_flag(batch))

    def push_flag(self, flag: torch.Tensor) -> None:
        """Queue a flag computed elsewhere (e.g. by a replayed CUDA graph)."""
        if flag.device.type == "cuda":
            host = torch.empty((), dtype=torch.int32, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            self._pending.append((host, event))
        else:
            self._pending.append((flag, None))

    def poll(self, *, block: bool = False) -> bool:
        """True if a ready flag (every flag with ``block``) says non-finite; the
        flags read are dropped."""
        bad = False
        while self._pending:
            host, event = self._pending[0]
            if event is not None and not block and not event.query():
                break
            if event is not None:
                event.synchronize()
            self._pending.popleft()
            bad = bad or bool(int(host) != 0)
        return bad


class DivergenceFlag:
    """An integrator's own "something diverged" flag (a chain factor, a cell
    momentum), set on the device during a step and read without blocking.

    :meth:`mark` or's non-finite values into a device bool; :meth:`queue` (once
    per step, at its end) hands a copy to a :class:`LazyFiniteCheck` and resets
    the flag; inside a step capture the copy is queued after every replay
    (``after_replay``). ``on_set`` raises the integrator's error.
    """

    def __init__(self, on_set: Callable[[], None]) -> None:
        self._on_set = on_set
        self._lazy = LazyFiniteCheck()
        self.bad = torch.zeros((), dtype=torch.bool)

    def reset(self, device: torch.device) -> None:
        """A cleared flag on ``device`` (the integrator's state moved or restarted)."""
        self.bad = torch.zeros((), dtype=torch.bool, device=device)

    def mark(self, values: torch.Tensor) -> None:
        """Set the flag if any of ``values`` is not finite (no host read)."""
        self.bad.logical_or_(~torch.isfinite(values).all())

    def queue(self) -> None:
        """Queue this step's flag (a copy: the next step resets it); raise
        through ``on_set`` on one that is ready and set."""
        flag = self.bad.to(torch.int32)
        self.bad.zero_()

        def poll() -> bool:
            self._lazy.push_flag(flag)
            if self._lazy.poll():
                self._on_set()
            return True

        if capturing():  # every replay queues its flag
            after_replay(poll)
        else:
            poll()

    def check(self) -> None:
        """Wait for every queued flag; raise through ``on_set`` if one is set."""
        if self._lazy.poll(block=True):
            self._on_set()
