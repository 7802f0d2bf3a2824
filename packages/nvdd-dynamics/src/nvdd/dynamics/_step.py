"""The MD step, in one place: named phases over one :class:`StepState`.

Forces at the current positions are five phases of the force provider::

    provider.open(st)         # count the call, start the phase timers
    if provider.decide(st):   # one all-reduce of a flag: skin used up (or a non-finite value)
        provider.rebuild(st)  # migrate atoms, plan the halo, build the padded batch
    provider.exchange(st)     # forward exchange: ghost positions -> st.padded
    provider.forward(st)      # the model on [owned | ghost] rows -> st.raw
    provider.fold(st)         # reverse fold of ghost forces, consolidation by the spec
    provider.close(st)

On one process (or one rank running the whole batch) ``decide`` is False and
``exchange`` / ``fold`` only shape the model's own call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from nvdd.core import Batch, ModelOutputs

__all__ = ["PhasedProvider", "StateOwner", "StepState", "compute_forces"]


class StateOwner(Protocol):
    """Holds an integrator's atom state (``local_batch``, read and written).

    On one process the integrator owns it; under ``DomainParallel`` the
    :class:`~nvdd.partition.ShardedBatch` does, so migration and the integrator
    never hold two copies that must be re-synced.
    """

    local_batch: Batch


@dataclass(eq=False, slots=True)
class StepState:
    """What the phases of one step hand each other.

    Attributes
    ----------
    owner:
        Holds this rank's owned atoms (``owner.local_batch``; a migration
        replaces them).
    padded:
        Positions of the ``[owned | ghost]`` rows after the exchange, shape
        ``(n_owned + n_ghost, 3)`` (the owned positions on one process).
    raw:
        The model's outputs on those rows, before the fold.
    t0:
        Start of the phase being timed (``time.perf_counter``).
    """

    owner: StateOwner
    padded: Any = None
    raw: Any = None
    t0: float = 0.0

    @property
    def batch(self) -> Batch:
        """This rank's owned atoms."""
        return self.owner.local_batch


class PhasedProvider(Protocol):
    """A force provider that exposes the phases of a force computation."""

    def open(self, st: StepState) -> None: ...

    def decide(self, st: StepState) -> bool: ...

    def rebuild(self, st: StepState) -> None: ...

    def exchange(self, st: StepState) -> None: ...

    def forward(self, st: StepState) -> None: ...

    def fold(self, st: StepState) -> ModelOutputs: ...

    def close(self, st: StepState) -> None: ...


def compute_forces(provider: PhasedProvider, st: StepState) -> ModelOutputs:
    """Outputs for the owned atoms at their current positions (module notes).

    **Collective** under domain decomposition (every rank calls it once per
    force computation); ``st.batch`` afterwards holds the rows they belong to.
    """
    provider.open(st)
    if provider.decide(st):
        provider.rebuild(st)
    provider.exchange(st)
    provider.forward(st)
    outputs = provider.fold(st)
    provider.close(st)
    return outputs
