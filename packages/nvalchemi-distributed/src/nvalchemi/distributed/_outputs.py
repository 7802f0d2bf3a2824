"""The files ``nvdd run`` writes on rank 0, none of them ever half-written,
none of them empty (a file is created with its first row or frame).

- ``thermo.csv``: streamed, one whole row per thermo step (:class:`ThermoLog`);
- ``trajectory.extxyz``: streamed, one whole frame per trajectory step
  (:class:`TrajectoryLog`);
- ``energies.png``: written atomically at the end (:func:`write_plot`);
- ``checkpoint/``: see ``nvdd.dynamics.save_checkpoint`` (atomic as a whole).

On a restart the streamed files keep what was written up to the checkpoint's
step and continue from there: they are cut back (rewritten atomically) only
when the restart's first step succeeded (:meth:`ThermoLog.start`), so a restart
that fails before leaves them as they were.
"""

from __future__ import annotations

import io
import math
import os
import shutil
from pathlib import Path
from typing import Any

from nvdd.core import AppendLog, atomic_write

__all__ = [
    "THERMO_KEYS",
    "ThermoLog",
    "TrajectoryLog",
    "next_due",
    "nve_drift_per_atom",
    "output_due",
    "remove_outputs",
    "write_plot",
]

#: Columns of thermo.csv.
THERMO_KEYS = (
    "step",
    "T",
    "E_pot",
    "E_kin",
    "E_tot",
    "n_atoms",
    "atoms_min",
    "atoms_max",
    "ms_per_step",
    "E_ext",
    "V",
    "P_bar",
)


class _LazyLog:
    """An :class:`~nvdd.core.AppendLog` opened at its first record, so that a
    run that records nothing leaves no empty file behind."""

    def __init__(self, path: Path, *, keep: bool, header: str | None = None) -> None:
        self.path, self._keep, self._header = path, keep, header
        self._log: AppendLog | None = None
        self._closed = False

    def append(self, record: str) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: closed")
        if self._log is None:
            self._log = AppendLog(self.path, keep=self._keep, header=self._header)
        self._log.append(record)

    def close(self) -> None:
        self._closed = True
        if self._log is not None:
            self._log.close()


def output_due(step: int, every: int, total: int) -> bool:
    """Whether a thermo row (or a frame) with period ``every`` is due at the
    global ``step`` of a run of ``total`` steps: step 0, every multiple of
    ``every`` counted over the whole run (not per phase), and the last step.
    ``every <= 0``: never."""
    return every > 0 and (step == 0 or step % every == 0 or step == total)


def next_due(step: int, every: int, stop: int) -> int:
    """The next multiple of ``every`` after ``step``, at most ``stop`` (``stop``
    for ``every <= 0``)."""
    return min(stop, (step // every + 1) * every) if every > 0 else stop


class ThermoLog:
    """``thermo.csv``, a row appended and flushed as each thermo step comes.

    Parameters
    ----------
    path:
        The CSV file.
    keep_until:
        On a restart, the checkpoint's step: rows up to it are kept, later ones
        (written after the checkpoint by the interrupted run) dropped, but only
        at :meth:`start` (the restart's first successful step); rows appended
        before are held until then. None: a fresh file, started at once.
    """

    def __init__(self, path: Path, keep_until: int | None = None) -> None:
        self.path = path
        self.rows: list[dict[str, float]] = []
        self._header = ",".join(THERMO_KEYS) + "\n"
        self._log: _LazyLog | None = None
        if keep_until is None:
            self._log = _LazyLog(path, keep=False, header=self._header)
        elif path.exists():
            self.rows = [r for r in _read_rows(path) if r["step"] <= keep_until]

    @property
    def started(self) -> bool:
        """Whether the file is being written (a fresh run, or a restart's first step done)."""
        return self._log is not None

    def start(self) -> None:
        """Cut the file back to the kept rows (atomically), write the rows held
        since and stream from now on; nothing when already started."""
        if self._log is not None:
            return
        if self.path.exists() or self.rows:  # the kept rows and those held since
            with atomic_write(self.path) as f:
                f.write(self._header + "".join(_line(r) for r in self.rows))
        self._log = _LazyLog(self.path, keep=True, header=self._header)

    def append(self, row: dict[str, float]) -> None:
        """Record and stream one row (keys :data:`THERMO_KEYS`); held until
        :meth:`start` on a restart."""
        if self._log is not None:
            self._log.append(_line(row))
        self.rows.append(row)

    def close(self) -> None:
        """fsync and close (rows held on a restart that never started are dropped)."""
        if self._log is not None:
            self._log.close()


def _line(row: dict[str, float]) -> str:
    # E_ext (Nose-Hoover, NPT), V and P_bar (NPT) are NaN where the phase has none
    return ",".join(f"{row.get(k, math.nan):.10g}" for k in THERMO_KEYS) + "\n"


def _read_rows(path: Path) -> list[dict[str, float]]:
    lines = path.read_text().splitlines()
    if not lines or lines[0].split(",") != list(THERMO_KEYS):
        return []
    rows = []
    for line in lines[1:]:
        values = line.split(",")
        if len(values) == len(THERMO_KEYS):
            rows.append(dict(zip(THERMO_KEYS, map(float, values), strict=True)))
    return rows


class TrajectoryLog:
    """``trajectory.extxyz``, one whole frame appended per call.

    ``keep_until``: as for :class:`ThermoLog` (frames carry ``step=`` in their
    comment line); on a restart the file is cut back and written only from
    :meth:`start` on.
    """

    def __init__(self, path: Path, keep_until: int | None = None) -> None:
        self.path = path
        self.frames = 0
        self._keep_until = keep_until
        self._held: list[str] = []
        self._log: _LazyLog | None = None
        if keep_until is None:
            self._log = _LazyLog(path, keep=False)

    def start(self) -> None:
        """Cut the file back to the frames up to the checkpoint's step and write the
        frames held since (atomically), then stream from now on; once."""
        if self._log is not None:
            return
        kept: list[Any] = []
        if self.path.exists():
            from ase.io import read, write

            limit = self._keep_until if self._keep_until is not None else math.inf
            kept = [a for a in read(str(self.path), index=":") if int(a.info["step"]) <= limit]
            buf = io.StringIO()
            if kept:
                write(buf, kept, format="extxyz")
            with atomic_write(self.path) as f:
                f.write(buf.getvalue() + "".join(self._held))
        elif self._held:
            with atomic_write(self.path) as f:
                f.write("".join(self._held))
        self.frames += len(kept)
        self._held = []
        self._log = _LazyLog(self.path, keep=True)

    def append(self, atoms: list[Any], step: int) -> None:
        """Append the frame(s) of ``atoms`` (ASE Atoms), tagged with ``step``."""
        from ase.io import write

        for a in atoms:
            a.info["step"] = step
        buf = io.StringIO()
        write(buf, atoms, format="extxyz")
        if self._log is None:
            self._held.append(buf.getvalue())
        else:
            self._log.append(buf.getvalue())
        self.frames += 1

    def close(self) -> None:
        """fsync and close."""
        if self._log is not None:
            self._log.close()


def remove_outputs(out: str | os.PathLike[str]) -> None:
    """Delete the directory ``out`` (an earlier run's outputs; ``--overwrite``):
    renamed aside in one step first, so no run ever sees it half deleted, then
    removed. Nothing when it does not exist.

    Raises
    ------
    OSError
        When it cannot be renamed (it is then left as it was).
    """
    path = Path(out)
    if not path.exists():
        return
    aside = path.with_name(f".{path.name}.deleting-{os.getpid()}")
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def write_plot(rows: list[dict[str, float]], path: Path) -> bool:
    """Energies against step, written atomically; False without matplotlib or rows."""
    if not rows:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("E_pot", "E_kin", "E_tot"):
        ax.plot(steps, [r[key] for r in rows], label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("energy (eV)")
    ax.legend()
    ax.set_title("nvdd run: NVT then NVE")
    fig.tight_layout()
    try:
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format="png", dpi=120)
    finally:
        plt.close(fig)
    return True


def nve_drift_per_atom(rows: list[dict[str, float]], nvt_steps: int) -> float | None:
    """``|E_tot(last) - E_tot(first)| / n_atoms`` over the NVE rows (None with < 2)."""
    nve = [r for r in rows if r["step"] > nvt_steps]
    if len(nve) < 2:
        return None
    n = nve[-1]["n_atoms"]
    if not (math.isfinite(n) and n > 0):
        return None
    return abs(nve[-1]["E_tot"] - nve[0]["E_tot"]) / n
