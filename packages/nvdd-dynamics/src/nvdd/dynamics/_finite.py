"""Non-finite detection without a host synchronisation per step, and the step's decision.

A multi-rank step reads one all-reduced flag anyway (the rebuild decision) and
carries the non-finite check in it. A step that needs no decision (one rank, the
whole batch) should not stall the host on the device just to look for NaN:
:class:`LazyFiniteCheck` computes the flag on the device every step, copies it to
pinned host memory without blocking, and reads it once the copy has landed (on
CUDA, polled with an event; on the CPU at once). A NaN is therefore reported at
most a few steps late, always before :meth:`flush` returns (``DomainParallel``
flushes at the end of every ``run`` and before every gather).

The step's one shared decision (:func:`decision_code`, :func:`read_decision`)
carries that flag: every rank computes a small integer on its atoms' device and
the ranks take the maximum (one all-reduce), so every rank reads the same
verdict and takes the same branch; the codes are ordered by priority:

- :data:`STEADY` (0): the halo plan holds;
- :data:`MODEL_GROWS` (1): some rank's model buffers overflowed (the MPNN's
  device edges): the step runs eagerly and that rank grows; nothing migrates;
- :data:`REBUILD` (2): some owned atom used up its skin: migrate, new plan;
- :data:`NONFINITE` (3): some rank holds a non-finite value: every rank raises.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from nvdd.core import (
    Batch,
    after_replay,
    all_reduce,
    capturing,
    comm_device,
    get_world_size,
    raise_if_any_rank,
)

__all__ = [
    "MAX_COORDINATE",
    "MODEL_GROWS",
    "NONFINITE",
    "REBUILD",
    "STEADY",
    "DivergenceFlag",
    "LazyFiniteCheck",
    "decision_code",
    "nonfinite_flag",
    "nonfinite_message",
    "read_decision",
    "reduce_device",
]

#: Positions beyond this many Angstrom from the origin count as a blown-up run:
#: neighbour searches misbehave there (vesin 0.6 dies with SIGFPE on an open
#: system with an atom 1e6 A away), so they are reported like NaN, by atom id.
MAX_COORDINATE = 1.0e6


def nonfinite_flag(batch: Batch) -> torch.Tensor:
    """int32 0-dim tensor on the atoms' device: 1 if any position, velocity or
    force is not finite (or a position lies beyond :data:`MAX_COORDINATE`),
    else 0 (no host synchronisation)."""
    pos = batch.positions.detach()
    finite = (pos.abs() < MAX_COORDINATE).all()
    for t in (batch.velocities, batch.forces):
        finite = finite & torch.isfinite(t).all()
    return (~finite).to(torch.int32)


def nonfinite_message(batch: Batch) -> str | None:
    """What is not finite on this rank (field, first atom id, value), or None
    (host reads: for the error path, after :func:`nonfinite_flag` was set)."""
    far = ~(batch.positions.detach().abs() < MAX_COORDINATE).all(dim=1) & torch.isfinite(
        batch.positions
    ).all(dim=1)
    if bool(far.any()):
        row = int(far.nonzero()[0, 0])
        return (
            f"{int(far.sum())} of {batch.n_atoms} owned atoms lie beyond {MAX_COORDINATE:g} A "
            f"from the origin (first: atom id {int(batch.atom_ids[row])}, position "
            f"{batch.positions[row].tolist()}): the run blew up"
        )
    for name in ("positions", "velocities", "forces"):
        t = getattr(batch, name)
        bad = ~torch.isfinite(t).all(dim=1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            return (
                f"{int(bad.sum())} of {batch.n_atoms} owned atoms have non-finite {name} "
                f"(first: atom id {int(batch.atom_ids[row])}, {name} {t[row].tolist()}); "
                "the time step may be too large or the model diverged"
            )
    return None


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


# ------------------------------------------------------ the step's decision
STEADY, MODEL_GROWS, REBUILD, NONFINITE = 0, 1, 2, 3


def reduce_device(group: Any) -> torch.device | None:
    """Where :func:`decision_code` reduces over ``group``: its collectives'
    device, None for a group of one rank (nothing to reduce). Fixed per group:
    a caller that decides every step asks once."""
    return comm_device(group) if get_world_size(group) > 1 else None


def decision_code(
    moved: torch.Tensor,
    model_flag: torch.Tensor | None,
    batch: Batch,
    group: Any,
    on: torch.device | str | None = "ask",
) -> torch.Tensor:
    """The step's code, int32 ``(1,)``, reduced over ``group`` (no host read).

    ``moved``: nonzero when this rank's atoms used up the skin; ``model_flag``:
    nonzero when this rank's model buffers overflowed (None: no such model);
    the non-finite flag of ``batch`` is added here. ``on``: the group's
    :func:`reduce_device` when the caller knows it (default: asked here).

    **Collective** over ``group`` when it has more than one rank: ONE
    all-reduce (max) of one integer.
    """
    code = torch.where(moved != 0, REBUILD, STEADY).to(torch.int32)
    if model_flag is not None:
        code = torch.maximum(code, (model_flag.reshape(()) != 0).to(torch.int32))
    code = torch.where(nonfinite_flag(batch) == 0, code, NONFINITE).reshape(1)
    device = reduce_device(group) if isinstance(on, str) else on
    if device is not None:
        code = code.to(device)
        all_reduce(code, "max", group)
    return code


def read_decision(code: torch.Tensor, batch: Batch, group: Any) -> int:
    """The host read of :func:`decision_code`: the code, after raising on every
    rank of ``group`` for :data:`NONFINITE` (**Collective** then: the messages
    are gathered)."""
    verdict = int(code.item())
    if verdict == NONFINITE:
        raise_if_any_rank(nonfinite_message(batch), group)
    return verdict
