"""`AdapterRegistry`: the install / restore lifecycle of a set of adapters."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType

from nvdd.core import ConfigurationError
from nvdd.spec._adapters import Adapter
from nvdd.spec._patching import AdapterError, Patch, remove_patch

__all__ = ["AdapterRegistry", "AdapterStatus"]


@dataclass
class AdapterStatus:
    """Introspectable record of one adapter's lifecycle state.

    Attributes
    ----------
    adapter:
        ``"<kind> <target>"``.
    applied:
        True while the adapter's patches are installed.
    declared_in:
        Where it was declared (a preset or model name), if known.
    error:
        Why it is not applied (an optional adapter whose module is missing), or
        why installing it failed.
    """

    adapter: str
    applied: bool = False
    declared_in: str | None = None
    error: str | None = None


class AdapterRegistry:
    """Owns the install / restore lifecycle for a set of adapters.

    Adapters are deduplicated by :meth:`Adapter.key`. :meth:`install` applies them
    in order; if a non-optional one fails, the ones already applied are restored
    and the error is raised (nothing stays half-installed). :meth:`restore` undoes
    everything in reverse order, exactly (also when an exception left the scope).
    Use as a context manager: ``with AdapterRegistry(spec.adapters()): ...``.
    Installing the same adapter from two registries (nested scopes, two model
    instances) is reference counted: the patch stays until the last one restores.
    """

    def __init__(self, adapters: Iterable[Adapter] = ()) -> None:
        self._adapters: list[Adapter] = []
        seen: set[object] = set()
        for a in adapters:
            if not isinstance(a, Adapter):
                raise ConfigurationError(f"AdapterRegistry takes adapters, got {a!r}")
            if a.key() not in seen:
                seen.add(a.key())
                self._adapters.append(a)
        self._statuses = [
            AdapterStatus(adapter=f"{a.kind} {a.target}", declared_in=a.declared_in)
            for a in self._adapters
        ]
        self._installed: list[list[Patch]] = []

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        """The deduplicated adapters, in install order."""
        return tuple(self._adapters)

    @property
    def statuses(self) -> tuple[AdapterStatus, ...]:
        """One status per adapter, in install order."""
        return tuple(self._statuses)

    @property
    def active(self) -> bool:
        """Whether :meth:`install` ran and :meth:`restore` has not."""
        return bool(self._installed)

    def install(self) -> None:
        """Apply every adapter. Raises if already active or a required one fails."""
        if self._installed:
            raise AdapterError("AdapterRegistry.install: already installed; restore first")
        done: list[list[Patch]] = []
        for adapter, status in zip(self._adapters, self._statuses, strict=True):
            try:
                patches = adapter.install()
            except Exception as exc:
                status.error = f"{type(exc).__name__}: {exc}"
                if adapter.optional:
                    continue
                for patches_ in reversed(done):
                    for p in reversed(patches_):
                        remove_patch(p)
                for s in self._statuses:
                    s.applied = False
                raise AdapterError(
                    f"adapter {status.adapter} (declared in {status.declared_in}) failed to "
                    f"install: {status.error}"
                ) from exc
            status.applied, status.error = True, None
            done.append(patches)
        self._installed = done if done else [[]]

    def restore(self) -> None:
        """Undo every installed patch, newest first. A no-op when not installed.

        If a patch cannot be restored yet (another scope patched the same attribute
        later and is still open), the error is raised and the patches not restored
        stay registered, so a later :meth:`restore` finishes the job.
        """
        while self._installed:
            patches = self._installed[-1]
            while patches:
                remove_patch(patches[-1])
                patches.pop()
            self._installed.pop()
        for s in self._statuses:
            s.applied = False

    @contextmanager
    def scope(self) -> Iterator[AdapterRegistry]:
        """Install for the duration of a ``with`` block (restored on exceptions too)."""
        self.install()
        try:
            yield self
        finally:
            self.restore()

    def __enter__(self) -> AdapterRegistry:
        self.install()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.restore()

    def __repr__(self) -> str:
        return f"AdapterRegistry({len(self._adapters)} adapters, active={self.active})"
