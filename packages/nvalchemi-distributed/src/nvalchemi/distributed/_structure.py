"""Reading a ``--structure`` (or a run file's ``structure``) and checking it.

Shared by the argument checks (:mod:`nvalchemi.distributed._checks`) and the run
files (:mod:`nvalchemi.distributed._runfile`): one line per problem, before any
rank starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["MIN_DISTANCE", "read_structure", "structure_problems"]

#: Atoms closer than this (Angstrom) are refused as coincident or overlapping.
MIN_DISTANCE = 0.5


def read_structure(path: str, label: str | None = None) -> Any:
    """``ase.io.read(path)``, or ValueError with one line saying why not, which
    starts with ``label`` (default ``"--structure PATH"``).

    A file of several frames is refused unless ``PATH@INDEX`` picks one (ASE's
    own notation: ``run.extxyz@-1`` is the last frame, ``run.extxyz@0`` the first).
    """
    label = f"--structure {path}" if label is None else label
    file, index = Path(path), None
    if not file.exists() and "@" in path:
        name, _, at = path.rpartition("@")
        try:
            file, index = Path(name), int(at)
        except ValueError:
            raise ValueError(f"{label}: the frame after '@' must be an integer") from None
    if file.is_dir():
        raise ValueError(f"{label}: is a directory; give a structure file (.xyz, .cif, ...)")
    if not file.is_file():
        raise ValueError(f"{label}: no such file")
    try:
        from ase.io import read
    except ImportError as exc:
        raise ValueError(
            f"{label}: reading it needs ASE: pip install 'nvalchemi-distributed[demo]' "
            f"(the import failed with {type(exc).__name__}: {exc})"
        ) from None
    try:
        frames = read(str(file), index=":")
    except Exception as exc:  # ASE raises anything from KeyError to StopIteration
        if isinstance(exc, KeyError):
            detail = f"unknown element symbol {exc}"
        else:
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ValueError(f"{label}: ase.io.read cannot read it ({detail})") from None
    frames = frames if isinstance(frames, list) else [frames]
    if not frames:
        raise ValueError(f"{label}: holds no structure")
    if index is not None:
        if not -len(frames) <= index < len(frames):
            raise ValueError(f"{label}: holds {len(frames)} frames, no frame {index}")
        return frames[index]
    if len(frames) != 1:
        raise ValueError(
            f"{label}: holds {len(frames)} frames; pick one with {file}@INDEX "
            f"(e.g. {file}@-1 for the last)"
        )
    return frames[0]


def structure_problems(label: str, atoms: Any, *, periodic: bool = False) -> list[str]:
    """What makes the ASE ``atoms`` read for ``label`` unusable: no atoms,
    non-finite positions, a periodic axis without a cell vector, and with
    ``periodic`` (NPT) an axis that is not periodic."""
    import numpy as np

    if len(atoms) == 0:
        return [f"{label}: holds no atoms"]
    out = []
    if not np.isfinite(atoms.get_positions()).all():
        out.append(f"{label}: positions are not all finite")
    pbc, cell = atoms.get_pbc(), np.asarray(atoms.get_cell())
    flat = [a for a in range(3) if pbc[a] and not np.linalg.norm(cell[a]) > 0]
    if flat:
        out.append(f"{label}: periodic axes {flat} have no cell vector")
    rows = cell[[a for a in range(3) if np.linalg.norm(cell[a]) > 0]]
    singular = len(rows) >= 2 and bool(np.isfinite(rows).all())
    if singular:
        scale = float(np.abs(rows).max())
        singular = int(np.linalg.matrix_rank(rows, tol=1e-9 * scale)) < len(rows)
        if singular:
            out.append(
                f"{label}: the cell vectors {np.round(rows, 6).tolist()} are linearly "
                "dependent (a cell of zero volume)"
            )
    if periodic and not bool(np.all(pbc)):
        out.append(
            f"{label}: --ensemble npt needs a cell periodic on every axis, got pbc {pbc.tolist()}"
        )
    if not out:
        out += _coincident(label, atoms)
    return out


def _coincident(label: str, atoms: Any) -> list[str]:
    """The closest pair of atoms nearer than :data:`MIN_DISTANCE` (periodic images
    included), as one problem; none without ASE's neighbour list."""
    try:
        from ase.neighborlist import neighbor_list
    except ImportError:  # pragma: no cover - ase reads the structure in the first place
        return []
    i, j, d = neighbor_list("ijd", atoms, MIN_DISTANCE)  # type: ignore[no-untyped-call]
    keep = i < j
    if not keep.any():
        return []
    k = int(d[keep].argmin())
    a, b, dist = int(i[keep][k]), int(j[keep][k]), float(d[keep][k])
    more = int(keep.sum()) - 1
    also = f" ({more} more such pair(s))" if more else ""
    return [
        f"{label}: atoms {a} and {b} are {dist:.3g} A apart, closer than {MIN_DISTANCE} A "
        f"(coincident or overlapping atoms){also}"
    ]
