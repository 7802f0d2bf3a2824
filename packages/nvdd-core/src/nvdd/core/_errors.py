"""The nvdd error hierarchy.

Every error nvdd raises on purpose derives from :class:`NvddError`, and also from
the builtin a caller would naturally catch (``ValueError`` for bad input,
``RuntimeError`` for failures at run time, ``ImportError`` for a missing optional
dependency), so ``except ValueError`` keeps working in user code.
"""

from __future__ import annotations

__all__ = [
    "CapacityOverflowError",
    "CommunicationError",
    "ConfigurationError",
    "NvddError",
    "OptionalDependencyError",
    "ValidationError",
]


class NvddError(Exception):
    """Root of every error nvdd raises on purpose."""


class ValidationError(NvddError, ValueError):
    """Input data (a batch, a tensor, positions) is malformed."""


class ConfigurationError(NvddError, ValueError):
    """A configuration value (a config field, a spec, an argument) is invalid."""


class CommunicationError(NvddError, RuntimeError):
    """A collective or the process-group setup failed."""


class CapacityOverflowError(NvddError, RuntimeError):
    """A fixed-capacity buffer was too small and could not be regrown."""


class OptionalDependencyError(NvddError, ImportError):
    """An optional dependency needed by the called feature is not installed."""

    def __init__(self, package: str, feature: str, extra: str | None = None) -> None:
        hint = f"pip install {package}" if extra is None else f"pip install '{extra}'"
        super().__init__(f"{feature} needs the optional dependency {package!r}: {hint}")
        self.package = package
