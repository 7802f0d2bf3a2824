"""Warp's view of a torch CUDA stream, made once per stream.

``warp.stream_from_torch`` wraps a stream handle in a new Python object on each
call (host time a replayed launch then pays again); every package that launches
Warp kernels on torch's current stream asks here instead. nvdd-core does not
depend on Warp: the import happens at the first call, which only packages that
launch Warp kernels (and so depend on warp-lang) make.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["warp_stream"]

_STREAMS: dict[int, Any] = {}


def warp_stream(stream: Any) -> Any:
    """Warp's stream for the torch CUDA stream ``stream``, cached by its handle
    (``stream.cuda_stream``)."""
    handle = int(stream.cuda_stream)
    found = _STREAMS.get(handle)
    if found is None:
        warp: Any = importlib.import_module("warp")
        found = _STREAMS[handle] = warp.stream_from_torch(stream)
    return found
