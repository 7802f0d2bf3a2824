"""atomic_write and AppendLog: no output file ever holds half a write."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from nvdd.core import AppendLog, atomic_write


def _enospc(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_atomic_write_replaces_the_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "thermo.csv"
    target.write_text("old\n")
    with atomic_write(target) as f:
        f.write("new\n")
        assert target.read_text() == "old\n"  # nothing visible until the block ends
    assert target.read_text() == "new\n"
    with atomic_write(tmp_path / "plot.png", "wb") as f:
        f.write(b"\x89PNG")
    assert (tmp_path / "plot.png").read_bytes() == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "thermo.csv"]
    assert oct((tmp_path / "plot.png").stat().st_mode & 0o777) != oct(0o600)


def test_atomic_write_keeps_the_old_file_on_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "energies.png"
    target.write_bytes(b"good")
    monkeypatch.setattr(os, "fsync", _enospc)

    def write() -> None:
        with atomic_write(target, "wb") as f:
            f.write(b"half a plot")

    with pytest.raises(OSError, match="No space left"):
        write()
    assert target.read_bytes() == b"good"
    assert [p.name for p in tmp_path.iterdir()] == ["energies.png"]  # no temporary left


def test_atomic_write_keeps_the_old_file_on_an_exception(tmp_path: Path) -> None:
    target = tmp_path / "a.txt"
    target.write_text("good")

    def interrupted() -> None:
        with atomic_write(target) as f:
            f.write("partial")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert target.read_text() == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]
    with pytest.raises(ValueError, match="mode"), atomic_write(target, "a"):
        pass


def test_append_log_streams_whole_records(tmp_path: Path) -> None:
    path = tmp_path / "thermo.csv"
    log = AppendLog(path, header="step,T\n")
    log.append("1,90\n")
    assert path.read_text() == "step,T\n1,90\n"  # visible before close: streamed
    log.close()
    log.close()  # idempotent
    assert log.closed
    with pytest.raises(ValueError, match="closed"):
        log.append("2,91\n")
    with AppendLog(path, keep=True, header="step,T\n") as again:  # a restart: no 2nd header
        again.append(b"2,91\n")
        again.sync()
    assert path.read_text() == "step,T\n1,90\n2,91\n"
    with AppendLog(path, header="step,T\n"):  # a fresh run starts over
        pass
    assert path.read_text() == "step,T\n"
    assert "thermo.csv" in repr(log)


def test_append_log_cuts_a_record_that_did_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "trajectory.extxyz"
    log = AppendLog(path)
    log.append("frame 1\n")
    real_write = os.write

    def half_then_full(fd: int, data: bytes) -> int:
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        log.append("frame 2 with many more bytes\n")
    monkeypatch.undo()
    assert path.read_text() == "frame 1\n"  # the half record was cut off again
    log.append("frame 3\n")
    log.close()
    assert path.read_text() == "frame 1\nframe 3\n"
