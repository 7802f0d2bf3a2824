"""Warp plumbing of the package's kernels: lazy set-up, tensor views and cheap launches.

``warp`` is imported and initialised on first use, never at import time of
``nvdd.models``. :data:`Kernel` is ``nvdd.core.RecordedKernel``: one recorded
Warp launch per signature, replayed with only the changed arguments reset (a
replay costs a few microseconds of Python, a fresh ``wp.launch`` about five
times more), on torch's current stream on CUDA, registered with an emulated
capture.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from nvdd.core import OptionalDependencyError, RecordedKernel, init_warp

__all__ = ["Kernel", "declare_overloads", "warp_module"]

_INSTALL_HINT = "pip install 'warp-lang>=1.5'"


@cache
def warp_module() -> Any:
    """The initialised ``warp`` module (imported on first use)."""
    try:
        import warp
    except ImportError as exc:  # pragma: no cover - warp is a declared dependency
        raise OptionalDependencyError(
            "warp-lang", "the Warp backend of nvdd.models", install=_INSTALL_HINT, cause=exc
        ) from exc
    wp: Any = warp  # Warp's stubs type its kernel language, not this use
    init_warp()  # quiet unless NVDD_VERBOSE=1
    return wp


#: The package's launcher: ``nvdd.core.RecordedKernel`` (one recorded launch per
#: signature; changed tensors set as array descriptors; emulated captures see it).
Kernel = RecordedKernel


def declare_overloads(*kernels: Kernel) -> None:
    """Declare the float overloads of ``kernels`` (before the first launch of their module)."""
    warp_module()  # (initialised quietly before the first declaration)
    for kernel in kernels:
        kernel.declare_overloads()
