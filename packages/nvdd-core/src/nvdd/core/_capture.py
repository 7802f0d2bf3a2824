"""Step capture: a CUDA graph of one step, and a CPU emulation of its semantics.

A captured step is host code run once while its device work is recorded; a
replay reruns that device work on the *same memory* with the *same arguments*
and none of the host code. Components called inside a capture therefore must:

- do no host synchronisation and make no host decision that a later step could
  decide differently (decide on the device instead);
- keep the buffers they read and write at fixed addresses between replays;
- move their per-call host work (reading flags, counters) to
  :func:`after_replay`, which runs it after every replay. Such a callback
  returns False when the captured work no longer matches the host's state
  (e.g. a neighbour list must grow): the owner of the graph then drops it and
  runs the next step eagerly;
- raise :class:`CaptureError` when asked to capture a call that is not steady
  (e.g. a host-side rebuild).

:func:`capturing` tells them whether a capture is in progress.

Two backends implement :class:`StepGraph`: :class:`CudaStepGraph`
(``torch.cuda.CUDAGraph``) and :class:`EmulatedStepGraph`, which runs on any
device: its capture executes the step while a ``TorchDispatchMode`` records
every tensor operation with the tensors it received and returned, and a replay
reruns the recorded operations on those tensors (results copied into the
recorded outputs, so addresses stay fixed, exactly as a graph's do). External
kernels (Warp) register their launches with :func:`record_launch`; collectives
(``c10d`` operations, e.g. over gloo) are recorded like any operation and a
replay waits for each before the next. So a CPU test
sees what a CUDA graph would replay: a host-side branch baked into the capture,
a tensor rebound in Python after the capture, or a host synchronisation inside
it (raised as :class:`CaptureError`). One blind spot: ``tolist()`` and
``numpy()`` of a CPU tensor read its memory without a torch operation, so the
emulation cannot see them (the no-host-sync guard tests count those).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nvdd.core._errors import NvddError

__all__ = [
    "CaptureError",
    "CudaStepGraph",
    "EmulatedStepGraph",
    "GraphPool",
    "StepGraph",
    "after_replay",
    "can_capture",
    "capturing",
    "emulated_capture",
    "make_step_graph",
    "record_launch",
]


class CaptureError(NvddError, RuntimeError):
    """A step could not be captured (not steady, or it synchronises the host)."""


class StepGraph(Protocol):
    """One captured step: :meth:`capture` once, then :meth:`replay` per step."""

    #: Whether :meth:`capture` also performs the step (the emulation does; a CUDA
    #: capture only records, so the step is replayed once after it).
    executes_on_capture: bool

    def capture(self, body: Callable[[], None]) -> list[Callable[[], bool]]:
        """Record ``body``; returns the :func:`after_replay` callbacks it registered."""
        ...

    def replay(self) -> None:
        """Rerun the recorded device work."""
        ...


class _Active:
    def __init__(self, recorder: _Recorder | None) -> None:
        self.callbacks: list[Callable[[], bool]] = []
        self.recorder = recorder


_local = threading.local()


def _active() -> _Active | None:
    return getattr(_local, "active", None)


def capturing() -> bool:
    """Whether a step is being captured on this thread (CUDA graph or emulation)."""
    return getattr(_local, "active", None) is not None  # (asked many times a step)


def after_replay(fn: Callable[[], bool]) -> None:
    """Run ``fn`` after every replay of the step being captured.

    ``fn`` returns False when the graph must be dropped (the next step then runs
    eagerly). Only valid inside a capture (:func:`capturing`).
    """
    active = _active()
    if active is None:
        raise CaptureError("after_replay() called outside a step capture")
    active.callbacks.append(fn)


def record_launch(replay: Callable[[], None]) -> None:
    """Register an external kernel launch (not a torch operation) with an emulated
    capture: ``replay`` relaunches it with the arguments of this call. A CUDA
    capture records launches on its stream by itself: nothing to do there."""
    active = _active()
    if active is not None and active.recorder is not None:
        active.recorder.ops.append(replay)


@contextmanager
def _activate(recorder: _Recorder | None) -> Iterator[_Active]:
    if _active() is not None:
        raise CaptureError("a step capture is already in progress on this thread")
    active = _Active(recorder)
    _local.active = active
    try:
        yield active
    finally:
        _local.active = None


#: A capture empties torch's allocator cache first only when less than this
#: fraction of the device's memory is free (:class:`GraphPool`: why not always).
TIGHT_MEMORY_FRACTION = 0.25


class GraphPool:
    """Device memory that successive captures of one role share.

    ``torch.cuda.graph`` gives every capture a new private memory pool and
    empties the allocator's cache before it starts; a step that is captured
    again after every halo rebuild then pays ``cudaFree`` for the cache and
    ``cudaMalloc`` for the buffers of the next eager step and of the new
    capture. A :class:`GraphPool` hands every capture of its role the same pool,
    so a new capture reuses the blocks its predecessor held. Only one graph of
    a pool may be replayed at a time (the owner drops the old graph before
    capturing the new one); graphs that are replayed in the same step need
    pools of their own.

    The pool is a ``torch.cuda.graph_pool_handle()`` kept alive by the graph
    last captured into it (held here, never replayed): torch frees a graph
    pool, and forgets its id, when its last graph goes, after which a capture
    into that id fails (torch 2.11 asserts in its host allocator; a
    ``torch.cuda.MemPool`` did the same). Elsewhere it is a token the emulation
    records.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._handle: Any = None
        self._last: Any = None

    def handle(self) -> Any:  # pragma: no cover - CUDA only
        """The pool id for ``capture_begin``."""
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    def hold(self, graph: Any) -> None:
        """Keep ``graph`` (just captured into this pool) as the pool's keeper; the
        previous keeper, dropped by its owner, is released."""
        self._last = graph


_capture_streams: dict[int, Any] = {}


def _capture_stream(device: torch.device) -> Any:  # pragma: no cover - CUDA only
    """One side stream per device for every capture (as ``torch.cuda.graph``
    keeps one): Warp maps it to one stream of its own."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _capture_streams.get(index)
    if stream is None:
        stream = _capture_streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
    return stream


class CudaStepGraph:  # pragma: no cover - CUDA only (its protocol: EmulatedStepGraph)
    """A ``torch.cuda.CUDAGraph`` of one step (captured on a side stream, into
    ``pool`` when given: :class:`GraphPool`).

    ``host_seconds`` (class-wide, for benchmarks) accumulates host time in four
    parts: per capture ``wait`` (the synchronisation before it: the device
    finishing earlier work), ``body`` (the step's host code while the stream
    records) and ``end`` (``capture_end``: the graph's instantiation); per graph
    ``first_replay`` (its first launch, which uploads it).
    """

    executes_on_capture = False
    host_seconds: ClassVar[dict[str, float]] = {
        "wait": 0.0,
        "body": 0.0,
        "end": 0.0,
        "first_replay": 0.0,
    }

    def __init__(self, pool: GraphPool | None = None) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self._replayed = False

    def capture(self, body: Callable[[], None]) -> list[Callable[[], bool]]:
        """Record ``body`` on the capture stream (nothing runs); returns its
        :func:`after_replay` callbacks. Raises :class:`CaptureError` when the capture fails."""
        # The garbage collector stays off while the stream captures: a collection
        # there can free objects whose finalisers call the CUDA driver (a Warp
        # array or stream, an event), which invalidates the whole capture
        # ("operation not permitted when stream is capturing"; seen on an H200
        # in 2 of 3 pytest runs of the graph tests, never with the collector
        # paused).
        device = torch.device("cuda", torch.cuda.current_device())
        if self.pool is not None:
            device = self.pool.device
        pool_id = self.pool.handle() if self.pool is not None else None
        times, t0 = CudaStepGraph.host_seconds, time.perf_counter()
        torch.cuda.synchronize(device)
        times["wait"] += time.perf_counter() - t0
        free, total = torch.cuda.mem_get_info(device)
        if free < TIGHT_MEMORY_FRACTION * total:
            torch.cuda.empty_cache()  # (what torch.cuda.graph does every time)
        enabled = gc.isenabled()
        gc.disable()
        stream = _capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            with _activate(None) as active, torch.cuda.stream(stream):
                try:
                    if pool_id is None:
                        self._graph.capture_begin()
                    else:
                        self._graph.capture_begin(pool=pool_id)
                    t1 = time.perf_counter()
                    try:
                        body()
                    except BaseException:
                        # end the capture; the body's error is the one to see
                        with contextlib.suppress(RuntimeError):
                            self._graph.capture_end()
                        raise
                    t2 = time.perf_counter()
                    self._graph.capture_end()
                    times["body"] += t2 - t1
                    times["end"] += time.perf_counter() - t2
                    if self.pool is not None:
                        self.pool.hold(self._graph)
                except CaptureError:
                    raise
                except RuntimeError as exc:
                    raise CaptureError(f"CUDA graph capture failed: {exc}") from exc
                return active.callbacks
        finally:
            torch.cuda.current_stream(device).wait_stream(stream)
            if enabled:
                gc.enable()

    def replay(self) -> None:
        """Launch the captured graph on the current stream."""
        if self._replayed:
            self._graph.replay()
            return
        t0 = time.perf_counter()
        self._graph.replay()
        self._replayed = True
        CudaStepGraph.host_seconds["first_replay"] += time.perf_counter() - t0


#: Operations that read a device value on the host (or have data-dependent
#: shapes): a CUDA graph cannot hold them.
_HOST_READS = frozenset(
    {
        "_local_scalar_dense",  # .item(), float(), int(), bool()
        "nonzero",
        "is_nonzero",
        "equal",
        "unique_consecutive",
        "_unique2",
        "masked_select",
    }
)


def _op_name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", None)
    return str(getattr(packet, "__name__", getattr(func, "__name__", str(func))))


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Executes and records every tensor operation (see the module notes)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[Callable[[], None]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = _op_name(func)
        if name in _HOST_READS:
            raise CaptureError(
                f"aten.{name} inside a captured step reads a device value on the host (or has "
                "a data-dependent shape): a CUDA graph cannot replay it"
            )
        out = func(*args, **kwargs)
        recorded = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]

        def replay() -> None:
            leaves = tree_leaves(func(*args, **kwargs))
            for leaf in leaves:
                # a collective (c10d.allreduce_, c10d.alltoall_base_, ...) returns its
                # Work: a captured NCCL collective is ordered on the stream; here the
                # replay waits for it before the next operation reads its output
                if isinstance(leaf, torch.ScriptObject) and hasattr(leaf, "wait"):
                    leaf.wait()
            fresh = [t for t in leaves if isinstance(t, torch.Tensor)]
            for dst, src in zip(recorded, fresh, strict=True):
                if dst is src or (
                    dst.data_ptr() == src.data_ptr()
                    and dst.shape == src.shape
                    and dst.stride() == src.stride()
                ):
                    continue  # in place, or a view of the same memory
                dst.copy_(src)

        self.ops.append(replay)
        return out


class EmulatedStepGraph:
    """The CPU emulation of a CUDA graph (see the module notes); any device."""

    executes_on_capture = True

    def __init__(self, pool: GraphPool | None = None) -> None:
        self._ops: list[Callable[[], None]] = []
        self.pool = pool  # (recorded only: tests check which captures share one)

    def capture(self, body: Callable[[], None]) -> list[Callable[[], bool]]:
        """Run ``body`` once, recording every tensor operation and external launch;
        returns its :func:`after_replay` callbacks."""
        recorder = _Recorder()
        with _activate(recorder) as active, recorder:
            body()
        self._ops = recorder.ops
        return active.callbacks

    @property
    def n_ops(self) -> int:
        """Operations recorded (torch operations and external launches)."""
        return len(self._ops)

    def replay(self) -> None:
        """Rerun the recorded operations in order (without autograd), writing into the
        tensors the capture produced."""
        with torch.no_grad():
            for op in self._ops:
                op()


_emulate = threading.local()


@contextmanager
def emulated_capture() -> Iterator[None]:
    """Within this context, :func:`make_step_graph` returns an
    :class:`EmulatedStepGraph` for CPU tensors too (tests: the capture path of a
    GPU run, on CPU)."""
    previous = getattr(_emulate, "on", False)
    _emulate.on = True
    try:
        yield
    finally:
        _emulate.on = previous


def can_capture(device: torch.device) -> bool:
    """Whether :func:`make_step_graph` gives a graph for ``device`` (cheap: callers
    ask it before any other work)."""
    return device.type == "cuda" or bool(getattr(_emulate, "on", False))


def make_step_graph(device: torch.device, pool: GraphPool | None = None) -> StepGraph | None:
    """The step graph for ``device``: a CUDA graph on CUDA, the emulation inside
    :func:`emulated_capture`, else None (nothing to capture). ``pool``: the
    memory it shares with earlier captures of its role (:class:`GraphPool`)."""
    if getattr(_emulate, "on", False):
        return EmulatedStepGraph(pool)
    if device.type == "cuda":  # pragma: no cover - CUDA only
        return CudaStepGraph(pool)
    return None
