"""Output files that never hold half a write.

Two kinds of output, two disciplines:

- whole files (a plot, a checkpoint shard, a manifest) go through
  :func:`atomic_write`: written to a temporary file in the same directory,
  flushed, fsynced, then renamed over the target with ``os.replace``. A reader
  sees the old file or the new one, never a mix; a failure (a full disk, an
  exception, a signal) leaves the old file untouched and removes the temporary;
- streamed logs (a thermo table, a trajectory) go through :class:`AppendLog`:
  every record is appended and flushed as it comes, and a record whose write
  fails is cut off again, so the log holds whole records only.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["AppendLog", "atomic_write"]

#: Permissions of files nvdd creates (before the umask).
_FILE_MODE = 0o666


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a rename inside ``directory`` durable (a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str], mode: str = "w", *, encoding: str | None = None
) -> Iterator[IO[Any]]:
    """Write ``path`` all at once, or not at all.

    Yields a file object on a temporary file in ``path``'s directory. When the
    block ends normally the file is flushed, fsynced and renamed over ``path``
    (``os.replace``: atomic on POSIX and Windows); when it raises (an
    ``OSError`` from a full disk, a ``SystemExit`` from a signal, anything), the
    temporary file is removed and ``path`` keeps its previous content.

    Parameters
    ----------
    path:
        The target; its directory must exist.
    mode:
        ``"w"`` (text) or ``"wb"`` (binary).
    encoding:
        Text encoding (default UTF-8 in text mode).

    Examples
    --------
    >>> with atomic_write(out / "thermo.csv") as f:  # doctest: +SKIP
    ...     f.write(text)
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode must be 'w' or 'wb', got {mode!r}")
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, _FILE_MODE & ~_umask())
        if mode == "wb":
            f: IO[Any] = os.fdopen(fd, "wb")
        else:
            f = os.fdopen(fd, "w", encoding=encoding or "utf-8", newline="")
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


class AppendLog:
    """An append-only log of whole records, flushed record by record.

    Each :meth:`append` writes its record with unbuffered writes and returns
    only when the bytes reached the operating system, so a reader (``tail -f``)
    sees every record as it comes and a crash loses nothing already appended.
    A record whose write fails (``ENOSPC``, an interrupted write) is cut off
    again before the error propagates: the file holds whole records only.

    Parameters
    ----------
    path:
        The log file; its directory must exist.
    keep:
        Append to an existing file (a restart) instead of starting it empty.
    header:
        Written first when the file is new or empty (e.g. a CSV header line).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, keep: bool = False, header: str | None = None
    ) -> None:
        self.path = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if keep else os.O_TRUNC)
        self._fd: int | None = os.open(self.path, flags, _FILE_MODE)
        if header is not None and os.fstat(self._fd).st_size == 0:
            self.append(header)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._fd is None

    def append(self, record: str | bytes) -> None:
        """Append one record (text is UTF-8 encoded) and flush it to the OS.

        Raises
        ------
        OSError
            When the write fails; the partial record has been removed.
        ValueError
            When the log is closed.
        """
        if self._fd is None:
            raise ValueError(f"AppendLog {self.path}: closed")
        data = record.encode("utf-8") if isinstance(record, str) else bytes(record)
        fd = self._fd
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise

    def sync(self) -> None:
        """fsync the log (records are already flushed; this makes them durable)."""
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        """fsync and close; idempotent."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            with contextlib.suppress(OSError):
                os.fsync(fd)
        finally:
            os.close(fd)

    def __enter__(self) -> AppendLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AppendLog({str(self.path)!r}, closed={self.closed})"
