"""`TensorMemo`: remember a tensor by identity and version, not by value."""

from __future__ import annotations

import weakref

import torch

__all__ = ["TensorMemo"]


class TensorMemo:
    """Remembers one tensor by identity and version (content unchanged since).

    A check against it costs no device work: comparing values would be a host
    read on an accelerator. The tensor is held weakly.
    """

    def __init__(self) -> None:
        self._ref: weakref.ReferenceType[torch.Tensor] | None = None
        self._version = -1

    def __getstate__(self) -> dict[str, int]:
        """A pickled memo forgets its tensor (a cache: the copy compares by value)."""
        return {}

    def __setstate__(self, state: dict[str, int]) -> None:
        self._ref = None
        self._version = -1

    def same(self, t: torch.Tensor | None) -> bool:
        """Whether ``t`` is the remembered tensor, not modified in place since
        (writes that bypass torch's version counter are not seen)."""
        return (
            t is not None and self._ref is not None and self._ref() is t
            and t._version == self._version
        )  # fmt: skip

    def remember(self, t: torch.Tensor) -> None:
        """Remember ``t`` (weakly) at its current version."""
        self._ref = weakref.ref(t)
        self._version = t._version
