"""How `DomainParallel` feeds its :class:`~nvdd.core.Watchdog`.

The watchdog runs from ``partition`` (or ``load``) to ``close`` and gets one beat
at every hook stage of every step (``"step 12 before_compute"``) and one after the
hooks of a stage ran, so the report of a silent rank says which step and phase it
stopped in, and a rank stuck in a hook is one beat behind the others (whatever
the backend: a rank waiting in an NCCL collective may block outside
``torch.distributed``, in a host sync). Phases that are
legitimately long get a larger allowance: the scatter from the source rank
(which may read and check a large system first) and, with a compiled forward,
the first force computation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nvdd.dynamics._domain_parallel import DomainParallel

__all__ = ["SETUP_ALLOWANCE_S", "stage_beat", "watch"]

#: Seconds the scatter (and a first compiled forward) may take before the watchdog
#: reports, when that is more than its timeout.
SETUP_ALLOWANCE_S = 600.0


def watch(dp: DomainParallel, label: str) -> None:
    """Start ``dp``'s watchdog (if not running) and beat ``label`` with the set-up allowance."""
    dp.watchdog.start()
    dp.watchdog.beat(label, allow_s=SETUP_ALLOWANCE_S)


def stage_beat(dp: DomainParallel) -> Callable[[int, str], None]:
    """The ``BaseDynamics.heartbeat`` that beats ``dp``'s watchdog at every stage."""
    wd = dp.watchdog
    # Until the first step starts, the first forces are computed (compiled, maybe).
    wd.beat("partitioned", allow_s=SETUP_ALLOWANCE_S if dp.config.compile else None)

    def beat(step: int, phase: str) -> None:
        wd.beat(f"step {step} {phase}")

    return beat
