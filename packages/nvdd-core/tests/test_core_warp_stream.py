"""`warp_stream`: one Warp stream object per torch stream handle."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from nvdd.core import _warp_stream, warp_stream


class _TorchStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


def test_each_handle_is_wrapped_once(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []

    def stream_from_torch(stream: Any) -> tuple[str, int]:
        made.append(stream.cuda_stream)
        return ("warp", stream.cuda_stream)

    fake = types.ModuleType("warp")
    fake.stream_from_torch = stream_from_torch  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "warp", fake)
    monkeypatch.setattr(_warp_stream, "_STREAMS", {})
    a, b = _TorchStream(0x1000), _TorchStream(0x2000)
    first = warp_stream(a)
    assert warp_stream(_TorchStream(0x1000)) is first  # the same handle: the cached object
    assert warp_stream(b) == ("warp", 0x2000) and first == ("warp", 0x1000)
    assert made == [0x1000, 0x2000]
