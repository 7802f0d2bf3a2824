"""The one place that touches nvalchemi-toolkit-ops (the optional ``longrange`` extra).

The Ewald and PME models call the toolkit's framework-agnostic Warp launchers
(``nvalchemiops.interactions.electrostatics``) and its torch spline and PME
convolution ops; this module imports them lazily (an install hint when the
extra is missing), converts torch tensors to Warp arrays without copies, and
launches on the torch stream of the tensors' device. Every launcher here works
on the ``cpu`` Warp device as on CUDA.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from functools import cache
from types import ModuleType
from typing import Any

import torch

from nvdd.core import OptionalDependencyError, init_warp

__all__ = ["elec", "launch_scope", "spline", "to_wp", "warp", "wp_types"]

_EXTRA = "nvdd-models[longrange]"


def _import(name: str, feature: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise OptionalDependencyError(
            "nvalchemi-toolkit-ops", feature, extra=_EXTRA, cause=exc
        ) from exc


@cache
def warp() -> Any:
    """The ``warp`` module, initialised once."""
    _import("warp", "Ewald / PME")
    return init_warp()  # quiet unless NVDD_VERBOSE=1


@cache
def elec() -> Any:
    """``nvalchemiops.interactions.electrostatics`` (the Warp launchers)."""
    return _import("nvalchemiops.interactions.electrostatics", "Ewald / PME")


@cache
def spline() -> Any:
    """``nvalchemiops.torch.spline`` (B-spline spread / gather ops)."""
    return _import("nvalchemiops.torch.spline", "PME")


@cache
def pme_torch() -> Any:
    """``nvalchemiops.torch.interactions.electrostatics.pme`` (registers the convolve op)."""
    module = _import("nvalchemiops.torch.interactions.electrostatics.pme", "PME")
    module.register_pme_ops()
    return module


def wp_types(dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """Warp ``(scalar, vec3, mat33)`` types of a torch float dtype."""
    wp = warp()
    if dtype == torch.float64:
        return wp.float64, wp.vec3d, wp.mat33d
    if dtype == torch.float32:
        return wp.float32, wp.vec3f, wp.mat33f
    raise TypeError(f"Ewald / PME need float32 or float64, got {dtype}")


def to_wp(t: torch.Tensor, dtype: Any) -> Any:
    """A Warp view of a contiguous torch tensor (no copy)."""
    return warp().from_torch(t.contiguous(), dtype=dtype, requires_grad=False)


@contextlib.contextmanager
def launch_scope(device: torch.device) -> Iterator[str]:
    """Yield the Warp device name of ``device``; on CUDA, launch on torch's current stream."""
    wp = warp()
    if device.type != "cuda":
        yield "cpu"
        return
    name = f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    stream = wp.stream_from_torch(torch.cuda.current_stream(device))
    with wp.ScopedStream(stream):
        yield name
