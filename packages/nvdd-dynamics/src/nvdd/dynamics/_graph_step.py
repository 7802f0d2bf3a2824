"""Steady steps as replays of one captured step (CUDA graphs).

A small system on a GPU is launch-bound: a velocity-Verlet step with the Warp
Lennard-Jones model is about 35 small launches and a few hundred microseconds
of Python. :class:`StepGraphs` captures the middle of a step (``pre_update``,
the force phases, ``post_update``) once the run is steady and replays it on
later steps: one launch, no Python per kernel. Hooks of ``BEFORE_STEP``,
``AFTER_STEP`` and ``ON_CONVERGE`` still run around a replay; a step with a hook
due in between runs eagerly.

Who does what
    The step (:func:`nvdd.dynamics._step.step`) hands :meth:`StepGraphs.run_step`
    its :class:`~nvdd.dynamics._step.StepState` and its cut of a steady step
    (:func:`~nvdd.dynamics._step.steady_segments`: the pieces, each a run of
    the step's own phases); this module records, replays and drops those
    pieces and calls nothing of the integrator or the provider but what they
    declare for capture (``graph_key``). A force provider never captures: it
    declares (``CapturableSteps``) and answers inside a capture
    (:func:`nvdd.core.capturing`, :func:`nvdd.core.after_replay`).

When a step is captured
    The integrator (:meth:`BaseDynamics.graph_key`), the force provider and the
    model (``graph_key(batch)``) all opt in, on CUDA (or inside
    :func:`nvdd.core.emulated_capture`), after :data:`WARMUP_STEPS` eager steps
    with the same keys (:data:`WARMUP_AFTER_REBUILD` after a split step's
    provider rebuilt: its rebuild step ran the new plan once already). Today:
    :class:`VelocityVerlet`, :class:`Langevin`, :class:`NoseHooverNVT`,
    :class:`MTKNPT` (chains and cell on the device) and :class:`FIRE` (its
    adaptive state on the device) with `LennardJones` on its
    Warp path, in one process, under
    :class:`DomainParallel` on one rank (the whole batch), and on the halo path
    of several ranks (split below); and with `ReferenceMPNN` on its device
    edges (eager or compiled), in one process or on one rank running the
    whole batch (split at the model's own verdict: its edge buffers fit).

A step split at a host decision
    A multi-rank step decides on the host whether atoms migrate and the halo
    is rebuilt (one all-reduced flag); a model with fixed-capacity buffers (the
    MPNN's device edges) must learn whether they overflowed before its forces
    are used. A provider that says so
    (``splits_step``) has its steps cut into a *head* (``pre_update``, then
    ``provider.begin_step(batch)``, which queues the decision and its
    all-reduce on the device), a *verdict* and a *tail* (the force phases,
    ``post_update``; ``Segments``), captured as two graphs. A replay runs the
    head, the verdict (``provider.take_verdict``: the one host read a
    multi-rank step makes anyway), then replays the tail when the halo still
    holds, or runs the tail eagerly (migration, a new plan) and drops both
    graphs, whose shapes no longer fit.
    Every rank reads the same all-reduced decision, so all ranks take the same
    branch; an eager step and a replay issue the same collectives in the same
    order, so ranks that capture at different steps still match.

Fixed addresses
    Everything a replay reads must be where the capture found it. The batch's
    tensors before the capture become the *static* state; the captured step
    ends by copying every output the step allocated (forces, energy, stress,
    per-atom outputs) into them. Before each replay, a batch tensor that is not
    the static one (an eager step or a hook replaced it) is copied in when it
    holds values (positions, velocities, the step's outputs); any other change
    (masses, cell, species, the number of atoms) drops the graph and the step
    runs eagerly. So a replay reads exactly what an eager step would.

Dropping the graph
    A key changes (a host-side neighbour rebuild, a new time step), a
    component's :func:`nvdd.core.after_replay` callback says the graph no longer
    fits (the neighbour list must grow), or a callback raises (non-finite
    values): the graph is dropped and the next steps run eagerly until the run
    is steady again. A capture that fails on CUDA disables capture for this
    integrator with a warning (the step then runs eagerly); under
    :func:`~nvdd.core.emulated_capture` it raises (a test wants to see it).

Memory
    Each role (the head or whole step, and the tail) captures into its own
    :class:`nvdd.core.GraphPool`, kept for the life of the integrator: the
    graph captured after a rebuild reuses the memory of the one it replaces,
    and no capture empties torch's allocator cache (``torch.cuda.graph`` does
    both the other way: a new pool per capture, and ``empty_cache`` before it).
    The head and the tail are replayed in one step, so they never share a pool.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch

from nvdd.core import (
    PER_ATOM_FIELDS,
    PER_SYSTEM_FIELDS,
    Batch,
    CaptureError,
    GraphPool,
    StepGraph,
    can_capture,
    make_step_graph,
)
from nvdd.dynamics._hooks import HookStage
from nvdd.dynamics._step import Integrator, Segments, StepState


class Captured(Integrator, Protocol):
    """What :class:`StepGraphs` needs of its integrator (``BaseDynamics``): what
    the step needs, and the integrator's own key."""

    def graph_key(self) -> Hashable | None: ...


__all__ = ["CUDA_GRAPHS_ENV", "WARMUP_STEPS", "StepGraphs", "cuda_graphs_default"]

#: Eager steps with unchanged keys before a step is captured.
WARMUP_STEPS = 2
#: The same after a split step's provider rebuilt (its rebuild step already ran
#: the new plan eagerly once: every first-call allocation and host rebuild is
#: done, so the next step is captured at once; on one H200 the two eager steps
#: cost 3.7 ms per rebuild of LJ 1M with the halo forced).
WARMUP_AFTER_REBUILD = 0
#: Environment variable: ``0`` turns step capture off by default.
CUDA_GRAPHS_ENV = "NVDD_CUDA_GRAPHS"
#: Fields whose values (not identity) a replay may take from the batch: the
#: state, and the per-system outputs a hook may have consolidated between steps
#: (the halo path totals energy and stress only when asked, so a step leaves
#: them alone and a logging hook replaces them; copying its values in is what an
#: eager step would read).
_VALUES = frozenset({"positions", "velocities", "energy", "stress"})
#: Hook stages inside the captured part of a step.
_INSIDE = frozenset(
    {
        HookStage.BEFORE_PRE_UPDATE,
        HookStage.AFTER_PRE_UPDATE,
        HookStage.BEFORE_COMPUTE,
        HookStage.AFTER_COMPUTE,
        HookStage.BEFORE_POST_UPDATE,
        HookStage.AFTER_POST_UPDATE,
    }
)


def cuda_graphs_default() -> bool:
    """Whether integrators capture steady steps by default (``$NVDD_CUDA_GRAPHS``,
    default on; ``0``, ``false``, ``off`` or ``no`` turn it off)."""
    value = os.environ.get(CUDA_GRAPHS_ENV, "1").strip().lower()
    return value not in ("0", "false", "off", "no")


def _fields(batch: Batch) -> dict[str, torch.Tensor]:
    out = {name: getattr(batch, name) for name in (*PER_ATOM_FIELDS, *PER_SYSTEM_FIELDS)}
    out.update({f"atom_extras.{k}": v for k, v in batch.atom_extras.items()})
    out.update({f"system_extras.{k}": v for k, v in batch.system_extras.items()})
    return out


def _rebind(batch: Batch, tensors: dict[str, torch.Tensor]) -> Batch:
    direct = {k: v for k, v in tensors.items() if "." not in k}
    atoms = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("atom_extras.")}
    systems = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("system_extras.")}
    fields: dict[str, Any] = {**direct, "atom_extras": atoms, "system_extras": systems}
    return batch.replace(**fields)


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


class StepGraphs:
    """Captures and replays the steady steps of one integrator (module notes).

    Attributes
    ----------
    enabled:
        Capture steady steps (default :func:`cuda_graphs_default`); set False to
        run every step eagerly.
    captures, replays, drops:
        Steps captured, steps run by a replay (a CUDA capture is replayed once
        at once, so it counts as both), graphs dropped.
    last_drop:
        Why the last graph was dropped (or capture disabled), for diagnostics.
    """

    def __init__(self, dyn: Captured, enabled: bool | None = None) -> None:
        self.dyn = dyn
        self.enabled = cuda_graphs_default() if enabled is None else bool(enabled)
        self.captures = 0
        self.replays = 0
        self.drops = 0
        self.last_drop: str | None = None
        self._graph: StepGraph | None = None
        # the pieces of the held step (the step module's cut); a split step: the
        # tail graph and the head's callbacks
        self._segments: Segments | None = None
        self._tail: StepGraph | None = None
        self._head_callbacks: list[Callable[[], bool]] = []
        self._key: Hashable | None = None
        self._last_key: Hashable | None = None
        self._streak = 0
        self._rebuilt = False  # the last step's split decision rebuilt the provider
        self._static: dict[str, torch.Tensor] = {}
        self._copy_in: frozenset[str] = frozenset()
        self._callbacks: list[Callable[[], bool]] = []
        self._outputs: dict[str, torch.Tensor] = {}
        self._next_step = -1
        # one memory pool per role, kept across recaptures (GraphPool): the head
        # (or whole step) and the tail are replayed in the same step, so apart
        self._pools: dict[str, GraphPool] = {}

    @property
    def active(self) -> bool:
        """Whether a captured step is held (the next steady step replays it)."""
        return self._graph is not None

    def key(self, st: StepState) -> Hashable | None:
        """What a capture of the next step through ``st`` bakes in (None: not
        capturable now): the integrator's key and its provider's (both declared)."""
        dyn = self.dyn
        if not (self.enabled and st.forces_ready):
            return None
        own = dyn.graph_key()
        if own is None:
            return None
        step = dyn.step_count
        if any(h.stage in _INSIDE and h.due(step) for h in dyn.hooks):
            return None
        inner = st.provider.graph_key(st.batch)
        if inner is None:
            return None
        return (type(dyn), own, inner)

    def drop(self, reason: str, release: bool = False) -> None:
        """Forget the captured step (the next steps run eagerly until steady).
        ``release``: also let go of the memory pools (kept otherwise for the
        next capture), e.g. when the run that captured is over."""
        if release:
            self._pools.clear()
        if self._graph is not None:
            self.drops += 1
            self.last_drop = reason
        self._graph = None
        self._segments = None
        self._tail = None
        self._head_callbacks = []
        self._key = None
        self._static = {}
        self._callbacks = []
        self._outputs = {}
        self._streak = 0

    def run_step(self, st: StepState, cut: Callable[[StepState], Segments]) -> bool:
        """Run the middle of a step through ``st`` as a replay (or capture it, in
        the pieces ``cut(st)`` returns: the step module's
        :func:`~nvdd.dynamics._step.steady_segments`); False when this step must
        run eagerly (nothing was done)."""
        if not (self.enabled and can_capture(self.dyn.batch.device)):
            if self._graph is not None:
                self.drop("capture was turned off")
            return False  # (a CPU run pays nothing else)
        key = self.key(st)
        if key is None:
            self.drop("a step that cannot be captured")
            self._last_key = None
            return False
        if self._graph is not None:
            # (an integrator may read the step from a device counter: Langevin's noise)
            steady = key == self._key and self.dyn.step_count == self._next_step
            if steady and self._bind_inputs():
                self._replay(st)
                return True
            self.drop("the step's keys, inputs or step count changed")
        rebuilt, self._rebuilt = self._rebuilt, False
        if key != self._last_key:
            self._streak = WARMUP_STEPS - WARMUP_AFTER_REBUILD if rebuilt else 0
            self._last_key = key
        if self._streak < WARMUP_STEPS:
            self._streak += 1
            return False
        graph = make_step_graph(self.dyn.batch.device, self._pool("head"))
        if graph is None:
            return False
        segments = cut(st)
        if segments.verdict is not None:
            return self._capture_split(graph, st, segments)
        return self._capture(graph, st, segments)

    # ------------------------------------------------------------ internals
    def _pool(self, role: str) -> GraphPool:
        """The memory pool of ``role`` ("head": the whole step or its head;
        "tail"). Every graph of a role is dropped before the next is captured."""
        pool = self._pools.get(role)
        if pool is None or pool.device != self.dyn.batch.device:
            pool = self._pools[role] = GraphPool(self.dyn.batch.device)
        return pool

    def _bind_inputs(self) -> bool:
        """Make the batch's tensors the static ones (copying values in); False
        when a change is structural (the graph must go)."""
        dyn = self.dyn
        current = _fields(dyn.batch)
        if current.keys() != self._static.keys():
            return False
        stale = False
        for name, static in self._static.items():
            now = current[name]
            if now is static:
                continue
            if name not in self._copy_in or not _same_kind(now, static):
                return False
            static.copy_(now)
            stale = True
        if stale:
            dyn.batch = _rebind(dyn.batch, self._static)
        return True

    def _recording(
        self, pre: dict[str, torch.Tensor], changed: list[str], stages: Callable[[], None]
    ) -> Callable[[], None]:
        """A capture body: ``stages``, then every batch field the stages replaced
        copied back into its static tensor ``pre[name]`` (named in ``changed``)."""
        dyn = self.dyn

        def body() -> None:
            stages()
            post = _fields(dyn.batch)
            if post.keys() != pre.keys():
                raise CaptureError(
                    f"the step changed the batch's fields ({sorted(pre)} -> {sorted(post)})"
                )
            for name, t in post.items():
                if t is pre[name]:
                    continue
                if not _same_kind(t, pre[name]):
                    raise CaptureError(f"the step changed the shape or dtype of {name!r}")
                pre[name].copy_(t)  # back into the static tensor: the next replay reads it
                if name not in changed:
                    changed.append(name)

        return body

    def _capture(self, graph: StepGraph, st: StepState, segments: Segments) -> bool:
        """Capture the middle in one piece (``segments.head``); the step is done
        when this returns True."""
        dyn = self.dyn
        before, outputs_before = dyn.batch, dyn.outputs
        pre = _fields(before)
        changed: list[str] = []
        try:
            callbacks = graph.capture(self._recording(pre, changed, lambda: segments.head(dyn, st)))
        except CaptureError as exc:
            dyn.batch, dyn.outputs = before, outputs_before
            return self._failed(graph, exc)
        self._keep(graph, st, segments, pre, changed, callbacks)
        if not graph.executes_on_capture:
            graph.replay()
        self._after_replay()
        return True

    def _capture_split(self, head: StepGraph, st: StepState, segments: Segments) -> bool:
        """Capture a step as a head and a tail graph around its verdict (module
        notes); the step is done when this returns True."""
        dyn = self.dyn
        verdict, rest = segments.verdict, segments.tail
        assert verdict is not None and rest is not None
        before, outputs_before = dyn.batch, dyn.outputs
        pre = _fields(before)
        changed: list[str] = []
        try:
            head_callbacks = head.capture(
                self._recording(pre, changed, lambda: segments.head(dyn, st))
            )
        except CaptureError as exc:
            dyn.batch, dyn.outputs = before, outputs_before
            return self._failed(head, exc)
        dyn.batch = _rebind(dyn.batch, pre)
        if not head.executes_on_capture:
            head.replay()
        head_fits = _run_callbacks(head_callbacks)
        if not verdict(dyn, st):  # the halo is rebuilt: no graph to keep
            rest(dyn, st)
            self._rebuilt = True
            return True
        after_head = dyn.batch
        tail = make_step_graph(dyn.batch.device, self._pool("tail"))
        try:
            if tail is None:  # pragma: no cover - the head's device gave a graph
                raise CaptureError("no graph for the tail of the step")
            tail_callbacks = tail.capture(self._recording(pre, changed, lambda: rest(dyn, st)))
        except CaptureError as exc:
            dyn.batch, dyn.outputs = after_head, outputs_before
            if tail is None or tail.executes_on_capture:
                raise
            self._failed(tail, exc)
            verdict(dyn, st)  # (the failed capture consumed the decision)
            rest(dyn, st)
            return True
        self._keep(head, st, segments, pre, changed, tail_callbacks)
        self._tail, self._head_callbacks = tail, head_callbacks
        if not tail.executes_on_capture:
            tail.replay()
        self._after_replay()
        if not head_fits:
            self.drop("a component asked for an eager step")
        return True

    def _failed(self, graph: StepGraph, exc: CaptureError) -> bool:
        """A capture failed: raise under the emulation (a test wants to see it),
        else run every step of this integrator eagerly, with a warning."""
        if graph.executes_on_capture:
            raise exc
        self.enabled = False
        self.last_drop = f"capture failed: {exc}"
        torch.cuda.synchronize()
        warnings.warn(
            f"{type(self.dyn).__name__}: step capture failed, running every step eagerly ({exc})",
            RuntimeWarning,
            stacklevel=4,
        )
        return False

    def _keep(
        self,
        graph: StepGraph,
        st: StepState,
        segments: Segments,
        pre: dict[str, torch.Tensor],
        changed: list[str],
        callbacks: list[Callable[[], bool]],
    ) -> None:
        """Hold ``graph`` with its static tensors, outputs and callbacks."""
        dyn = self.dyn
        self.captures += 1
        self._static = pre
        self._copy_in = frozenset(_VALUES | set(changed))
        dyn.batch = _rebind(dyn.batch, pre)
        self._outputs = dyn.outputs
        self._callbacks = callbacks
        self._graph = graph
        self._segments = segments
        self._key = self.key(st)  # as the host sees it after the capture

    def _replay(self, st: StepState) -> None:
        """Replay the held step (a split step: head, verdict, then the tail or
        the rest of the step eagerly)."""
        assert self._graph is not None and self._segments is not None
        self._graph.replay()
        if self._tail is not None:
            dyn, verdict, rest = self.dyn, self._segments.verdict, self._segments.tail
            assert verdict is not None and rest is not None
            try:
                head_fits = _run_callbacks(self._head_callbacks)
                steady = verdict(dyn, st)
            except BaseException:
                self.drop("the step's decision raised")
                raise
            if not steady:
                self.drop(
                    "the provider decided against the captured rest (a halo rebuild, or buffers that grow)"
                )
                rest(dyn, st)
                self._rebuilt = True
                return
            self._tail.replay()
            self._after_replay()
            if not head_fits:
                self.drop("a component asked for an eager step")
            return
        self._after_replay()

    def _after_replay(self) -> None:
        self.replays += 1
        self._next_step = self.dyn.step_count + 1  # the host counts after this call
        self.dyn.outputs = self._outputs
        try:
            fits = _run_callbacks(self._callbacks)
        except BaseException:
            self.drop("a replay callback raised")
            raise
        if not fits:
            self.drop("a component asked for an eager step (e.g. a neighbour list must grow)")


def _run_callbacks(callbacks: list[Callable[[], bool]]) -> bool:
    """Run every callback (all of them, even after a False); whether all fit."""
    fits = True
    for callback in callbacks:
        fits = callback() and fits
    return fits
