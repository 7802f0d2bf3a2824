"""The elements a saved mace-torch model knows, read before any rank starts.

A ``.model`` file is a whole pickled ``torch.nn.Module``: loading it the way
mace-torch does imports mace-torch and e3nn (seconds) and runs code named in the
file. ``nvdd run`` only needs the model's ``atomic_numbers`` buffer to check a
structure's elements up front, so :func:`mace_file_elements` unpickles the file
with every class outside a few plain containers and torch's tensor rebuilders
replaced by an inert stand-in that only keeps its state: nothing from mace-torch
is imported, nothing from the file runs, and it takes a fraction of a second.
:func:`peek_mace_file` also tells a file that is no model (truncated, a state
dict, another library's object) from one that is, so ``nvdd run`` refuses it
before launch, naming the file.
"""

from __future__ import annotations

import pickle
import types
import warnings
from pathlib import Path
from typing import Any

__all__ = ["mace_file_elements", "peek_mace_file"]

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


def peek_mace_file(path: str | Path) -> list[int] | None:
    """Open the saved model ``path`` without running it and say what it is.

    Returns the atomic numbers the model was built for, or None when it is
    recognised as a mace-torch model (a pickled ``mace.*`` module, or a
    TorchScript archive) but they cannot be read.

    Raises
    ------
    ValueError
        With a one-line reason when the file is no saved model: not a
        ``torch.save`` file at all (truncated, another format), or one holding
        something else (a state dict, a tensor, another library's object).
    """
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            obj = torch.load(  # nosec B614 - the pickle's classes are never resolved
                str(path), map_location="cpu", weights_only=False, pickle_module=_PICKLE
            )
        except Exception as exc:  # whatever a damaged or foreign file raises
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            first = detail.splitlines()[0].split(". ")[0][:200]
            raise ValueError(
                f"not a model saved with torch.save (truncated or another format: {first})"
            ) from None
    kind = type(obj)
    module = getattr(kind, "__module__", "") or ""
    scripted = isinstance(obj, torch.jit.ScriptModule)
    if not (scripted or (isinstance(obj, _Inert) and module.split(".")[0] == "mace")):
        what = f"{module}.{kind.__name__}" if isinstance(obj, _Inert) else kind.__name__
        hint = " (weights only? save the whole model)" if isinstance(obj, dict) else ""
        raise ValueError(f"holds a {what}, not a mace-torch model{hint}")
    numbers = _buffers(obj).get("atomic_numbers")
    if numbers is None and isinstance(getattr(obj, "atomic_numbers", None), torch.Tensor):
        numbers = obj.atomic_numbers  # a TorchScript archive, loaded by torch.jit
    if isinstance(numbers, torch.Tensor) and numbers.ndim == 1 and numbers.numel():
        return [int(z) for z in numbers.tolist()]
    return None


def mace_file_elements(path: str | Path) -> list[int] | None:
    """The atomic numbers a saved mace-torch model was built for, or None when the
    file cannot be read without loading the model for real (local, cheap)."""
    try:
        return peek_mace_file(path)
    except (ValueError, ImportError):
        return None
