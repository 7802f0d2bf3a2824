"""`WholeBatchModel`: a world of one rank runs the model on the whole batch.

No decomposition: no halo plan, no adapters, no exchange, the model's own
periodic boundaries, and no rebuild decision (so no host read in a steady
step: the non-finite flags are queued and read later, :class:`LazyFiniteCheck`).
``DomainParallel`` picks it at one rank unless ``DomainConfig(halo_on_one_rank=True)``
asks for the halo (:func:`~nvdd.dynamics.distributed_model_for`); a step through
it costs what the model costs.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch

from nvdd.core import (
    Batch,
    ConfigurationError,
    ModelOutputs,
    after_replay,
    capturing,
    get_rank,
    raise_if_any_rank,
)
from nvdd.dynamics._compile import CompileMode, compiled_forward
from nvdd.dynamics._provider import PendingTotals, ProviderBase, device_problem, extract_forces
from nvdd.dynamics._step import StepState, nonfinite_flag
from nvdd.spec import ForceStrategy, unwrap_model

if TYPE_CHECKING:
    from nvdd.dynamics._provider import State

__all__ = ["WholeBatchModel"]


class WholeBatchModel(ProviderBase):
    """The force provider of a world of one rank: the model on every atom.

    Parameters are those of :class:`~nvdd.dynamics._provider.ProviderBase`
    (``model``, ``config``, ``spec``, ``count``, ``sync_timings``).
    """

    # (a captured call's compiles are counted by its eager warm-up calls)
    _compiles_counted_in_capture = False

    @property
    def plan(self) -> Any:
        """Always raises: a world of one has no halo plan."""
        raise ConfigurationError(
            "a world of one rank runs the model on the whole batch and has no halo plan "
            "(DomainConfig(halo_on_one_rank=True) builds one)"
        )

    def attach(self, sharded: State) -> None:
        """Start running on ``sharded`` (one rank): choose the compiled forward."""
        raise_if_any_rank(
            device_problem(unwrap_model(self.model), sharded.local_batch.device),
            sharded.group,
            exc_type=ConfigurationError,
        )
        self._sharded = sharded
        self.pending = PendingTotals(sharded.group)
        self.stats.n_owned, self.stats.n_ghost = sharded.n_owned, 0
        self.forward_fn, mode = compiled_forward(
            self.model, self.spec, self.config.compile, get_rank()
        )
        self.stats.compile_mode = mode.value

    def detach(self) -> None:
        """Hand a model that compiled its own core back to eager."""
        self._release_compiled()
        self._sharded = None

    # ------------------------------------------------------------- the step
    def decide(self, st: StepState) -> bool:
        """Phase 1: nothing to decide (False). The batch's non-finite flag is
        queued and read later (no host sync); under a CUDA-graph capture every
        replay queues it (:func:`nvdd.core.after_replay`)."""
        batch = st.batch
        if capturing():  # a CUDA-graph capture (see graph_key)
            flag = nonfinite_flag(batch)  # recomputed by every replay
            after_replay(lambda: self._replayed(flag))
            return False
        self._finite.push(batch)
        if self._finite.poll():
            self.check_finite()
        st.t0 = self._timer("check", st.t0)
        return False

    def rebuild(self, st: StepState) -> None:
        """Never called (:meth:`decide` is always False): nothing to rebuild."""

    def exchange(self, st: StepState) -> None:
        """Phase 3: the owned positions (a leaf that requires grad under
        ``ForceStrategy.AUTOGRAD``); no communication."""
        pos = st.batch.positions.detach()
        autograd = self.spec.force_strategy is ForceStrategy.AUTOGRAD
        st.padded = pos.clone().requires_grad_(True) if autograd else pos

    def forward(self, st: StepState) -> None:
        """Phase 4: the model on the batch with its own boundaries."""
        autograd = self.spec.force_strategy is ForceStrategy.AUTOGRAD
        with torch.set_grad_enabled(autograd or torch.is_grad_enabled()):
            st.raw = dict(self.forward_fn(st.batch.replace(positions=st.padded)))
        st.t0 = self._timer("model", st.t0)

    def fold(self, st: StepState) -> ModelOutputs:
        """Phase 5: every output is already the total; nothing is pending."""
        raw = st.raw
        forces = extract_forces(raw, st.padded, self.spec.force_strategy, self.model)
        final: dict[str, Any] = {
            k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in raw.items()
        }
        final["forces"] = forces
        assert self.pending is not None
        self.pending.set({})  # every output is already the total
        self._timer("reduce", st.t0)
        return final  # type: ignore[return-value]

    def request_rebuild(self) -> None:
        """Nothing to rebuild (no plan); a checkpoint may ask all the same."""

    def _replayed(self, flag: torch.Tensor) -> bool:
        """After a replay: count the call and queue its non-finite flag."""
        self.stats.calls += 1
        self._finite.push_flag(flag)
        if self._finite.poll():
            self.check_finite()
        return True

    # ---------------------------------------------------- CUDA-graph capture
    def graph_key(self, batch: Batch) -> Hashable | None:
        """Whole steps are captured when the model opts in (its
        ``graph_key(batch)``), uncompiled, without collective counting or
        synchronised timers."""
        if self.count or self.sync_timings:
            return None
        if self.stats.compile_mode == CompileMode.WHOLE.value:
            return None  # (the model's own compiled core: captured when it says so)
        inner = self.model.graph_key(batch)
        return None if inner is None else ("whole batch", inner)

    @property
    def splits_step(self) -> bool:
        """Whether the model splits its own steps (the MPNN on its device edges)."""
        return bool(self.model.splits_step)

    def begin_step(self, batch: Batch) -> None:
        """The model's own ``begin_step`` (local)."""
        self.model.begin_step(batch)

    def take_verdict(self, batch: Batch) -> bool:
        """The model's own ``take_verdict`` (one local host read)."""
        return bool(self.model.take_verdict(batch))
