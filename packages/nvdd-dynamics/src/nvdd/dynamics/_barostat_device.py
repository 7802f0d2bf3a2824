"""The MTK barostat's per-system arithmetic on the atoms' device.

:class:`~nvdd.dynamics.MTKNPT` keeps its cell momentum, cell and step sums in
float64 tensors on the atoms' device. Two pieces of its step are a few dozen
operations on a few numbers per system; each is one Warp kernel here (one
thread per system), launched from a recorded command, so a step reads nothing
on the host and can be captured in a CUDA graph:

``cell_kick``
    The cell momentum over ``d`` under the pressure difference (MTK's
    ``G_epsilon``): isotropic, one number per system (element 0 of its row);
    full, a symmetric 3x3.
``propagators``
    ``E = exp(G)`` and ``Phi = (exp(G) - 1) / G`` of the symmetric strain
    matrix ``G`` of a kick (the friction of the cell on the velocities) or a
    drift (the affine growth of positions and cell), by a Taylor series of
    degree 16 after scaling ``G`` to a norm <= 1/2, then squaring back
    (``Phi(2G) = Phi(G) (E(G) + 1) / 2``). No eigendecomposition: a batched
    ``eigh`` on CUDA waits for the host (it checks its convergence there).
    Isotropic strain is ``x * 1``, for which the series gives ``exp(x)`` and
    ``expm1(x) / x`` on the diagonal and exact zeros elsewhere.

A particle update is then ``y E + c z Phi`` per atom, one more kernel
(``affine_rows``, one thread per atom, float64 arithmetic, written back in the
batch's dtype, in place): velocities ``(v, F / m)`` over a kick, positions
``(r, v)`` over a drift; the cell's rows grow as ``h E``. As torch operations
that update was 13 launches over the atoms per kick or drift.
"""

from __future__ import annotations

from typing import Any

import torch
import warp as wp

from nvdd.core import capturing, record_launch, warp_stream
from nvdd.dynamics._barostat_kernels import (
    affine_rows_kernel,
    cell_kick_kernel,
    propagators_kernel,
)
from nvdd.dynamics._chain_device import warp_ready

__all__ = [
    "RowKernel",
    "SystemKernel",
    "affine_rows_kernel",
    "cell_kick_kernel",
    "propagators_kernel",
]

#: Warp's Python API, untyped for mypy (its stubs type the kernel language, not this use).
_wp: Any = wp
_F64 = _wp.float64


class RowKernel:
    """``affine_rows_kernel`` over the atoms: one recorded launch per dtype whose
    changed arguments (a new tensor, a new row count) are set before it runs;
    torch's current stream on CUDA; registered with an emulated capture; a
    plain launch on a test's fake device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # one record per dtype and role (a kick divides by the masses, a drift not)
        self._records: dict[tuple[torch.dtype, bool], tuple[Any, list[Any], int]] = {}

    def __call__(
        self,
        y: torch.Tensor,
        z: torch.Tensor,
        masses: torch.Tensor,
        system: torch.Tensor,
        e: torch.Tensor,
        phi: torch.Tensor,
        c: float,
        divide: bool,
        out: torch.Tensor,
    ) -> None:
        """``out = y E + c z Phi`` row by row (module notes); ``out`` may be ``y``."""
        n = int(y.shape[0])
        if n == 0:
            return
        args = (y, z, masses, system, e, phi, float(c), int(divide), int(e.shape[0] == 1), out)
        if self.device.type not in ("cpu", "cuda"):  # a test's fake device: a plain launch
            warp_ready()
            _wp.launch(affine_rows_kernel, dim=n, inputs=_warp_args(args),
                       device=_wp.device_from_torch(self.device))  # fmt: skip
            return
        keys = [_key(a) for a in args]
        role = (y.dtype, bool(divide))
        found = self._records.get(role)
        if found is None:
            _declare_rows()
            launch = _wp.launch(affine_rows_kernel, dim=n, inputs=_warp_args(args),
                                device=_wp.device_from_torch(self.device), record_cmd=True)  # fmt: skip
            found = self._records[role] = (launch, keys, n)
        launch, old, old_n = found
        for k, (new, was) in enumerate(zip(keys, old, strict=True)):
            if new != was:
                launch.set_param_at_index(k, _warp_args(args[k : k + 1])[0])
                old[k] = new
        if n != old_n:
            launch.set_dim(n)
            self._records[role] = (launch, old, n)
        self._run(launch)
        if (
            capturing()
        ):  # an emulated capture replays this call's arguments (a CUDA one records them)
            device = _wp.device_from_torch(self.device)
            record_launch(
                lambda: _wp.launch(
                    affine_rows_kernel, dim=n, inputs=_warp_args(args), device=device
                )
            )

    def _run(self, launch: Any) -> None:
        if self.device.type == "cuda":
            launch.launch(stream=warp_stream(torch.cuda.current_stream(self.device)))
        else:
            launch.launch()


def _key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (a.data_ptr(), tuple(a.shape), tuple(a.stride()), a.dtype)
    return (type(a), a)


def _warp_args(args: tuple[Any, ...]) -> list[Any]:
    return [
        _wp.from_torch(a, requires_grad=False) if isinstance(a, torch.Tensor)
        else _F64(a) if isinstance(a, float) else a
        for a in args
    ]  # fmt: skip


_ROWS_DECLARED: list[bool] = []


def _declare_rows() -> None:
    """The float32 and float64 overloads of ``affine_rows_kernel``, declared
    before the module's first launch (else Warp compiles the module twice)."""
    if _ROWS_DECLARED:
        return
    warp_ready()
    for scalar in (_wp.float32, _wp.float64):
        rows, column = _wp.array2d(dtype=scalar), _wp.array(dtype=scalar)
        _wp.overload(affine_rows_kernel, {"y": rows, "z": rows, "masses": column, "out": rows})
    _ROWS_DECLARED.append(True)


class SystemKernel:
    """One of this module's kernels over the systems of one integrator, with its
    tensors fixed: launched from a recorded command per set of scalars (a few
    microseconds of Python), on torch's current stream on CUDA; registered with
    an emulated capture; a plain launch on a test's fake device."""

    def __init__(self, kernel: Any, n_systems: int, device: torch.device) -> None:
        self.kernel, self.n_systems, self.device = kernel, int(n_systems), device
        self._records: dict[tuple[Any, ...], Any] = {}

    def __call__(self, *args: Any) -> None:
        """Launch with ``args`` (tensors, Python floats for ``float64``
        parameters, ints), the same tensors at every call."""
        key = tuple(a for a in args if not isinstance(a, torch.Tensor))
        launch = self._records.get(key)
        if launch is None and self.device.type in ("cpu", "cuda"):
            _declare_rows()  # (every overload of the module before its first launch)
            launch = self._records[key] = _wp.launch(
                self.kernel, dim=self.n_systems, inputs=self._inputs(args),
                device=_wp.device_from_torch(self.device), record_cmd=True,
            )  # fmt: skip
        self._run(launch, args)
        if capturing():  # an emulated capture replays the launch (a CUDA one records it)
            record_launch(lambda: self._run(launch, args))

    def _inputs(self, args: tuple[Any, ...]) -> list[Any]:
        return [
            _wp.from_torch(a, requires_grad=False) if isinstance(a, torch.Tensor)
            else _F64(a) if isinstance(a, float) else a
            for a in args
        ]  # fmt: skip

    def _run(self, launch: Any, args: tuple[Any, ...]) -> None:
        if self.device.type == "cuda":
            launch.launch(stream=warp_stream(torch.cuda.current_stream(self.device)))
        elif launch is not None:
            launch.launch()
        else:  # a test's fake device: a plain launch, which its checks see
            warp_ready()
            _wp.launch(self.kernel, dim=self.n_systems, inputs=self._inputs(args),
                       device=_wp.device_from_torch(self.device))  # fmt: skip
