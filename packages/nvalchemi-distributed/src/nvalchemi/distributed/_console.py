"""What ``nvdd run`` prints besides its results: little, and once.

- Python warnings: one line each, ``nvdd: warning: MESSAGE`` (no source path,
  no code line), each message once per process; ranks other than 0 show none,
  since every rank meets the same ones (all ranks, prefixed with the rank, with
  ``NVDD_VERBOSE=1`` or ``--verbose``).
- Warp's banner and module-load lines: off unless verbose
  (:func:`nvdd.core.init_warp`).
- The progress bar: only when stderr is a terminal (no carriage returns in logs).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import warnings
from typing import Any, TextIO

from nvdd.core import init_warp, verbose

__all__ = ["install_warning_format", "missing_outputs", "progress_bar", "quiet_warp"]


def install_warning_format(rank: int) -> None:
    """Show each warning of this process once, on one line without its source
    path; on ranks other than 0 not at all unless verbose."""
    seen: set[tuple[type, str]] = set()
    loud = verbose()

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        key = (category, str(message))
        if key in seen or (rank != 0 and not loud):
            return
        seen.add(key)
        where = f" (rank {rank})" if loud else ""
        out = file if file is not None else sys.stderr
        with contextlib.suppress(OSError):  # stderr gone: a warning is not worth a crash
            out.write(f"nvdd: warning{where}: {message}\n")

    warnings.showwarning = show


def quiet_warp() -> None:
    """Initialise Warp now, quiet unless verbose (before any model imports it)."""
    with contextlib.suppress(ImportError):  # the ranks report a missing Warp where used
        init_warp()


def progress_bar(total: int, initial: int) -> Any:
    """A tqdm bar on stderr when stderr is a terminal and tqdm is installed; else None."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=min(initial, total), unit="step", leave=False)


#: Outputs that need an optional package: (module, package, what is skipped).
_OUTPUT_DEPS = (
    ("ase.io", "ase", "trajectory.extxyz"),
    ("matplotlib", "matplotlib", "energies.png"),
)


def missing_outputs(trajectory: bool) -> list[str]:
    """One line per output the run will skip because its package does not import,
    with the install hint and the import's own error."""
    notes = []
    for module, package, output in _OUTPUT_DEPS:
        if output.startswith("trajectory") and not trajectory:
            continue
        try:
            importlib.import_module(module)
        except ImportError as exc:
            notes.append(
                f"nvdd run: no {output}: it needs {package}: pip install "
                f"'nvalchemi-distributed[demo]' (the import failed with "
                f"{type(exc).__name__}: {exc})"
            )
    return notes
