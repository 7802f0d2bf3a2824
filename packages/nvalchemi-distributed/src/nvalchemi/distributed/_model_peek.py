"""The elements a saved mace-torch model knows, read before any rank starts.

A ``.model`` file is a whole pickled ``torch.nn.Module``: loading it the way
mace-torch does imports mace-torch and e3nn (seconds) and runs code named in the
file. ``nvdd run`` only needs the model's ``atomic_numbers`` buffer to check a
structure's elements up front, so :func:`mace_file_elements` unpickles the file
with every class outside a few plain containers and torch's tensor rebuilders
replaced by an inert stand-in that only keeps its state: nothing from mace-torch
is imported, nothing from the file runs, and it takes a fraction of a second.
Whatever it cannot read (another layout, a TorchScript archive that does not
load) gives None, and the check is left to the ranks, which load the model for real.
"""

from __future__ import annotations

import contextlib
import pickle
import types
import warnings
from pathlib import Path
from typing import Any

__all__ = ["mace_file_elements"]

#: Globals the peek resolves for real: torch's tensor and storage rebuilders and
#: plain containers (what ``torch.load`` needs to give tensors back).
_REAL = {
    ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch", "Size"),
    ("torch", "device"),
}


class _Inert:
    """Stands for any class the peek does not resolve: built with any arguments,
    keeps the state pickled for it and does nothing else."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        object.__setattr__(self, "_pickled_state", state)

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()


def _resolve(module: str, name: str) -> Any:
    import torch

    if (module, name) in _REAL:
        return getattr(__import__(module, fromlist=[name]), name)
    if module == "torch" and (
        name.endswith("Storage") or isinstance(getattr(torch, name, None), torch.dtype)
    ):
        return getattr(torch, name)
    return type(name, (_Inert,), {"__module__": module})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _resolve(module, name)


_PICKLE = types.SimpleNamespace(
    Unpickler=_Unpickler,
    load=lambda file, **kwargs: _Unpickler(file, **kwargs).load(),
    __name__="nvalchemi.distributed._model_peek",
)


def _buffers(obj: Any) -> dict[str, Any]:
    state = getattr(obj, "_pickled_state", None)
    if isinstance(state, tuple):  # (state, slotstate)
        state = state[0]
    buffers = state.get("_buffers") if isinstance(state, dict) else None
    return buffers if isinstance(buffers, dict) else {}


def mace_file_elements(path: str | Path) -> list[int] | None:
    """The atomic numbers a saved mace-torch model was built for, or None when the
    file cannot be read without loading the model for real (local, cheap)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obj = torch.load(  # nosec B614 - the pickle's classes are never resolved
            str(path), map_location="cpu", weights_only=False, pickle_module=_PICKLE
        )
        numbers = _buffers(obj).get("atomic_numbers")
        if numbers is None and isinstance(getattr(obj, "atomic_numbers", None), torch.Tensor):
            numbers = obj.atomic_numbers  # a TorchScript archive, loaded by torch.jit
        if isinstance(numbers, torch.Tensor) and numbers.ndim == 1 and numbers.numel():
            return [int(z) for z in numbers.tolist()]
    return None
