"""Warp plumbing of the package's kernels: lazy set-up, tensor views and cheap launches.

``warp`` is imported and initialised on first use, never at import time of
``nvdd.models``. A :class:`Kernel` records one Warp launch per (device, dtype)
and replays it, resetting only the arguments that changed since the last call
(a replay costs a few microseconds of Python, a fresh ``wp.launch`` about five
times more). Launches go to torch's current stream on CUDA, so they order with
the surrounding torch work (and can be captured in a CUDA graph); inside an
emulated capture (``nvdd.core.EmulatedStepGraph``) each launch is also
registered for replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import torch

from nvdd.core import ConfigurationError, capturing, record_launch, warp_stream

__all__ = ["Kernel", "declare_overloads", "warp_module"]

_INSTALL_HINT = "pip install 'warp-lang>=1.5'"


@cache
def warp_module() -> Any:
    """The initialised ``warp`` module (imported on first use)."""
    try:
        import warp
    except ImportError as exc:  # pragma: no cover - warp is a declared dependency
        raise ConfigurationError(
            f"the Warp backend of nvdd.models needs warp-lang ({_INSTALL_HINT})"
        ) from exc
    wp: Any = warp  # Warp's stubs type its kernel language, not this use
    wp.config.quiet = True
    wp.init()
    return wp


def _arg_key(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype)
    return (type(value), value)


_SCALARS = {torch.float32: "float32", torch.float64: "float64"}


class Kernel:
    """A Warp kernel with recorded launches (one per device and argument dtypes).

    Parameters
    ----------
    kernel:
        The ``@wp.kernel``; its ``Any``-typed arguments are float arrays or
        float scalars.
    floats:
        Positions of the arguments that are Python floats standing for a scalar
        of the kernel's float type (cast to it here).
    doubles:
        Positions of Python float arguments of a ``wp.float64`` parameter (Warp
        would take a bare Python float for a float32).

    Notes
    -----
    The float32 and float64 overloads of every kernel of a Warp module must be
    declared before the module's first launch, or Warp compiles it once per
    overload: :func:`declare_overloads` does that for a group of kernels.

    A recorded launch keeps its last arguments alive; create one ``Kernel`` per
    owner (a neighbour list, a model) so that they go with it.
    """

    def __init__(
        self, kernel: Any, floats: Sequence[int] = (), doubles: Sequence[int] = ()
    ) -> None:
        self._kernel = kernel
        self._floats = tuple(floats)
        self._doubles = tuple(doubles)
        self._records: dict[tuple[object, ...], tuple[Any, list[object], object]] = {}

    @property
    def kernel(self) -> Any:
        """The Warp kernel."""
        return self._kernel

    def declare_overloads(self) -> None:
        """Declare the float32 and float64 overloads of the kernel (once per process)."""
        if self._kernel in _DECLARED:
            return
        wp = warp_module()
        for name in ("float32", "float64"):
            scalar = getattr(wp, name)
            types: dict[str, Any] = {}
            for arg in self._kernel.adj.args:
                generic = getattr(arg.type, "dtype", arg.type)
                if generic is not Any:
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
        dtype: torch.dtype,
    ) -> None:
        """Launch over ``dim`` threads with ``args`` (tensors or scalars) on ``device``.

        ``dtype`` is the float type of the launch (float32 or float64). Nothing
        runs when ``dim`` has a zero.
        """
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        if min(dims) == 0:
            return
        wp = warp_module()
        scalar = getattr(wp, _SCALARS[dtype])
        values = [
            scalar(a) if k in self._floats else wp.float64(a) if k in self._doubles else a
            for k, a in enumerate(args)
        ]
        keys = [_arg_key(a) for a in args]
        signature = (
            device,
            dtype,
            *(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args),
        )
        record = self._records.get(signature)
        if record is None:
            launch = wp.launch(
                self._kernel,
                dim=dim,
                inputs=[_to_warp(wp, v) for v in values],
                device=wp.device_from_torch(device),
                record_cmd=True,
            )
            record = (launch, keys, dim)
            self._records[signature] = record
        else:
            launch, old_keys, old_dim = record
            for k, (new, old) in enumerate(zip(keys, old_keys, strict=True)):
                if new != old:
                    launch.set_param_at_index(k, _to_warp(wp, values[k]))
                    old_keys[k] = new
            if dim != old_dim:
                launch.set_dim(dim)
                self._records[signature] = (launch, old_keys, dim)
        launch = record[0]
        if device.type == "cuda":
            launch.launch(stream=warp_stream(torch.cuda.current_stream(device)))
        else:
            launch.launch()
        if capturing():  # an emulated step capture replays this launch (a CUDA one records it)
            record_launch(_relaunch(wp, self._kernel, dim, values, device))


#: Warp kernels whose overloads are declared (module-level kernels: never freed).
_DECLARED: list[Any] = []


def declare_overloads(*kernels: Kernel) -> None:
    """Declare the float overloads of ``kernels`` (before the first launch of their module)."""
    for kernel in kernels:
        kernel.declare_overloads()


def _relaunch(
    wp: Any, kernel: Any, dim: int | tuple[int, ...], values: list[object], device: torch.device
) -> Any:
    """A fresh launch of ``kernel`` with these arguments (for an emulated capture)."""
    args = list(values)

    def launch() -> None:
        wp.launch(kernel, dim=dim, inputs=[_to_warp(wp, v) for v in args],
                  device=wp.device_from_torch(device))  # fmt: skip

    return launch


def _to_warp(wp: Any, value: object) -> object:
    if isinstance(value, torch.Tensor):
        return wp.from_torch(value, requires_grad=False)
    return value
