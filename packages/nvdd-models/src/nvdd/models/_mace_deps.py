"""mace-torch and e3nn, imported on first use (the ``nvdd-models[mace]`` extra).

The ``weights_only`` situation
------------------------------
Since torch 2.6, ``torch.load`` defaults to ``weights_only=True``, which refuses
any pickled Python object other than tensors and a few containers. Two things in
the MACE stack do not fit that default:

- e3nn 0.4.4 loads its own ``constants.pt`` at import time with a bare
  ``torch.load``; the file holds ``slice`` objects, so the import fails under the
  new default;
- a mace-torch ``.model`` file is a whole pickled ``torch.nn.Module`` (classes
  and all), which only ``weights_only=False`` can read.

mace-torch's answer is to set ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` in
``os.environ`` when ``mace`` is imported, which turns the default of *every*
later ``torch.load`` in the process back to full unpickling. This module imports
``mace`` and e3nn with that variable set (as they require; it is set here too,
in case ``mace`` was imported earlier and the variable changed since), then restores the
variable to what it was before, so importing nvdd's MACE support does not
silently change how the rest of the program loads files. Model files are loaded
by :func:`nvdd.models.load_mace` with an explicit ``weights_only=False``: only
load files you trust (unpickling can run arbitrary code).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType

from nvdd.core import OptionalDependencyError, verbose

__all__ = ["cueq_available", "cueq_import_error", "mace_module"]

_ENV = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
_EXTRA = "nvdd-models[mace]"
_imported = False
#: What mace-torch prints at import when cuEquivariance does not import.
_CUEQ_NOTICE = "cuequivariance or cuequivariance_torch is not available"


def _import_stack() -> None:
    """Import mace (which sets ``_ENV``) and e3nn, then restore ``_ENV``."""
    global _imported
    if _imported:
        return
    before = os.environ.get(_ENV)
    try:
        # What mace's own __init__ does, also when mace was imported before.
        os.environ[_ENV] = "1"
        with warnings.catch_warnings():
            # torch warns that the variable forces weights_only=False for e3nn's
            # constants file, and e3nn's code generation warns about TorchScript
            # annotations: both are about the third-party import, not the caller.
            warnings.simplefilter("ignore")
            with _without_cueq_notice():
                importlib.import_module("mace")
                importlib.import_module("e3nn.o3")
                importlib.import_module("mace.modules")
    except ImportError as exc:
        missing = getattr(exc, "name", None) or "mace-torch"
        package = "e3nn" if missing.startswith("e3nn") else "mace-torch"
        raise OptionalDependencyError(
            package, "the MACE wrapper (nvdd.models.MACEModel)", _EXTRA, cause=exc
        ) from exc
    finally:
        if before is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = before
    _imported = True


@contextlib.contextmanager
def _without_cueq_notice() -> Iterator[None]:
    """mace-torch prints "cuequivariance ... is not available" at import, in every
    process; keep stdout's other lines, and that one only with ``NVDD_VERBOSE=1``
    (``MACEModel(cueq=True)`` says why cuEquivariance cannot be used)."""
    if verbose():
        yield
        return
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        kept = [line for line in buf.getvalue().splitlines(True) if _CUEQ_NOTICE not in line]
        if kept:
            sys.stdout.write("".join(kept))


def mace_module(name: str) -> ModuleType:
    """``importlib.import_module(name)`` for a module of mace-torch or e3nn.

    Raises
    ------
    OptionalDependencyError
        When mace-torch or e3nn is not installed (with the install hint).
    """
    _import_stack()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def cueq_available() -> bool:
    """Whether MACE's cuEquivariance kernels can run: cuequivariance-torch and its
    CUDA ops library (``cuequivariance_ops_torch``, from
    ``cuequivariance-ops-torch-cu12`` / ``-cu13``) both import. Without the ops
    library cuequivariance-torch falls back to a naive implementation that
    mace-torch 0.3's converter cannot use, so that install counts as absent."""
    return cueq_import_error() is None


def cueq_import_error() -> ImportError | None:
    """The error importing cuEquivariance raised (None when it imports): the
    missing package itself, or one of its own dependencies."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module("cuequivariance")
            importlib.import_module("cuequivariance_torch")
            importlib.import_module("cuequivariance_ops_torch")
    except ImportError as exc:
        return exc
    return None
