"""The nvdd error hierarchy.

Every error nvdd raises on purpose derives from :class:`NvddError`, and also from
the builtin a caller would naturally catch (``ValueError`` for bad input,
``RuntimeError`` for failures at run time, ``ImportError`` for a missing optional
dependency), so ``except ValueError`` keeps working in user code.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = [
    "CapacityOverflowError",
    "CommunicationError",
    "ConfigurationError",
    "NvddError",
    "OptionalDependencyError",
    "ValidationError",
    "import_optional",
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
    """An optional dependency needed by the called feature is not installed (or
    does not import).

    The message names the feature, the package, the install command and, when
    the import failed, the underlying exception (the import of an installed
    package can fail on *its* missing dependency)::

        MACEModel(cueq=True) needs cuequivariance-torch: pip install ... (the
        import failed with ModuleNotFoundError: No module named 'platformdirs')

    Parameters
    ----------
    package:
        The distribution to install.
    feature:
        What needs it, in a user's words.
    extra:
        A pip requirement with an extra (``"nvdd-models[mace]"``); the hint
        becomes ``pip install 'EXTRA'`` (default ``pip install PACKAGE``).
    cause:
        The exception the import raised (also kept as ``.cause``).
    install:
        The whole install hint, when it is not one requirement.
    """

    def __init__(
        self,
        package: str,
        feature: str,
        extra: str | None = None,
        *,
        cause: BaseException | None = None,
        install: str | None = None,
    ) -> None:
        if install is None:
            install = f"pip install {package}" if extra is None else f"pip install '{extra}'"
        message = f"{feature} needs {package}: {install}"
        if cause is not None:
            detail = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
            message += f" (the import failed with {detail})"
        super().__init__(message)
        self.package = package
        self.cause = cause


def import_optional(
    module: str,
    *,
    package: str,
    feature: str,
    extra: str | None = None,
    install: str | None = None,
) -> ModuleType:
    """``importlib.import_module(module)``, or :class:`OptionalDependencyError`
    with the install hint and the import's own error.

    Raises
    ------
    OptionalDependencyError
        When the import fails (any ``ImportError``, including one raised by a
        dependency of ``module``); chained to that error.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise OptionalDependencyError(package, feature, extra, cause=exc, install=install) from exc
