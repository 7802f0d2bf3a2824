"""Warp kernels launched from recorded commands: the host cost of a launch that repeats.

A fresh ``wp.launch`` converts every argument and resolves the kernel's
overload: about 117 us of host time on an H200, against about 28 us for a
launch recorded once and replayed (``benchmarks/micro_warp_launch.py``). A
:class:`RecordedKernel` keeps one recorded launch per signature (device, float
type, argument dtypes and ranks, and an optional role of the caller's) and,
on each call, resets only the arguments whose identity changed (a new tensor,
a new shape, a new scalar). A changed tensor is handed to Warp as an array
descriptor built straight from the tensor (pointer, shape, byte strides),
not through ``wp.from_torch``: a launch with five new tensors costs 37.6
instead of 61.6 us of host time on the CI CPU
(``benchmarks/micro_warp_launch.py --device cpu``). That matters at a halo
rebuild, where every buffer is new (about 90 converted tensor arguments per
rebuild step before).

Launches go to torch's current stream on CUDA (they order with the
surrounding torch work and are recorded by a CUDA graph capture); inside an
emulated capture (:func:`~nvdd.core.emulated_capture`) each launch is also
registered for replay. On any other device (a test's fake accelerator) every
call is a plain ``wp.launch`` with converted arguments, which that harness
checks. nvdd-core does not depend on Warp: the import happens at the first
call, made only by packages that depend on warp-lang.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from nvdd.core._capture import capturing, record_launch
from nvdd.core._quiet import init_warp
from nvdd.core._warp_stream import warp_stream

__all__ = ["RecordedKernel"]

_SCALARS = {torch.float32: "float32", torch.float64: "float64"}
#: Warp kernels whose float32 and float64 overloads are declared.
_DECLARED: list[Any] = []
_WARP: list[Any] = []
#: Warp's array descriptor type (``warp.types.array_t`` up to 1.9, private in
#: ``warp._src.types`` since); None: changed tensors go through ``wp.from_torch``.
_ARRAY_T: list[Any] = []


def _warp() -> Any:
    if not _WARP:
        wp = init_warp()  # quiet unless NVDD_VERBOSE=1
        found = getattr(wp.types, "array_t", None)
        if found is None:
            try:
                found = importlib.import_module("warp._src.types").array_t
            except (ImportError, AttributeError):  # pragma: no cover - other Warp layouts
                found = None
        _ARRAY_T.append(found)
        _WARP.append(wp)
    return _WARP[0]


def _keys(args: Sequence[object]) -> tuple[list[object], tuple[object, ...]]:
    """The identity of every argument (a tensor's pointer, shape, strides and
    dtype; a scalar's type and value: what a record holds) and their kinds (a
    tensor's dtype and rank; a scalar's type: what selects the record), in one
    pass over ``args`` (a launch's host cost is mostly per argument)."""
    keys: list[object] = []
    kinds: list[object] = []
    for a in args:
        if isinstance(a, torch.Tensor):  # (torch.Size is a tuple: compared as one)
            shape, dt = a.shape, a.dtype
            keys.append((a.data_ptr(), shape, a.stride(), dt))
            kinds.append((dt, len(shape)))
        else:
            keys.append((type(a), a))
            kinds.append(type(a))
    return keys, tuple(kinds)


def _descriptor(array_t: Any, t: torch.Tensor) -> Any:
    """Warp's array descriptor of ``t`` (no ``wp.array`` object in between)."""
    size = t.element_size()
    return array_t(t.data_ptr(), 0, t.dim(), tuple(t.shape), tuple([s * size for s in t.stride()]))


def _converted(wp: Any, value: object) -> object:
    if isinstance(value, torch.Tensor):
        return wp.from_torch(value, requires_grad=False)
    return value


class RecordedKernel:
    """A Warp kernel launched from recorded commands (see the module notes).

    Parameters
    ----------
    kernel:
        The ``@wp.kernel``.
    floats:
        Positions of Python float arguments cast to the launch's float type
        (the ``dtype`` of the call): a kernel's ``Any``-typed scalars.
    doubles:
        Positions of Python float arguments cast to ``wp.float64``.
    prepare:
        Called once, before this instance's first launch (for example, to
        declare the overloads of the kernel's module).

    Notes
    -----
    A record holds its first call's tensors (as Warp arrays) until a later
    call replaces them; replaced arguments are raw descriptors, which keep no
    tensor alive (Warp 1.19 drops the array it held), so a launch never
    outlives its tensors: every call passes them again and a replay without
    a call never happens. Create one instance per owner of the tensors (a
    neighbour list, a model, an integrator) so that the first call's go with it.
    """

    def __init__(
        self,
        kernel: Any,
        *,
        floats: Sequence[int] = (),
        doubles: Sequence[int] = (),
        prepare: Callable[[], object] | None = None,
    ) -> None:
        self._kernel = kernel
        self._floats = frozenset(floats)
        self._doubles = frozenset(doubles)
        self._prepare = prepare
        self._records: dict[tuple[object, ...], tuple[Any, list[object], object]] = {}

    @property
    def kernel(self) -> Any:
        """The Warp kernel."""
        return self._kernel

    @property
    def recorded(self) -> int:
        """How many launches this instance has recorded (one per signature and role)."""
        return len(self._records)

    def declare_overloads(self) -> None:
        """Declare the float32 and float64 overloads of the kernel's ``Any``-typed
        arguments (once per process). Declare every kernel of a Warp module
        before the module's first launch, or Warp compiles it once per overload."""
        if self._kernel in _DECLARED:
            return
        wp = _warp()
        for name in ("float32", "float64"):
            scalar = getattr(wp, name)
            types: dict[str, Any] = {}
            for arg in self._kernel.adj.args:
                if getattr(arg.type, "dtype", arg.type) is not Any:
                    continue
                ndim = getattr(arg.type, "ndim", 0)
                types[arg.label] = wp.array(dtype=scalar, ndim=ndim) if ndim else scalar
            wp.overload(self._kernel, types)
        _DECLARED.append(self._kernel)

    def __call__(
        self,
        dim: int | tuple[int, ...],
        args: Sequence[object],
        device: torch.device,
        dtype: torch.dtype | None = None,
        *,
        role: Hashable = None,
    ) -> None:
        """Launch over ``dim`` threads with ``args`` (tensors or scalars) on ``device``.

        ``dtype`` is the launch's float type (float32 or float64; needed with
        ``floats``); ``role`` keeps a separate recorded launch per value (a
        caller alternating two sets of tensors avoids resetting them). Nothing
        runs when ``dim`` has a zero.
        """
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        if min(dims) == 0:
            return
        wp = _WARP[0] if _WARP else _warp()
        if device.type == "cuda" and device.index is None:  # (Warp needs the ordinal)
            device = torch.device("cuda", torch.cuda.current_device())
        prepare = self._prepare
        if prepare is not None:
            self._prepare = None
            prepare()
        if device.type not in ("cpu", "cuda"):  # a test's fake device: its checks see it
            self._plain(wp, dim, self._cast(wp, args, dtype), device)
            return
        keys, kinds = _keys(args)
        signature = (device, dtype, role, kinds)
        found = self._records.get(signature)
        if found is None:
            launch = wp.launch(
                self._kernel,
                dim=dim,
                inputs=[_converted(wp, v) for v in self._cast(wp, args, dtype)],
                device=wp.device_from_torch(device),
                record_cmd=True,
            )
            found = self._records[signature] = (launch, keys, dim)
        else:
            launch, held, held_dim = found
            array_t = _ARRAY_T[0]
            for k, (new, old) in enumerate(zip(keys, held, strict=True)):
                if new != old:  # (only a changed argument is cast and converted)
                    value = args[k]
                    if isinstance(value, torch.Tensor) and array_t is not None:
                        launch.set_param_at_index_from_ctype(k, _descriptor(array_t, value))
                    else:
                        value = self._cast_one(wp, k, value, dtype)
                        launch.set_param_at_index(k, _converted(wp, value))
                    held[k] = new
            if dim != held_dim:
                launch.set_dim(dim)
                self._records[signature] = (launch, held, dim)
        launch = found[0]
        if device.type == "cuda":
            launch.launch(stream=warp_stream(torch.cuda.current_stream(device)))
        else:
            launch.launch()
        if capturing():  # an emulated capture replays this launch (a CUDA one records it)
            values = self._cast(wp, args, dtype)
            record_launch(lambda: self._plain(wp, dim, values, device))

    def _cast(self, wp: Any, args: Sequence[object], dtype: torch.dtype | None) -> list[object]:
        """Every argument as the kernel takes it (:meth:`_cast_one`)."""
        if not self._floats and not self._doubles:
            return list(args)
        return [self._cast_one(wp, k, a, dtype) for k, a in enumerate(args)]

    def _cast_one(self, wp: Any, k: int, a: object, dtype: torch.dtype | None) -> object:
        """Argument ``k`` as the kernel takes it: a float of ``floats`` in the
        launch's float type, one of ``doubles`` as ``wp.float64``, else as given."""
        if k in self._floats:
            if dtype is None:
                raise TypeError(
                    f"{self._kernel.key}: argument {k} is cast to the launch's float type, "
                    "but no dtype was given"
                )
            return getattr(wp, _SCALARS[dtype])(a)
        if k in self._doubles:
            return wp.float64(a)
        return a

    def _plain(
        self, wp: Any, dim: int | tuple[int, ...], values: list[object], device: torch.device
    ) -> None:
        wp.launch(self._kernel, dim=dim, inputs=[_converted(wp, v) for v in values],
                  device=wp.device_from_torch(device))  # fmt: skip
