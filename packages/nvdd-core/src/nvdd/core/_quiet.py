"""What nvdd prints by default: results, not the libraries' chatter.

Warp prints a banner when it initialises and a line per kernel module it loads,
in every process; on a host without a CUDA driver it also prints a warning from
C. nvdd initialises Warp through :func:`init_warp`, which keeps all of that
quiet unless ``NVDD_VERBOSE=1`` (:data:`VERBOSE_ENV`) asks for it. Warp's own
warnings and errors still show.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

__all__ = ["VERBOSE_ENV", "init_warp", "verbose"]

#: Environment variable: ``1`` shows Warp's banner and module-load lines.
VERBOSE_ENV = "NVDD_VERBOSE"

#: A line Warp's C library writes to stderr on a host without a CUDA driver.
_NO_DRIVER = "Could not find or load the NVIDIA CUDA driver"


def verbose() -> bool:
    """Whether ``NVDD_VERBOSE`` asks for the libraries' informational output."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def init_warp() -> Any:
    """Import and initialise Warp (once; later calls return the module).

    Unless :func:`verbose`: no banner, no ``Module ... load`` lines (Warp's log
    level is set to warnings, or ``warp.config.quiet`` on older Warp), and no
    "Could not find or load the NVIDIA CUDA driver" line on CPU-only hosts.
    """
    wp: Any = importlib.import_module("warp")
    loud = verbose()
    wp.config.quiet = not loud
    level = getattr(wp, "LOG_WARNING", None)
    if level is not None and hasattr(wp.config, "log_level"):
        wp.config.log_level = getattr(wp, "LOG_INFO", 20) if loud else level
    if loud:
        wp.init()
    else:
        with _without_driver_notice():
            wp.init()
    return wp


@contextlib.contextmanager
def _without_driver_notice() -> Iterator[None]:
    """Run the body with file descriptor 2 captured; write back every line but
    Warp's missing-driver notice."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real stderr: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode("utf-8", errors="replace")
            kept = [line for line in text.splitlines(True) if _NO_DRIVER not in line]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
