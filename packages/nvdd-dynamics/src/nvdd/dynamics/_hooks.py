"""Hook stages, scopes and registrations (the context a hook receives: ``_integrators``)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nvdd.core import ConfigurationError

__all__ = ["PER_ATOM_OUTPUTS", "Hook", "HookScope", "HookStage"]

#: Per-atom model outputs the integrator keeps in ``batch.atom_extras`` when the
#: model returns them (they migrate with their atoms and reach hooks and
#: trajectory writers): ``atom_energies`` ``(n_atoms,)`` and ``atom_virials``
#: ``(n_atoms, 3, 3)`` (summing to the system virial, ``-dE/d strain``; only
#: models that say so return them, e.g. ``LJConfig(atom_virials=True)``). A hook
#: may name them in ``needs``: a model that does not return one is then an error.
PER_ATOM_OUTPUTS = ("atom_energies", "atom_virials")


class HookStage(enum.Enum):
    """Where in a step a hook runs (in this order)."""

    BEFORE_STEP = "before_step"
    BEFORE_PRE_UPDATE = "before_pre_update"
    AFTER_PRE_UPDATE = "after_pre_update"
    BEFORE_COMPUTE = "before_compute"
    AFTER_COMPUTE = "after_compute"
    BEFORE_POST_UPDATE = "before_post_update"
    AFTER_POST_UPDATE = "after_post_update"
    AFTER_STEP = "after_step"
    ON_CONVERGE = "on_converge"


class HookScope(enum.Enum):
    """Which ranks execute a hook callback, on which batch.

    ``LOCAL``: every rank, on its own owned atoms. ``GLOBAL``: every rank, on the
    whole system gathered to every rank (all GLOBAL hooks of one stage share one
    gather). ``RANK_ZERO``: rank 0 only, on the whole system gathered to rank 0.
    In a single process all three run once on the whole batch.
    """

    LOCAL = "local"
    GLOBAL = "global"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class Hook:
    """One registered callback.

    Parameters
    ----------
    stage:
        When it runs.
    fn:
        ``fn(ctx: HookContext) -> None``.
    every:
        Frequency in steps (runs when ``step % every == 0``; ON_CONVERGE hooks run
        once, at convergence).
    scope:
        :class:`HookScope`.
    needs:
        Outputs the hook reads from the batch besides positions, velocities and
        forces (``"energy"``, ``"stress"``, or a per-atom output of
        ``PER_ATOM_OUTPUTS``: ``"atom_energies"``, ``"atom_virials"``). Under
        domain decomposition the per-system totals are reduced across ranks only
        on steps where a due hook (or the integrator) needs them. GLOBAL and
        RANK_ZERO hooks need both totals. A per-atom need that the model does not
        return is a ``ConfigurationError`` when the hook is due.
    """

    stage: HookStage
    fn: Callable[[Any], Any]  # (a HookContext: see _integrators)
    every: int = 1
    scope: HookScope = HookScope.LOCAL
    needs: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.stage, HookStage):
            raise ConfigurationError(f"Hook.stage must be a HookStage, got {self.stage!r}")
        if not isinstance(self.scope, HookScope):
            raise ConfigurationError(f"Hook.scope must be a HookScope, got {self.scope!r}")
        if not isinstance(self.every, int) or self.every < 1:
            raise ConfigurationError(f"Hook.every must be an integer >= 1, got {self.every!r}")
        if not callable(self.fn):
            raise ConfigurationError(f"Hook.fn must be callable, got {self.fn!r}")
        accepted = ("energy", "stress", *PER_ATOM_OUTPUTS)
        bad = set(self.needs) - set(accepted)
        if bad:
            raise ConfigurationError(f"Hook.needs accepts {list(accepted)}, got {sorted(bad)}")
        needs = frozenset(self.needs)
        if self.scope is not HookScope.LOCAL:
            needs |= {"energy", "stress"}
        object.__setattr__(self, "needs", needs)

    def due(self, step: int) -> bool:
        """Whether the hook runs at ``step``."""
        return self.stage is HookStage.ON_CONVERGE or step % self.every == 0
