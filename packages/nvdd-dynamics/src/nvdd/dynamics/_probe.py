"""`ModuleProbe`: record every submodule's per-atom inputs and outputs in one forward.

Used by ``trace_and_validate`` on both sides (single process and every rank).
What it copes with, because real models have it:

- **TorchScript modules** (a scripted model, e3nn's generated kernels inside
  every ``o3.Linear`` / ``TensorProduct``): ``register_forward_hook`` is not
  supported on them. They are not hooked; their nearest Python ancestor is,
  and sees the same per-atom tensors. A model that is TorchScript from the root
  down has no hookable submodule: outputs are still compared, per-module
  diagnostics are reported as unavailable (:attr:`ModuleProbe.not_probed`).
- **Tuple, list and dict outputs** (a MACE interaction returns
  ``(node_feats, sc)``, MACE itself a dict): every per-atom tensor inside is
  recorded under ``"[k]"`` / ``"['key']"``.
- **Keyword inputs** (MACE calls its blocks with keywords): pre-hooks take
  ``with_kwargs=True``.
- **Custom ops and compiled code** inside a module need nothing: only module
  boundaries are observed.

Each recorded input remembers which module produced it (by tensor identity),
so a module that reads stale ghost rows can name the module whose output
should have been refreshed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

__all__ = ["Call", "ModuleProbe", "per_atom_tensors"]


@dataclass
class Call:
    """One module's first call: its per-atom inputs and outputs (CPU copies).

    Attributes
    ----------
    name:
        The module's name in ``model.named_modules()``.
    start, end:
        Positions of the call's start and end on the probe's clock.
    inputs, outputs:
        ``{key: tensor}``, every tensor ``shape (rows, ...)`` with all rows
        (``[owned | ghost]`` under DD). Input keys are argument positions
        (``"0"``) or keyword names; output keys ``""`` (a tensor), ``"[k]"`` or
        ``"['key']"``.
    producers:
        ``{input key: "module[output key]"}`` for inputs that are exactly a
        recorded module's output.
    """

    name: str
    start: int
    end: int = -1
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    producers: dict[str, str] = field(default_factory=dict)


def per_atom_tensors(value: Any, rows: int, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` for every floating tensor with ``rows`` rows in ``value``
    (a tensor, or a tuple / list / dict of them, one level deep)."""
    if isinstance(value, torch.Tensor):
        if value.ndim >= 1 and value.shape[0] == rows and value.is_floating_point():
            yield prefix, value
    elif isinstance(value, tuple | list) and not prefix:
        for k, v in enumerate(value):
            yield from per_atom_tensors(v, rows, f"[{k}]")
    elif isinstance(value, dict) and not prefix:
        for k, v in value.items():
            yield from per_atom_tensors(v, rows, f"[{k!r}]")


class ModuleProbe:
    """Hooks on every non-TorchScript submodule of ``model`` (not the root itself).

    Use as a context manager around one forward; hooks are removed on exit.

    Parameters
    ----------
    model:
        The model (anything with ``named_modules``; else nothing is probed).
    rows:
        Returns the number of rows a per-atom tensor has (read at each call:
        under DD the halo plan may be rebuilt at the start of the forward).
    """

    def __init__(self, model: Any, rows: Callable[[], int]) -> None:
        self.model = model
        self._rows = rows
        self.calls: dict[str, Call] = {}
        self.not_probed: list[str] = []
        self._clock = 0
        self._handles: list[Any] = []
        self._producers: dict[int, str] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique while probing

    def __enter__(self) -> ModuleProbe:
        named = getattr(self.model, "named_modules", None)
        if named is None:
            return self
        for name, module in named():
            if isinstance(module, torch.jit.ScriptModule):
                if not name:  # TorchScript from the root down: nothing to hook
                    self.not_probed.append("<root>")
                    break
                if not any(name.startswith(f"{p}.") for p in self.not_probed):
                    self.not_probed.append(name)
                continue
            if not name:
                continue
            self._handles.append(
                module.register_forward_pre_hook(self._pre(name), with_kwargs=True)
            )
            self._handles.append(module.register_forward_hook(self._post(name)))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._producers.clear()
        self._alive.clear()

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name in self.calls:
                return  # first call only
            self._clock += 1
            call = Call(name=name, start=self._clock)
            rows = self._rows()
            items = [(str(k), a) for k, a in enumerate(args)] + list(kwargs.items())
            for key, value in items:
                for sub, t in per_atom_tensors(value, rows):
                    call.inputs[key + sub] = t.detach().cpu().clone()
                    producer = self._producers.get(id(t))
                    if producer is not None:
                        call.producers[key + sub] = producer
            self.calls[name] = call

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(_m: Any, _args: Any, output: Any) -> None:
            call = self.calls.get(name)
            if call is None or call.end >= 0:
                return
            self._clock += 1
            call.end = self._clock
            for key, t in per_atom_tensors(output, self._rows()):
                call.outputs[key] = t.detach().cpu().clone()
                self._producers[id(t)] = f"{name}{key}"
                self._alive.append(t)

        return hook
