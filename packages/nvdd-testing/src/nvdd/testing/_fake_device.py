"""A fake accelerator on the CPU: catches device mixing without a GPU.

CI has no GPU, so code that mixes an accelerator tensor with a CPU tensor (a
CUDA cell next to CPU boxes, a CPU flag handed to an NCCL collective, a Warp
launch on the wrong device) passes every CPU test and crashes on the first
multi-GPU run. :func:`fake_accelerator` makes that class of bug visible on the
CPU: inside it, tensors created on (or moved to) the ``meta`` device are
:class:`FakeDeviceTensor` wrappers that report ``device == meta`` but hold real
CPU data, so every value, every ``.item()`` and every collective is computed
for real, while each operator checks device placement the way CUDA does:

- an operator mixing a fake-device tensor with a CPU tensor of one or more
  dimensions raises ``RuntimeError("Expected all tensors to be on the same
  device ...")`` (CPU 0-dim tensors are allowed, as CUDA allows them; so are CPU
  index tensors in advanced indexing, and cross-device ``copy_``);
- ``.numpy()`` of a fake tensor raises, as it does for a CUDA tensor;
- collectives emulate NCCL: ``nvdd.core.comm_device`` returns the fake device,
  and ``torch.distributed`` collectives refuse tensors that are not on it (then
  run gloo on the wrapped CPU data);
- Warp launches on the fake device run on Warp's CPU device and refuse arrays
  made from CPU tensors.

The harness is for tests only: it patches ``torch.distributed``, Warp and the
every loaded module's reference to ``nvdd.core.comm_device`` for the duration of the
``with`` block and restores them on exit.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from nvdd.core import Batch

__all__ = [
    "FAKE_DEVICE",
    "DeviceMixingError",
    "FakeDeviceTensor",
    "fake_accelerator",
    "record_host_syncs",
    "to_fake",
]

#: The device fake-accelerator tensors report.
FAKE_DEVICE = torch.device("meta")

_aten = torch.ops.aten
#: Operators CUDA runs with CPU tensors among the inputs.
_CROSS_DEVICE_OK = {
    _aten._to_copy.default,
    _aten.copy_.default,
    _aten.lift_fresh.default,
    _aten.lift_fresh_copy.default,
}
#: Advanced indexing: CUDA accepts CPU index tensors (``self`` must be on the device).
_INDEXING = {
    _aten.index.Tensor,
    _aten.index_put_.default,
    _aten.index_put.default,
    _aten._index_put_impl_.default,
}
_COLLECTIVES = (
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather",
    "reduce",
    "send",
    "recv",
)


#: Operators whose output shape depends on device data (a CUDA host synchronisation).
_DATA_SHAPED = {
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
}
#: The open :func:`record_host_syncs` log (None: not recording).
_SYNC_LOG: list[str] | None = None


@contextmanager
def record_host_syncs() -> Iterator[list[str]]:
    """Record every operation on the fake accelerator that would synchronise a
    CUDA device with the host.

    Use inside :func:`fake_accelerator`. Yields a list that grows by one
    description per event (the operation, and the innermost ``nvdd`` source
    line that caused it): a copy between the host and the fake device in either
    direction (a host-to-device copy from pageable memory waits for the stream
    as well), a scalar read (``.item()``, ``int(t)``, ``bool(t)``), ``tolist``,
    and operators whose output shape depends on device data (``nonzero``,
    boolean-mask indexing, ``unique``). CPU-only work is not recorded.
    """
    global _SYNC_LOG
    previous, _SYNC_LOG = _SYNC_LOG, []
    try:
        yield _SYNC_LOG
    finally:
        _SYNC_LOG = previous


def _record(what: str) -> None:
    if _SYNC_LOG is None:
        return
    import traceback

    where = "?"
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/nvdd/" in frame.filename and "/testing/" not in frame.filename:
            where = f"{frame.filename.split('/nvdd/')[-1]}:{frame.lineno} ({frame.name})"
            break
    _SYNC_LOG.append(f"{what} at {where}")


def _note_sync(func: Any, args: Any, kwargs: dict[str, Any], to_device: bool) -> None:
    """Log ``func`` in :data:`_SYNC_LOG` if it would synchronise a CUDA device."""
    first = args[0] if args else None
    if func is _aten._to_copy.default:
        target = kwargs.get("device")
        if (
            to_device
            and isinstance(first, torch.Tensor)
            and not isinstance(first, FakeDeviceTensor)
        ):
            _record(f"host-to-device copy of {first.numel()} values")
        elif isinstance(first, FakeDeviceTensor) and target is not None and not to_device:
            _record(f"device-to-host copy of {first.numel()} values")
    elif func is _aten.copy_.default:
        src = args[1]
        dst_fake, src_fake = isinstance(first, FakeDeviceTensor), isinstance(src, FakeDeviceTensor)
        if dst_fake and not src_fake and isinstance(src, torch.Tensor) and src.dim() > 0:
            _record(f"host-to-device copy of {src.numel()} values")
        elif src_fake and not dst_fake:
            _record(f"device-to-host copy of {src.numel()} values")
    elif isinstance(first, FakeDeviceTensor):
        if func is _aten._local_scalar_dense.default:
            _record("scalar read")
        elif func in _DATA_SHAPED:
            _record(f"{func._schema.name} (data-dependent shape)")
        elif func in _INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        ):
            _record("boolean-mask indexing (data-dependent shape)")


class DeviceMixingError(RuntimeError):
    """An operation mixed the fake accelerator with the CPU (CUDA would refuse it)."""


class FakeDeviceTensor(torch.Tensor):
    """A tensor that reports :data:`FAKE_DEVICE` and holds real CPU data (``elem``)."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> FakeDeviceTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=FAKE_DEVICE,
            requires_grad=elem.requires_grad,
        )
        out.elem = elem
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FakeDeviceTensor({self.elem!r})"

    # Python sequences used as indices or data are turned into tensors inside C++
    # below the Python dispatcher, straight onto the meta device (their values
    # lost); make them CPU tensors first, as CUDA indexing accepts them.
    def __getitem__(self, index: Any) -> Any:
        return super().__getitem__(_host_index(index))

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(_host_index(index), value)

    def new_tensor(self, data: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        """A tensor of ``data`` with this tensor's dtype, on its (fake) device unless
        ``device`` is given (the data never goes through the meta device)."""
        kwargs.setdefault("dtype", self.dtype)
        device = kwargs.pop("device", self.device)
        return torch.tensor(data, **kwargs).to(device)

    def tolist(self) -> Any:
        """The values, as for a CUDA tensor (a host read)."""
        _record("tolist")
        return self.elem.tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        """Refused, as for a CUDA tensor: move it to the CPU first."""
        raise DeviceMixingError(
            "can't convert a fake-accelerator tensor to numpy: call .cpu() first (a CUDA "
            "tensor would fail here too)"
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return _dispatch(func, args, kwargs)


def _host_index(index: Any) -> Any:
    if isinstance(index, tuple):
        return tuple(_host_index(i) for i in index)
    if isinstance(index, list):
        return torch.tensor(index)
    return index


def _unwrap_all(tree: Any) -> Any:
    return tree_map(lambda t: t.elem if isinstance(t, FakeDeviceTensor) else t, tree)


def _is_device(dev: Any) -> bool:
    return dev is not None and torch.device(dev).type == FAKE_DEVICE.type


def _wrap(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, FakeDeviceTensor):
        return FakeDeviceTensor(x)
    return x


def _dispatch(func: Any, args: Any, kwargs: Any) -> Any:
    """Run ``func`` on the wrapped CPU data, checking device placement like CUDA."""
    kwargs = dict(kwargs or {})
    if func._schema.name.startswith("c10d::"):
        # Process-group internals (collectives were checked and unwrapped above).
        return func(*_unwrap_all(args), **_unwrap_all(kwargs))
    on_device: list[bool] = []
    host_shapes: list[tuple[int, ...]] = []

    def unwrap(x: Any) -> Any:
        if isinstance(x, FakeDeviceTensor):
            on_device.append(True)
            return x.elem
        if isinstance(x, torch.Tensor):
            if x.device.type == FAKE_DEVICE.type:
                raise DeviceMixingError(f"{func}: a real meta tensor reached the fake device")
            if x.dim() > 0:
                on_device.append(False)
                host_shapes.append(tuple(x.shape))
        return x

    if func in _INDEXING:
        # self (and values) decide; CPU indices are allowed.
        head = [unwrap(args[0])]
        rest = list(args[1:])
        idx = _unwrap_all(rest[0])
        more = tree_map(unwrap, rest[1:])
        call_args: Any = (*head, idx, *more)
    else:
        call_args = tree_map(unwrap, args)
    call_kwargs = tree_map(unwrap, kwargs)
    target = call_kwargs.get("device")
    to_device = _is_device(target)
    if _SYNC_LOG is not None:
        _note_sync(func, args, call_kwargs, to_device)
    if to_device:
        call_kwargs["device"] = torch.device("cpu")
    if True in on_device and False in on_device and func not in _CROSS_DEVICE_OK:
        raise DeviceMixingError(
            f"{func}: Expected all tensors to be on the same device, but found at least two "
            f"devices, {FAKE_DEVICE} (the fake accelerator) and cpu (CPU tensors of shapes "
            f"{host_shapes})"
        )
    out = func(*call_args, **call_kwargs)
    if func._schema.is_mutable:
        # In place: the wrapped data changed; hand back the caller's tensor.
        return kwargs["out"] if "out" in kwargs else args[0]
    if func is _aten._to_copy.default:
        fake = to_device or (target is None and True in on_device)
    else:
        fake = to_device or True in on_device
    return tree_map(_wrap, out) if fake else out


class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Sends every operator (factories included) through :func:`_dispatch`."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _dispatch(func, args, kwargs)


def to_fake(x: Any) -> Any:
    """``x`` (a tensor or a :class:`~nvdd.core.Batch`) on the fake accelerator.

    Call inside :func:`fake_accelerator`.
    """
    if isinstance(x, Batch):
        return x.to(FAKE_DEVICE)
    if isinstance(x, torch.Tensor):
        return x.to(FAKE_DEVICE)
    raise TypeError(f"to_fake takes a tensor or a Batch, got {type(x).__name__}")


def _check_collective(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def collective(*args: Any, **kwargs: Any) -> Any:
        tensors: list[torch.Tensor] = []
        tree_map(lambda t: tensors.append(t) if isinstance(t, torch.Tensor) else None, args)
        tree_map(lambda t: tensors.append(t) if isinstance(t, torch.Tensor) else None, kwargs)
        host = [tuple(t.shape) for t in tensors if not isinstance(t, FakeDeviceTensor)]
        if host:
            raise DeviceMixingError(
                f"torch.distributed.{name} got CPU tensors of shapes {host}: under NCCL every "
                "tensor of a collective must be on the rank's CUDA device (use "
                "nvdd.core.comm_device(group))"
            )
        return original(*_unwrap_all(args), **_unwrap_all(kwargs))

    collective.__wrapped__ = original  # type: ignore[attr-defined]
    return collective


def _fake_comm_device(group: Any = None) -> torch.device:
    return FAKE_DEVICE


def _patch(stack: ExitStack, owner: Any, name: str, value: Any) -> None:
    old = getattr(owner, name)
    setattr(owner, name, value)
    stack.callback(setattr, owner, name, old)


def _from_data(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.tensor`` and friends: data onto the fake device through the CPU."""

    def make(data: Any, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if not _is_device(device):
            return original(data, *args, **kwargs)
        kwargs["device"] = "cpu"
        grad = bool(kwargs.pop("requires_grad", False))
        if isinstance(data, FakeDeviceTensor):
            data = data.elem
        out = original(data, *args, **kwargs).to(FAKE_DEVICE)
        return out.requires_grad_(True) if grad else out

    return make


def _patch_comm_device(stack: ExitStack) -> None:
    from nvdd.core import _distributed

    original = _distributed.comm_device
    for module in list(sys.modules.values()):
        try:
            names = list(vars(module).items())
        except TypeError:  # pragma: no cover - odd module objects
            continue
        for attr, value in names:
            if value is original:
                _patch(stack, module, attr, _fake_comm_device)


def _patch_warp(stack: ExitStack) -> None:
    try:
        import warp as wp
    except ImportError:  # pragma: no cover - warp is optional here
        return
    host_arrays: set[int] = set()
    from_torch, device_from_torch, launch = wp.from_torch, wp.device_from_torch, wp.launch

    def fake_from_torch(t: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(t, FakeDeviceTensor):
            return from_torch(t.elem, *args, **kwargs)
        arr = from_torch(t, *args, **kwargs)
        host_arrays.add(id(arr))
        return arr

    def fake_device_from_torch(device: Any) -> Any:
        if _is_device(device):
            return wp.get_device("cpu").alias
        return device_from_torch(device)

    def fake_launch(kernel: Any, *args: Any, **kwargs: Any) -> Any:
        inputs = list(kwargs.get("inputs", ())) + list(kwargs.get("outputs", ()))
        mixed = [k for k, a in enumerate(inputs) if id(a) in host_arrays]
        if mixed and _launching_on_fake[0]:
            raise DeviceMixingError(
                f"Warp kernel {getattr(kernel, 'key', kernel)}: inputs {mixed} were made from "
                "CPU tensors but the launch is on the fake accelerator"
            )
        return launch(kernel, *args, **kwargs)

    _launching_on_fake = [False]

    def tracking_device_from_torch(device: Any) -> Any:
        _launching_on_fake[0] = _is_device(device)
        return fake_device_from_torch(device)

    _patch(stack, wp, "from_torch", fake_from_torch)
    _patch(stack, wp, "device_from_torch", tracking_device_from_torch)
    _patch(stack, wp, "launch", fake_launch)


@contextmanager
def fake_accelerator() -> Iterator[torch.device]:
    """Run the block with a fake accelerator that catches device mixing.

    Yields :data:`FAKE_DEVICE`; move a batch there with :func:`to_fake` (or
    ``batch.to(device)``) and run the code under test unchanged. Inside the
    block, a process group (gloo) behaves like NCCL as far as devices go. Not
    thread-safe; nests with nothing else that patches ``torch.distributed``
    for the whole block.

    Raises
    ------
    DeviceMixingError
        From the operator, collective or Warp launch that mixed devices.
    """
    with ExitStack() as stack:
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                _patch(stack, dist, name, _check_collective(name, getattr(dist, name)))
        _patch_comm_device(stack)
        _patch_warp(stack)
        for name in ("tensor", "as_tensor", "asarray"):
            _patch(stack, torch, name, _from_data(getattr(torch, name)))
        stack.enter_context(_Mode())  # type: ignore[no-untyped-call]
        yield FAKE_DEVICE
